"""What a training step changes, copied before the step so that it can be put back exactly.

A ``StateSnapshot`` is one reusable set of buffers: the parameters, the buffers (BatchNorm
statistics), the optimizer's state (``exp_avg``, ``step``, ...) and hyperparameters, the
gradients when they already hold something (accumulation), and the random number generators
(CPU, every initialised CUDA device, Python's ``random``). ``capture`` copies into the buffers,
allocated once and reused while the shapes stay the same; ``restore`` copies back.

Where the copies live (``placement``):

- ``"device"``: beside the tensors (device-to-device copies on the current stream, so they are
  ordered before the step's own writes and cost no synchronisation);
- ``"host"``: in pinned host memory, copied asynchronously on the current stream (for when the
  device has no room for another copy of the model and its optimizer state).

Tensors that live on the CPU are copied on the CPU either way.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Placement = Literal["device", "host"]


def real_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` under wrappers that keep it as ``.optimizer`` (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``)."""
    opt = optimizer
    for _ in range(8):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            opt = inner
        else:
            break
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"not a torch.optim.Optimizer: {type(optimizer).__name__}")
    return opt


def model_parameters(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The model's parameters, then any parameter only the optimizer knows; each once."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    groups: Iterable[Any] = optimizer.param_groups if optimizer is not None else ()
    sources: list[Iterable[torch.Tensor]] = [model.parameters()] if model is not None else []
    sources += [g["params"] for g in groups]
    for src in sources:
        for p in src:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


@dataclass
class _Rng:
    cpu: torch.Tensor
    cuda: list[torch.Tensor]
    python: Any

    @classmethod
    def capture(cls) -> _Rng:
        # Only devices already in use: querying a device would initialise CUDA in a CPU-only run.
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        return cls(torch.get_rng_state(), cuda, random.getstate())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)


@dataclass
class _OptimizerEntry:
    """One parameter's optimizer state: tensor keys index ``StateSnapshot.sources``; other values
    are kept as they are (ints, floats, a deep copy of anything mutable)."""

    param: torch.Tensor
    tensors: dict[Any, int]
    values: dict[Any, Any]


@dataclass
class StateSnapshot:
    """One set of buffers holding a copy of the state a step changes (see the module docstring)."""

    placement: Placement = "device"
    sources: list[torch.Tensor] = field(default_factory=list)  # what was copied, in order
    buffers: list[torch.Tensor] = field(default_factory=list)  # the copies
    params: list[torch.Tensor] = field(default_factory=list)
    module_buffers: list[torch.Tensor] = field(default_factory=list)
    grads: list[int | None] | None = None  # index into sources per parameter; None: no gradients at all
    optimizer_state: list[_OptimizerEntry] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    rng: _Rng | None = None
    step: int = -1
    allocations: int = 0  # how often buffers were (re)allocated

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    # ---- capture -----------------------------------------------------------------------------
    def capture(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, step: int, *,
                grads: bool | None = None) -> None:
        """Copy the state now (asynchronously on devices). ``grads``: also the gradients (None:
        when any parameter holds one, as when gradients accumulate over calls)."""
        params = model_parameters(model, optimizer)
        module_buffers = [b for b in model.buffers()] if model is not None else []
        sources: list[torch.Tensor] = [p.detach() for p in params] + [b.detach() for b in module_buffers]
        grad_index: list[int | None] | None = None
        if grads is None:
            grads = any(p.grad is not None for p in params)
        if grads:
            grad_index = []
            for p in params:
                if p.grad is None:
                    grad_index.append(None)
                else:
                    grad_index.append(len(sources))
                    sources.append(p.grad.detach())
        entries: list[_OptimizerEntry] = []
        groups: list[dict[str, Any]] = []
        if optimizer is not None:
            for p, state in optimizer.state.items():
                tensors: dict[Any, int] = {}
                values: dict[Any, Any] = {}
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        tensors[k] = len(sources)
                        sources.append(v.detach())
                    else:
                        values[k] = v if isinstance(v, int | float | str | bool | None) else copy.deepcopy(v)
                entries.append(_OptimizerEntry(p, tensors, values))
            for g in optimizer.param_groups:
                saved: dict[str, Any] = {}
                for k, v in g.items():
                    if k == "params":
                        continue
                    if isinstance(v, torch.Tensor):  # a tensor learning rate: its value, now
                        saved[k] = v.detach().clone()
                    else:
                        saved[k] = v if isinstance(v, int | float | str | bool | None) else copy.deepcopy(v)
                groups.append(saved)
        self._ensure_buffers(sources)
        with torch.no_grad():
            _copy_all(self.buffers, sources)
        self.sources, self.params, self.module_buffers = sources, params, module_buffers
        self.grads, self.optimizer_state, self.groups = grad_index, entries, groups
        self.rng = _Rng.capture()
        self.step = step

    def _ensure_buffers(self, sources: Sequence[torch.Tensor]) -> None:
        bufs = self.buffers
        if len(bufs) == len(sources) and all(
                b.shape == s.shape and b.dtype == s.dtype and _home(s, self.placement) == b.device
                for b, s in zip(bufs, sources)):
            return
        self.buffers = [_buffer_for(s, self.placement) for s in sources]
        self.allocations += 1

    # ---- restore -----------------------------------------------------------------------------
    def restore(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
        """Put the captured state back: values, gradients, optimizer state (entries made since
        are removed), hyperparameters and random number generators."""
        if self.step < 0:
            raise RuntimeError("nothing captured")
        n_params, n_bufs = len(self.params), len(self.module_buffers)
        with torch.no_grad():
            _copy_all(self.sources[: n_params + n_bufs], self.buffers[: n_params + n_bufs])
            self._restore_grads()
            if optimizer is not None:
                self._restore_optimizer(optimizer)
        assert self.rng is not None
        self.rng.restore()

    def _restore_grads(self) -> None:
        for i, p in enumerate(self.params):
            at = self.grads[i] if self.grads is not None else None
            if at is None:
                p.grad = None
            elif p.grad is not None and p.grad.shape == self.buffers[at].shape:
                p.grad.copy_(self.buffers[at])
            else:
                p.grad = self.buffers[at].to(p.device, copy=True)

    def _restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        kept = {id(e.param) for e in self.optimizer_state}
        for p in [p for p in optimizer.state if id(p) not in kept]:  # state the step created
            del optimizer.state[p]
        for e in self.optimizer_state:
            state = optimizer.state[e.param]
            for k in [k for k in state if k not in e.tensors and k not in e.values]:
                del state[k]
            for k, at in e.tensors.items():
                saved, current = self.buffers[at], state.get(k)
                if isinstance(current, torch.Tensor) and current.shape == saved.shape and current.dtype == saved.dtype:
                    current.copy_(saved)
                else:
                    state[k] = saved.to(self.sources[at].device, copy=True)
            for k, v in e.values.items():
                state[k] = v if isinstance(v, int | float | str | bool | None) else copy.deepcopy(v)
        for g, group_saved in zip(optimizer.param_groups, self.groups):
            for k, v in group_saved.items():
                if isinstance(v, torch.Tensor) and isinstance(g.get(k), torch.Tensor):
                    g[k].copy_(v)
                else:
                    g[k] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _home(src: torch.Tensor, placement: Placement) -> torch.device:
    return torch.device("cpu") if placement == "host" or src.device.type == "cpu" else src.device


def _buffer_for(src: torch.Tensor, placement: Placement) -> torch.Tensor:
    if src.device.type == "cpu":
        return torch.empty_like(src, memory_format=torch.preserve_format)
    if placement == "host":
        # Pinned, so that the copy runs asynchronously on the stream, ordered before the step.
        return torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    return torch.empty_like(src, memory_format=torch.preserve_format)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all, one fused launch per (device pair, dtype) where possible;
    copies to or from pinned host memory do not wait for the device."""
    groups: dict[tuple[torch.device, torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src):
        g = groups.setdefault((d.device, s.device, d.dtype), ([], []))
        g[0].append(d)
        g[1].append(s)
    for (dd, sd, _), (ds, ss) in groups.items():
        if dd == sd:
            torch._foreach_copy_(ds, ss)
        else:
            for d, s in zip(ds, ss):
                d.copy_(s, non_blocking=True)


def state_bytes(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> int:
    """What one snapshot would hold without gradients (to choose where snapshots go)."""
    params = model_parameters(model, optimizer)
    total = sum(p.numel() * p.element_size() for p in params)
    if model is not None:
        total += sum(b.numel() * b.element_size() for b in model.buffers())
    if optimizer is not None:
        for per_param in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in per_param.values() if isinstance(v, torch.Tensor))
        if not optimizer.state:  # before the first step: Adam-like optimizers add about 2x the parameters
            total += 2 * sum(p.numel() * p.element_size() for p in params)
    return total
