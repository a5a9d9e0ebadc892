"""The sentinel: a few on-device numbers per step, read later, without synchronising each step.

While a watched step runs, the sentinel gathers device scalars: the loss the step returned, the
global norm of the gradients when the optimizer is about to read them (an optimizer step
pre-hook) and, in a step where the optimizer stepped, the global norm of the parameters at the
step's end (after what the step did past the optimizer too: an EMA or Lookahead folded back
into the weights, a clamp). A norm
is NaN or Inf as soon as one element is (a norm above about 1e19 also overflows to Inf: such a
step is broken anyway). At the step's end they are stacked into one small vector with a
``bad`` element computed on the device from the trigger, and copied to pinned host memory
behind a CUDA event (on the CPU the vector is simply kept). Under ``torch.distributed`` the
``bad`` element is summed over ranks with an asynchronous all-reduce, so every rank sees a trip
of any rank at the same step.

``Flag.read()`` is where the host finally looks: it waits for that step's event (or
all-reduce) only, never for the whole device. The watch reads a step's flag ``lag`` steps
later, when the device has the next step queued, so the wait costs no idle time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tracer.features.watch.snapshot import model_parameters

# Positions in the flag vector.
LOSS, GRAD_NORM, PARAM_NORM, BAD = 0, 1, 2, 3
NO_VALUE = 0.0  # a slot with nothing to check (no loss returned, no optimizer step): finite


@dataclass
class FlagValues:
    """A step's flag as read on the host."""

    loss: float | None
    grad_norm: float | None
    param_norm: float | None
    bad: bool  # this rank's trigger fired
    bad_anywhere: bool  # some rank's trigger fired (equals ``bad`` without torch.distributed)

    @property
    def nonfinite(self) -> bool:
        return any(v is not None and not math.isfinite(v) for v in (self.loss, self.grad_norm, self.param_norm))

    def reason(self) -> str:
        """What was not finite, in words."""
        parts = [f"{name} is {_word(v)}" for name, v in (("the loss", self.loss), ("the gradient norm", self.grad_norm),
                                                           ("the parameter norm (buffers included) at the end of "
                                                            "the step", self.param_norm))
                 if v is not None and not math.isfinite(v)]
        return ", ".join(parts)


def _word(v: float) -> str:
    return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")


class Flag:
    """One step's flag on its way to the host."""

    def __init__(self, vector: torch.Tensor, has: tuple[bool, bool, bool], work: Any = None,
                 global_bad: torch.Tensor | None = None) -> None:
        self.has = has  # which of loss, grad norm, param norm were measured
        self._work = work
        self._global_bad = global_bad
        self._event: torch.cuda.Event | None = None
        if vector.device.type == "cuda":
            if work is not None:
                work.wait()  # NCCL: makes the current stream wait for the all-reduce, not the host
                self._work = None
                vector = torch.cat([vector, global_bad.to(vector.dtype)]) if global_bad is not None else vector
                self._global_bad = None
            host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
            host.copy_(vector, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            vector = host
        self._vector = vector

    def read(self) -> FlagValues:
        if self._event is not None:
            self._event.synchronize()  # this step's flag only: later work stays queued
        if self._work is not None:
            self._work.wait()
        values = self._vector.tolist()
        if self._global_bad is not None:
            values.append(float(self._global_bad.item()))
        has = self.has
        bad = values[BAD] > 0
        bad_anywhere = values[BAD + 1] > 0 if len(values) > BAD + 1 else bad
        return FlagValues(values[LOSS] if has[0] else None, values[GRAD_NORM] if has[1] else None,
                          values[PARAM_NORM] if has[2] else None, bad, bad_anywhere)


def loss_of(result: Any) -> torch.Tensor | None:
    """The loss in what a step returned: a scalar tensor, ``.loss`` / ``["loss"]`` (a model
    output), the first element of a tuple, or a Python number."""
    if isinstance(result, torch.Tensor):
        return result if result.numel() == 1 else None
    if isinstance(result, int | float) and not isinstance(result, bool):
        return torch.tensor(float(result))
    loss = getattr(result, "loss", None)
    if loss is None and isinstance(result, Mapping):
        loss = result.get("loss")
    if loss is None and isinstance(result, tuple | list) and result:
        loss = result[0]
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    return None


DeviceTrigger = Callable[[torch.Tensor, Any], torch.Tensor]


class Sentinel:
    """Gathers one step's device scalars (see the module docstring).

    ``trigger(values, result)`` turns the stacked ``[loss, grad norm, param norm]`` and the
    step's return value into a 0-dim bool tensor on the device (no host read)."""

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.active = False
        self._losses: list[torch.Tensor] = []
        self._grad_norms: list[torch.Tensor] = []
        self._stepped = False  # the optimizer stepped in this step: measure the parameters at its end
        self._handles: list[Any] = []
        self._param_list: list[torch.Tensor] = []
        self._buffer_list: list[torch.Tensor] = []
        if optimizer is not None:
            self._handles = [optimizer.register_step_pre_hook(self._before_optimizer),
                             optimizer.register_step_post_hook(self._after_optimizer)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def begin(self) -> None:
        self._losses, self._grad_norms, self._stepped = [], [], False
        self._param_list = model_parameters(self.model, self.optimizer)
        # The floating buffers count with the parameters at the step's end: a NaN or Inf the step
        # wrote into BatchNorm's running statistics poisons every later evaluation.
        self._buffer_list = [b for b in self.model.buffers() if b.is_floating_point()] \
            if self.model is not None else []
        self.active = True

    def abort(self) -> None:
        self.active = False

    def add_loss(self, loss: torch.Tensor) -> None:
        """One more loss of this step (a micro-batch's)."""
        if self.active:
            with _quiet():
                self._losses.append(loss.detach().reshape(()).float())

    # ---- optimizer hooks ---------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return self._param_list

    def _before_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active:
            self._grad_norms.append(self._grad_norm())

    def _after_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active:
            self._stepped = True

    def _grad_norm(self) -> torch.Tensor:
        with _quiet():
            return _total_norm([p.grad.detach() for p in self._params() if p.grad is not None])

    # ---- the step's end ----------------------------------------------------------------------
    def end(self, result: Any, trigger: DeviceTrigger, distributed: bool) -> Flag:
        """The step's flag. Without an optimizer step in it (a micro-batch of an accumulating
        loop) the gradients are measured now."""
        self.active = False
        loss = loss_of(result)
        with _quiet():
            if loss is not None:
                self._losses.append(loss.detach().reshape(()).float())
            if not self._grad_norms and any(p.grad is not None for p in self._params()):
                self._grad_norms.append(self._grad_norm())
            param_norms = [_total_norm([p.detach() for p in [*self._params(), *self._buffer_list]])] \
                if self._stepped else []
            device = _device_of(self._losses, self._grad_norms, param_norms, self._params())
            slots = [_combine(self._losses, device, total=True), _combine(self._grad_norms, device),
                     _combine(param_norms, device)]
            has = (bool(self._losses), bool(self._grad_norms), bool(param_norms))
            values = torch.stack(slots)
            bad = trigger(values, result).to(device=device, dtype=torch.float32).reshape(1)
            vector = torch.cat([values, bad])
            work, global_bad = None, None
            if distributed:
                global_bad = bad.clone()
                work = dist.all_reduce(global_bad, op=dist.ReduceOp.SUM, async_op=True)
        return Flag(vector, has, work, global_bad)


def _total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return torch.nn.utils.get_total_norm(tensors, 2.0, error_if_nonfinite=False).float()


def _combine(values: list[torch.Tensor], device: torch.device, total: bool = False) -> torch.Tensor:
    """One slot: the sum of a step's micro-batch losses, the largest of its norms (a NaN stays
    NaN either way); 0 when nothing was measured."""
    if not values:
        return torch.zeros((), dtype=torch.float32, device=device)
    vs = [v.to(device, non_blocking=True) for v in values]
    if len(vs) == 1:
        return vs[0]
    stacked = torch.stack(vs)
    return stacked.sum() if total else stacked.max()  # max propagates NaN


def _device_of(*groups: Sequence[torch.Tensor]) -> torch.device:
    for g in groups:
        for t in g:
            return t.device
    return torch.device("cpu")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Sentinel arithmetic: no autograd, and invisible to a recording trace (the replay)."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        yield
