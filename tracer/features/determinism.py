"""``tracer.check_determinism(step_fn, *args)``: run one training step several times from the same
state and name the first op that is not deterministic.

The state is the watch's snapshot (``tracer.features.watch.snapshot``: parameters, buffers,
gradients, the optimizer's state and hyperparameters, the random number generators). Each repeat
restores it and runs ``step_fn(*args, **kwargs)`` under ``trace(hash="fast")``; afterwards the
state is put back as it was before the check, so the training can go on as if nothing ran. The
traces are compared by ``tracer.analysis.determinism.compare_runs``: the first op whose inputs
are bit-equal in every repeat and whose outputs are not, with its line and, where the op is a
usual suspect, the cause and what to set.

The model and optimizer are given (``model=``, ``optimizer=``) or found among what ``step_fn``
refers to (its closure and the globals it names). Learning-rate schedulers are state a step
changes too (``last_epoch``, the lr they wrote into the param groups): those ``step_fn`` refers
to and those built on the optimizer are found either way, and their ``state_dict()`` is put back
with the rest before each repeat and after the check. A ``torch.Generator`` of the user's own is
not found (a random op reading one is named with that cause instead); ``generators=`` puts the
given ones back too.
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.analysis.determinism import DeterminismReport, compare_runs
from tracer.features.optimizers import real_optimizer
from tracer.features.plugins import session_plugins
from tracer.features.steplog import paused
from tracer.features.watch.snapshot import StateSnapshot
from tracer.model import Trace
from tracer.options import TraceError, TraceOptions
from tracer.record.recorder import active_recorder
from tracer.record.session import TraceSession


def check_determinism(step_fn: Callable[..., Any], *args: Any, repeats: int = 2, model: torch.nn.Module | None = None,
                      optimizer: Any = None, generators: Sequence[torch.Generator] = (),
                      **kwargs: Any) -> DeterminismReport:
    """Run ``step_fn(*args, **kwargs)`` ``repeats`` times from the same state, each under
    ``tracer.trace(hash="fast")``, put the state back, and report the first op whose inputs are
    bit-equal and whose outputs differ (``report.first``: its name, API, line, the usual cause and
    what to set), or that the step is deterministic (``bool(report)``). ``report.describe()``
    says it in words; ``report.traces`` holds the traces of the repeats. ``generators``: private
    ``torch.Generator`` objects the step draws from, put back as well (torch's default ones
    always are); the LR schedulers of the step are found and put back by themselves."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise TraceError(f"repeats must be a number of runs >= 2, got {repeats!r}")
    if not callable(step_fn):
        raise TraceError(f"check_determinism() runs a step function, got {step_fn!r}")
    active = active_recorder()
    if active is not None and not active.closed:
        raise TraceError("check_determinism() traces the step itself: call it outside tracer.trace()")
    if isinstance(generators, torch.Generator):
        generators = [generators]
    bad = [g for g in generators if not isinstance(g, torch.Generator)]
    if bad:
        raise TraceError(f"generators must be torch.Generator objects, got {type(bad[0]).__name__}")
    model, opt = _state_of(step_fn, model, optimizer)
    snapshot = StateSnapshot("device")
    snapshot.capture(model, opt, 0)
    # The StateSnapshot holds what tracer.watch needs; a scheduler's counters and a private
    # generator live outside it, and a repeat that moved them would start the next one elsewhere.
    outside = _OutsideState.capture(_schedulers(step_fn, opt), list(generators))
    options = TraceOptions.from_kwargs(hash="fast")
    traces: list[Trace] = []
    try:
        with paused():  # the repeats are not steps of the run
            for _ in range(repeats):
                snapshot.restore(model, opt)
                outside.restore()
                session = TraceSession(options, plugins=session_plugins(options))
                with session:
                    step_fn(*args, **kwargs)
                assert session.trace is not None
                traces.append(session.trace)
    finally:
        snapshot.restore(model, opt)
        outside.restore()
    return compare_runs(traces)


_MISSING = object()  # (an attribute the optimizer did not have)


@dataclass
class _OutsideState:
    """What a step changes that ``StateSnapshot`` does not hold: each LR scheduler's
    ``state_dict()`` with the ``lr``/``initial_lr`` it keeps in its optimizer's param groups (that
    optimizer need not be the one snapshotted), the ``_opt_called`` flag a scheduler's wrapper of
    ``optimizer.step`` sets, and the states of the given generators."""

    schedulers: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    groups: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    flags: list[tuple[torch.optim.Optimizer, Any]] = field(default_factory=list)
    generators: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def capture(cls, schedulers: list[Any], generators: list[torch.Generator]) -> _OutsideState:
        state = cls()
        optimizers: list[torch.optim.Optimizer] = []
        for s in schedulers:
            state.schedulers.append((s, _copied(s.state_dict())))
            if all(s.optimizer is not o for o in optimizers):
                optimizers.append(s.optimizer)
        for o in optimizers:
            state.flags.append((o, vars(o).get("_opt_called", _MISSING)))
            for g in o.param_groups:
                state.groups.append((g, {k: _copied(g[k]) for k in ("lr", "initial_lr") if k in g}))
        state.generators = [(g, g.get_state()) for g in generators]
        return state

    def restore(self) -> None:
        for s, saved in self.schedulers:
            # A copy each time: load_state_dict may keep (or pop from) what it is given.
            s.load_state_dict(_copied(saved))
        for group, values in self.groups:
            for k, v in values.items():
                group[k] = _copied(v)
        for o, flag in self.flags:
            if flag is _MISSING:
                vars(o).pop("_opt_called", None)
            else:
                o._opt_called = flag  # type: ignore[attr-defined]
        for g, saved_state in self.generators:
            g.set_state(saved_state)


def _copied(v: Any) -> Any:
    """A copy that later changes to ``v`` leave alone; ``v`` itself where it cannot be copied
    (a callable object in a scheduler's state: it is not state the step changes)."""
    try:
        return copy.deepcopy(v)
    except Exception:  # (deepcopy raises whatever an object's __reduce__ raises)
        return v


def _state_of(step_fn: Callable[..., Any], model: torch.nn.Module | None,
              optimizer: Any) -> tuple[torch.nn.Module | None, torch.optim.Optimizer | None]:
    """The model and optimizer whose state the step changes: as given, else found."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TraceError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    opt = None
    if optimizer is not None:
        try:
            opt = real_optimizer(optimizer)
        except TypeError as exc:
            raise TraceError(f"optimizer: {exc}") from None
    if model is not None or opt is not None:
        return model, opt
    modules, optimizers, _ = _referenced(step_fn)
    if not modules and not optimizers:
        raise TraceError("check_determinism() found no model or optimizer that the step function refers to: pass "
                         "model= and optimizer=")
    found_opt = optimizers[0] if len(optimizers) == 1 else None
    if len(optimizers) > 1:
        raise TraceError(f"check_determinism() found {len(optimizers)} optimizers the step refers to: pass "
                         "optimizer= (and model=)")
    found_model = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules) if modules else None
    return found_model, found_opt


def _referenced(fn: Callable[..., Any]) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer], list[Any]]:
    """The modules, optimizers and LR schedulers a function's closure and the globals it names
    hold (a bound method: its instance's attributes too; a ``functools.partial``: its arguments
    too)."""
    values: list[Any] = []
    while isinstance(fn, functools.partial):
        values += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        values += [owner, *vars(owner).values()] if hasattr(owner, "__dict__") else [owner]
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    if inspect.isfunction(target):
        found = inspect.getclosurevars(target)
        values += [*found.nonlocals.values(), *found.globals.values()]
    modules: list[torch.nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    schedulers: list[Any] = []
    for v in values:
        if isinstance(v, torch.nn.Module):
            if all(v is not m for m in modules):
                modules.append(v)
            continue
        sched = _scheduler_in(v)
        if sched is not None and all(sched is not s for s in schedulers):
            schedulers.append(sched)
        real = _optimizer_in(v)  # an optimizer, a wrapper of one, a scheduler: the optimizer itself
        if real is not None and all(real is not o for o in optimizers):
            optimizers.append(real)
    # A module that is part of another one found is snapshotted with it.
    inner = {id(m) for outer in modules for m in outer.modules() if m is not outer}
    return [m for m in modules if id(m) not in inner], optimizers, schedulers


def _schedulers(step_fn: Callable[..., Any], optimizer: torch.optim.Optimizer | None) -> list[Any]:
    """The LR schedulers whose state the step may change: those ``step_fn`` refers to (found
    even when the model and optimizer were given), then those built on ``optimizer`` that it
    reaches some other way (through an object of its own)."""
    found = _referenced(step_fn)[2]
    for s in _attached(optimizer):
        if all(s is not f for f in found):
            found.append(s)
    return found


def _attached(optimizer: torch.optim.Optimizer | None) -> list[Any]:
    """The schedulers built on ``optimizer``. It keeps no reference to them (their wrapper of
    ``optimizer.step`` holds only a weak reference back), so they are found as what refers to
    it: a scheduler object, or, where Python keeps instance attributes in a dict, that dict's
    owner."""
    if optimizer is None:
        return []
    found: list[Any] = []
    for r in gc.get_referrers(optimizer):
        owners = [r]
        if isinstance(r, dict) and r.get("optimizer") is optimizer:  # (cheap filter: a scheduler's __dict__)
            owners = [o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r]
        for o in owners:
            if _is_scheduler(o) and o.optimizer is optimizer and all(o is not f for f in found):
                found.append(o)
    return found


def _is_scheduler(v: Any) -> bool:
    return isinstance(v, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau)


def _scheduler_in(v: Any) -> Any:
    """The LR scheduler ``v`` is, or wraps as ``.scheduler`` (accelerate's
    ``AcceleratedScheduler``); None when it is none."""
    for _ in range(8):
        if _is_scheduler(v):
            return v
        v = getattr(v, "scheduler", None)
        if v is None:
            return None
    return None


def _optimizer_in(v: Any) -> torch.optim.Optimizer | None:
    try:
        return real_optimizer(v)
    except TypeError:
        return None


__all__ = ["check_determinism"]
