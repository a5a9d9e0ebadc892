"""The public way in: ``trace()`` and its light variants, ``record_memory()``, ``step()``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from tracer.analysis.memory import MemoryRecord
from tracer.features.bounds import Bounds
from tracer.loops.steps import StepTrace, step
from tracer.model import Trace
from tracer.options import TraceError
from tracer.record.listeners import Listener
from tracer.record.session import TraceSession

__all__ = ["check_numerics", "explain_errors", "record_memory", "step", "trace"]


def trace(*, hash: str = "md5", stacks: bool = True, stats: bool | None = None,
          out: str | os.PathLike[str] | None = None, flush_every: int = 1024,
          listeners: list[Listener] | None = None, memory: bool = False,
          max_calls: int | None = None, check_numerics: bool = False, raise_on_nonfinite: bool = False,
          optimizer_ops: bool = False, steps: str | None = None, every: int | None = None,
          **step_options: Any) -> Any:
    """Record forward API calls, grad nodes, call stacks and tensor checksums of a block.

    ``hash``: ``"md5"`` (exact MD5 of every tensor, the default), ``"fast"`` (a 64-bit
    order-sensitive fingerprint computed on the tensor's device, ``tracer.record.checksums.fingerprint``) or
    ``"none"``.
    ``stacks``: capture the user's call stack of every call (cheap, on by default).
    ``stats``: min/max/mean/absmax/NaN/Inf of every tensor (default: on when hashing).
    ``out``: stream the trace to this file while recording (a crash keeps what was flushed).
    ``listeners``: extra ``tracer.record.listeners.Listener`` objects to attach to the recorder.
    ``memory``: also record every allocation and free, attributed to calls and grad nodes.
    ``max_calls``: stop recording cleanly after this many calls (the trace says so).
    ``max_bytes``: likewise once the trace's records reach about this many bytes.
    ``check_numerics``: stats (NaN/Inf counts) for every tensor even without hashing; at the end
    the first non-finite tensor of forward and of backward is reported (``t.anomalies``).
    ``raise_on_nonfinite``: stop at the first NaN/Inf with ``NonFiniteError`` (syncs once per
    call to look at each output: costly on GPUs, meant for hunting, not for routine runs).
    ``optimizer_ops``: record every op inside ``optimizer.step()``. By default a step is one call
    (named after the optimizer class, ``AdamW0``) from the parameters, gradients and state to
    the new versions it leaves behind; its intermediate tensors are not recorded.
    ``steps`` / ``every``: trace only chosen optimizer steps of a longer loop (``tracer.loops.steps``).

    Only the thread that enters the block is traced. Nothing stays installed after the block,
    also when it raises; then the trace is marked ``failed`` and the exception propagates.
    """
    if steps is not None or every is not None:
        return StepTrace(steps=steps, every=every, hash=hash, stacks=stacks, stats=stats, out=out,
                         flush_every=flush_every, listeners=listeners, memory=memory, max_calls=max_calls,
                         check_numerics=check_numerics, raise_on_nonfinite=raise_on_nonfinite,
                         optimizer_ops=optimizer_ops, **step_options)
    max_bytes = step_options.pop("max_bytes", None)
    if step_options:
        raise TraceError(f"unknown option(s) for tracer.trace(): {', '.join(sorted(step_options))}")
    if max_bytes is not None:
        listeners = [*(listeners or []), Bounds(max_bytes=int(max_bytes))]
    return TraceSession(hash=hash, stacks=stacks, stats=stats, out=out, flush_every=flush_every,
                        listeners=listeners, memory=memory, max_calls=max_calls,
                        check_numerics=check_numerics, raise_on_nonfinite=raise_on_nonfinite,
                        optimizer_ops=optimizer_ops)


def check_numerics(*, raise_on_nonfinite: bool = False, stacks: bool = True,
                   out: str | os.PathLike[str] | None = None) -> TraceSession:
    """A light trace that only looks for NaN/Inf (no checksums); ``t.anomalies`` says where."""
    return TraceSession(hash="none", stacks=stacks, stats=True, out=out, check_numerics=True,
                        raise_on_nonfinite=raise_on_nonfinite)


def explain_errors(*, out: str | os.PathLike[str] | None = None) -> TraceSession:
    """A light trace (names, links and stacks; no checksums, no stats) whose purpose is to
    explain exceptions raised in backward: the failing grad node, the call and line that
    created it, and every enclosing custom-Function level."""
    return TraceSession(hash="none", stacks=True, stats=False, out=out)


@contextlib.contextmanager
def record_memory(**trace_options: Any) -> Iterator[MemoryRecord]:
    """Record every allocation and free of the block; the record is filled when the block ends.

    Runs a light trace (``hash="none"``, stacks on) with ``memory=True``; ``trace_options`` go to
    ``tracer.trace``. ``rec.trace`` is that trace.
    """
    opts: dict[str, Any] = {"hash": "none", "stacks": True, **trace_options, "memory": True}
    rec = MemoryRecord()
    t: Trace | None = None
    try:
        with trace(**opts) as t:
            yield rec
    finally:
        if t is not None:
            rec._fill(t)


