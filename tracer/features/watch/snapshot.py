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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tracer.features.optimizers import real_optimizer

__all__ = ["Layout", "Placement", "StateSnapshot", "model_parameters", "real_optimizer", "state_bytes"]

Placement = Literal["device", "host"]


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
    """One parameter's optimizer state: tensor keys index ``Layout.sources``; the other keys'
    values are kept per snapshot."""

    param: torch.Tensor
    tensors: dict[Any, int]
    value_keys: list[Any]


def _optimizer_key(optimizer: torch.optim.Optimizer | None) -> tuple[Any, ...]:
    if optimizer is None:
        return ()
    return (len(optimizer.state), *((id(g["params"]), len(g["params"])) for g in optimizer.param_groups))


class Layout:
    """What a snapshot copies, in order: the parameters, the module buffers, the gradients (when
    asked), the optimizer's state tensors. Built once and reused while the optimizer's parameter
    lists and state entries stay the same objects (checked every step by identity, which costs
    far less than walking the modules); ``Watch.refresh()`` rebuilds it after a module swapped a
    buffer for a new tensor."""

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 grads: bool) -> None:
        self.key = _optimizer_key(optimizer)
        self.grads = grads
        self.params = model_parameters(model, optimizer)
        self.module_buffers = list(model.buffers()) if model is not None else []
        sources: list[torch.Tensor] = [*self.params, *self.module_buffers]
        self.grad_index: list[int | None] | None = None
        if grads:
            self.grad_index = []
            for p in self.params:
                if p.grad is None:
                    self.grad_index.append(None)
                else:
                    self.grad_index.append(len(sources))
                    sources.append(p.grad)
        self.entries: list[_OptimizerEntry] = []
        self.state_refs: list[tuple[dict[Any, Any], Any, torch.Tensor]] = []
        if optimizer is not None:
            for p, state in optimizer.state.items():
                tensors: dict[Any, int] = {}
                value_keys: list[Any] = []
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        tensors[k] = len(sources)
                        sources.append(v)
                        self.state_refs.append((state, k, v))
                    else:
                        value_keys.append(k)
                self.entries.append(_OptimizerEntry(p, tensors, value_keys))
        self.sources = sources
        self.grad_refs = [(p, p.grad) for p in self.params] if grads else []

    def valid(self, optimizer: torch.optim.Optimizer | None, grads: bool) -> bool:
        """Whether this layout still describes the state (the same tensors in the same places)."""
        return (grads == self.grads and _optimizer_key(optimizer) == self.key
                and all(state.get(k) is t for state, k, t in self.state_refs)
                and all(p.grad is g for p, g in self.grad_refs))


@dataclass
class StateSnapshot:
    """One set of buffers holding a copy of the state a step changes (see the module docstring)."""

    placement: Placement = "device"
    layout: Layout | None = None  # what was copied
    buffers: list[torch.Tensor] = field(default_factory=list)  # the copies, in the layout's order
    values: list[list[Any]] = field(default_factory=list)  # per optimizer entry: its non-tensor values
    groups: list[dict[str, Any]] = field(default_factory=list)
    rng: _Rng | None = None
    step: int = -1
    allocations: int = 0  # how often buffers were (re)allocated
    _copy_plan: list[tuple[list[torch.Tensor], list[torch.Tensor], bool]] = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    # ---- capture -----------------------------------------------------------------------------
    def capture(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, step: int, *,
                grads: bool | None = None, layout: Layout | None = None) -> Layout:
        """Copy the state now (asynchronously on devices). ``grads``: also the gradients (None:
        when any parameter holds one, as when gradients accumulate over calls). ``layout``: the
        one used last time, reused when still valid. Returns the layout used."""
        if grads is None:
            params = layout.params if layout is not None else model_parameters(model, optimizer)
            grads = any(p.grad is not None for p in params)
        if layout is None or not layout.valid(optimizer, grads):
            layout = Layout(model, optimizer, grads)
        if layout is not self.layout:
            self._ensure_buffers(layout)
        with torch.no_grad():
            for dst, src, same_device in self._copy_plan:
                if same_device:
                    torch._foreach_copy_(dst, src)
                else:  # to pinned host memory: asynchronous on the current stream
                    for d, t in zip(dst, src):
                        d.copy_(t, non_blocking=True)
        self.values = []
        if optimizer is not None:
            for e in layout.entries:
                state = optimizer.state[e.param]
                self.values.append([_kept(state[k]) for k in e.value_keys])
            self.groups = [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else _kept(v))
                            for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.rng = _Rng.capture()
        self.step = step
        return layout

    def _ensure_buffers(self, layout: Layout) -> None:
        sources, bufs = layout.sources, self.buffers
        if not (len(bufs) == len(sources) and all(
                b.shape == s.shape and b.dtype == s.dtype and _home(s, self.placement) == b.device
                for b, s in zip(bufs, sources))):
            self.buffers = [_buffer_for(s, self.placement) for s in sources]
            self.allocations += 1
        self.layout = layout
        plan: dict[tuple[torch.device, torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for b, s in zip(self.buffers, sources):
            dst, src = plan.setdefault((b.device, s.device, b.dtype), ([], []))
            dst.append(b)
            src.append(s.detach())
        self._copy_plan = [(dst, src, dd == sd) for (dd, sd, _), (dst, src) in plan.items()]

    # ---- restore -----------------------------------------------------------------------------
    def restore(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
        """Put the captured state back: values, gradients, optimizer state (entries made since
        are removed), hyperparameters and random number generators."""
        layout = self.layout
        if self.step < 0 or layout is None:
            raise RuntimeError("nothing captured")
        n = len(layout.params) + len(layout.module_buffers)
        with torch.no_grad():
            _copy_all(layout.sources[:n], self.buffers[:n])
            self._restore_grads(layout)
            if optimizer is not None:
                self._restore_optimizer(layout, optimizer)
        assert self.rng is not None
        self.rng.restore()

    def _restore_grads(self, layout: Layout) -> None:
        for i, p in enumerate(layout.params):
            at = layout.grad_index[i] if layout.grad_index is not None else None
            if at is None:
                p.grad = None
            elif p.grad is not None and p.grad.shape == self.buffers[at].shape:
                p.grad.copy_(self.buffers[at])
            else:
                p.grad = self.buffers[at].to(p.device, copy=True)

    def _restore_optimizer(self, layout: Layout, optimizer: torch.optim.Optimizer) -> None:
        kept = {id(e.param) for e in layout.entries}
        for p in [p for p in optimizer.state if id(p) not in kept]:  # state the step created
            del optimizer.state[p]
        for e, values in zip(layout.entries, self.values):
            state = optimizer.state[e.param]
            for k in [k for k in state if k not in e.tensors and k not in e.value_keys]:
                del state[k]
            for k, at in e.tensors.items():
                saved, current = self.buffers[at], state.get(k)
                if isinstance(current, torch.Tensor) and current.shape == saved.shape and current.dtype == saved.dtype:
                    current.copy_(saved)
                else:
                    state[k] = saved.to(layout.sources[at].device, copy=True)
            for k, v in zip(e.value_keys, values):
                state[k] = _kept(v)
        for g, group_saved in zip(optimizer.param_groups, self.groups):
            for k, v in group_saved.items():
                if isinstance(v, torch.Tensor) and isinstance(g.get(k), torch.Tensor):
                    g[k].copy_(v)
                else:
                    g[k] = v.clone() if isinstance(v, torch.Tensor) else _kept(v)


def _kept(v: Any) -> Any:
    """A value as it is now: immutable ones as they are, anything else deep-copied."""
    return v if isinstance(v, int | float | str | bool | None) else copy.deepcopy(v)


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
