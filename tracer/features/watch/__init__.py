"""Always-on watch: catch the first NaN or loss spike of a long run, then replay that exact step
under a full trace.

    @tracer.watch(model, opt, out="incident.gtrace")
    def train_step(batch):
        loss = model(**batch).loss
        loss.backward(); opt.step(); opt.zero_grad()
        return loss

Each call snapshots what the step changes, runs it untraced with an on-device sentinel, and reads
the sentinel's flag a step later (no synchronisation per step). When it trips, the step is
rewound and replayed with the same arguments and random state under
``tracer.trace(check_numerics=True)``; the incident trace is saved as ``incident.step37.gtrace``
and the policy decides what follows. See ``tracer.features.watch.core`` for the mechanics,
``sentinel`` for what is measured, ``snapshot`` for what is copied and ``triggers`` for ``on=``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tracer.features.watch.core import (
    Incident,
    NonFiniteStepError,
    Policy,
    ReportOption,
    SnapshotPlacement,
    Watch,
    WatchTripped,
    check_options,
)
from tracer.features.watch.triggers import Spike, Trigger
from tracer.options import ReplayKwargs

if TYPE_CHECKING:  # annotations only (typing.Unpack is Python 3.11's; typing_extensions comes with torch)
    from typing_extensions import Unpack


class WatchKwargs(ReplayKwargs, total=False):
    """``tracer.watch``'s keywords after the model and the optimizer, with the replay's trace
    options: what the framework ``WatchCallback``s take."""

    on: str | Trigger | Callable[[Any], Any]
    out: str | os.PathLike[str] | None
    policy: Policy
    snapshots: SnapshotPlacement
    lag: int | None
    grads: bool | None
    report: ReportOption
    status_every: int | None
    log: str | os.PathLike[str] | None


def watch(model: Any, optimizer: Any, *, on: str | Trigger | Callable[[Any], Any] = "nonfinite",
          out: str | os.PathLike[str] | None = "incident.gtrace", policy: Policy = "raise",
          snapshots: SnapshotPlacement = "auto", lag: int | None = None, grads: bool | None = None,
          report: ReportOption = None, status_every: int | None = None,
          log: str | os.PathLike[str] | None = None, **trace_options: Unpack[ReplayKwargs]) -> Watch:
    """Watch a training step cheaply; on a trip, replay it under a full trace.

    Use the result as a decorator (``@tracer.watch(model, opt)``), as a wrapper
    (``step = tracer.watch(model, opt)(step)``) or call ``.run(fn, *args)``.

    ``on``: ``"nonfinite"`` (a NaN/Inf loss, gradient norm before the optimizer step or parameter
    norm after it), ``"spike"`` or ``tracer.Spike(factor=10, window=100, warmup=10)`` (the loss
    or gradient norm above ``factor`` x its running median, or non-finite), or a callable on the
    step's return value that returns a bool or a bool tensor.
    ``out``: the incident trace, tagged with the step (``incident.step37.gtrace``; per rank
    ``incident.step37.rank0.gtrace``); ``None`` keeps it in memory (``incident.trace``).
    ``policy``: ``"raise"`` (``tracer.NonFiniteError`` / ``WatchTripped``; the state is put back
    as it was before the bad step), ``"skip"`` (put it back and go on), ``"continue"`` (keep the
    state the run reached).
    ``snapshots``: ``"device"`` (copies beside the tensors), ``"host"`` (pinned host memory,
    asynchronous) or ``"auto"`` (device when all snapshots fit in half the free device memory).
    ``lag``: steps between a step and the reading of its flag (default 1 on GPUs, 0 on the CPU);
    ``lag + 1`` snapshots are kept. ``grads``: snapshot the gradients too (default: when any
    parameter holds one as the step begins). ``report``: the HTML report written beside each
    incident trace (``incident.step37.html``): by default gradtrace's own (found as the
    ``gradtrace.report_writers`` plug-in); a callable ``(trace, path)`` writes another; ``False``
    writes none.
    ``status_every``: log the status line every N steps (``gradtrace.watch`` logger, INFO).
    ``log``: also write the step log of every optimizer step to this file (``run.gtsteps``, for
    ``gradtrace bisect``; ``tracer.step_log`` writes one without a watch).
    ``trace_options``: those of ``tracer.trace`` for the replay (``hash``, ``memory``, ...).
    """
    return Watch(model, optimizer, on=on, out=out, policy=policy, snapshots=snapshots, lag=lag, grads=grads,
                 report=report, status_every=status_every, log=log, **trace_options)


__all__ = ["Incident", "NonFiniteStepError", "Spike", "Trigger", "Watch", "WatchKwargs", "WatchTripped", "check_options",
           "watch"]
