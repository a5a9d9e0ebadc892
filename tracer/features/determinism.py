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
refers to (its closure and the globals it names).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
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
                      optimizer: Any = None, **kwargs: Any) -> DeterminismReport:
    """Run ``step_fn(*args, **kwargs)`` ``repeats`` times from the same state, each under
    ``tracer.trace(hash="fast")``, put the state back, and report the first op whose inputs are
    bit-equal and whose outputs differ (``report.first``: its name, API, line, the usual cause and
    what to set), or that the step is deterministic (``bool(report)``). ``report.describe()``
    says it in words; ``report.traces`` holds the traces of the repeats."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise TraceError(f"repeats must be a number of runs >= 2, got {repeats!r}")
    if not callable(step_fn):
        raise TraceError(f"check_determinism() runs a step function, got {step_fn!r}")
    active = active_recorder()
    if active is not None and not active.closed:
        raise TraceError("check_determinism() traces the step itself: call it outside tracer.trace()")
    model, opt = _state_of(step_fn, model, optimizer)
    snapshot = StateSnapshot("device")
    snapshot.capture(model, opt, 0)
    options = TraceOptions.from_kwargs(hash="fast")
    traces: list[Trace] = []
    try:
        with paused():  # the repeats are not steps of the run
            for _ in range(repeats):
                snapshot.restore(model, opt)
                session = TraceSession(options, plugins=session_plugins(options))
                with session:
                    step_fn(*args, **kwargs)
                assert session.trace is not None
                traces.append(session.trace)
    finally:
        snapshot.restore(model, opt)
    return compare_runs(traces)


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
    modules, optimizers = _referenced(step_fn)
    if not modules and not optimizers:
        raise TraceError("check_determinism() found no model or optimizer that the step function refers to: pass "
                         "model= and optimizer=")
    found_opt = optimizers[0] if len(optimizers) == 1 else None
    if len(optimizers) > 1:
        raise TraceError(f"check_determinism() found {len(optimizers)} optimizers the step refers to: pass "
                         "optimizer= (and model=)")
    found_model = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules) if modules else None
    return found_model, found_opt


def _referenced(fn: Callable[..., Any]) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """The modules and optimizers a function's closure and the globals it names hold (a bound
    method: its instance's attributes too; a ``functools.partial``: its arguments too)."""
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
    for v in values:
        if isinstance(v, torch.nn.Module):
            if all(v is not m for m in modules):
                modules.append(v)
            continue
        real = _optimizer_in(v)  # an optimizer, a wrapper of one, a scheduler: the optimizer itself
        if real is not None and all(real is not o for o in optimizers):
            optimizers.append(real)
    # A module that is part of another one found is snapshotted with it.
    inner = {id(m) for outer in modules for m in outer.modules() if m is not outer}
    return [m for m in modules if id(m) not in inner], optimizers


def _optimizer_in(v: Any) -> torch.optim.Optimizer | None:
    try:
        return real_optimizer(v)
    except TypeError:
        return None


__all__ = ["check_determinism"]
