"""The public way in: ``trace()`` and its light variants, ``record_memory()``, ``step()``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, overload

from tracer.analysis.memory import MemoryRecord
from tracer.features.plugins import session_plugins
from tracer.loops.steps import StepObserver, StepTrace, step
from tracer.model import Trace
from tracer.options import OPTION_NAMES, StepOn, TraceError, TraceKwargs, TraceOptions
from tracer.record.checksums.prewarm import PREWARM
from tracer.record.session import TraceSession

if TYPE_CHECKING:  # annotations only (typing.Unpack is Python 3.11's; typing_extensions comes with torch)
    from typing_extensions import Unpack

__all__ = ["check_numerics", "explain_errors", "record_memory", "step", "trace"]

# The recording side is loaded (torch with it): Triton's own start-up now, not in the first
# traced step (tracer.record.checksums.prewarm; nothing without a GPU build of torch and Triton).
PREWARM.run()

# The options of tracer.trace that only a step trace takes (StepTrace's keyword arguments).
STEP_OPTIONS = frozenset({"per_step_files", "optimizer", "observer", "step_on"})


StepSpec = str | int | Iterable[int]


def _path(out: str | os.PathLike[str] | None) -> str | None:
    return None if out is None else os.fspath(out)


@overload
def trace(*, steps: None = None, every: None = None, **options: Unpack[TraceKwargs]) -> TraceSession: ...


@overload
def trace(*, steps: StepSpec | None = ..., every: int | None = ..., per_step_files: bool = ...,
          optimizer: Any = ..., observer: StepObserver | None = ..., step_on: StepOn = ...,
          **options: Unpack[TraceKwargs]) -> StepTrace: ...


def trace(*, steps: StepSpec | None = None, every: int | None = None, **options: Any) -> TraceSession | StepTrace:
    """Record forward API calls, grad nodes, call stacks and tensor checksums of a block.

    ``hash``: ``"md5"`` (exact MD5 of every tensor, the default), ``"fast"`` (a 64-bit
    order-sensitive fingerprint computed on the tensor's device) or ``"none"``.
    ``stacks``: capture the user's call stack of every call (cheap, on by default).
    ``stats``: min/max/mean/absmax/NaN/Inf of every tensor (default: on when hashing).
    ``out``: stream the trace to this file while recording: a crash, even a SIGKILL, keeps every
    call but those of the last ``flush_every`` calls and, of those, the ones recorded in the last
    second (``tracer.record.session.FLUSH_SECONDS``).
    ``flush_every``: calls between two flushes of a streamed file (it is also flushed at the first
    call a second or more after the last flush, and after every backward run).
    ``listeners``: extra ``tracer.Listener`` objects to attach to the recorder.
    ``memory``: also record every allocation and free, attributed to calls and grad nodes.
    ``max_calls``: stop recording cleanly after this many calls (the trace says so).
    ``max_bytes``: likewise once the trace's records reach about this many bytes.
    ``check_numerics``: stats (NaN/Inf counts) for every tensor even without hashing; at the end
    the first NaN and the first unintended Inf of forward and of backward are reported
    (``t.anomalies``).
    ``raise_on_nonfinite``: stop at the first NaN or unintended Inf with ``NonFiniteError`` (reads
    each output once: costly on GPUs, meant for hunting, not for routine runs).
    ``optimizer_ops``: record every op inside ``optimizer.step()``. By default a step is one call
    (named after the optimizer class, ``AdamW0``) from the parameters, gradients and state
    (``optimizer_state``) to the new versions it leaves behind; its intermediate tensors are not
    recorded.
    ``node_runs``: record every grad node's run in backward (the order the engine ran them, the
    gradients each received and produced, named and with their checksums). ``None`` (the
    default): when checksums or stats are taken, values kept, or an attached listener needs
    them (logs, memory); else only the runs of accumulators (each parameter's ``@grad``) and of nodes that
    run Python (custom Functions), and the graph, names, links and stacks come from the forward
    walk alone: a ``hash="none"`` trace costs less. ``True``: always; ``False``: only those.
    ``optimizer_state``: an optimizer step's state tensors (AdamW's ``exp_avg``, ``exp_avg_sq``,
    ``step``) among its inputs and outputs, each value a record. ``None`` (the default): when
    checksums or stats are taken, values kept or memory recorded; a ``hash="none"`` trace then
    records each step from the parameters and gradients to the new parameters only (the state
    is still named where code in the block reads it). ``True``: always; ``False``: never.
    ``keep_values``: also keep the values of chosen tensors, so that ``gradtrace diff`` shows
    element-wise differences for them (max abs, max rel, how many elements, the first index)
    instead of differences of their stats. ``True``: every parameter and buffer (each version);
    a glob pattern or a list of them (``["transformer.h.0.*", "lm_head.weight", "*@grad"]``):
    every tensor value whose name, or the path of the module whose call made it, matches.
    Copied when recorded (CUDA: into pinned memory, without waiting), stored in the trace as
    base64 of the raw bytes.
    ``keep_values_bytes``: at most this many bytes of values per trace (64 MiB); values past it
    are not kept, and the trace's notes say how many and which was first.
    ``steps`` / ``every``: trace only chosen optimizer steps of a longer loop; then
    ``per_step_files``, ``optimizer``, ``observer`` and ``step_on`` (``"backward"``: a step ends
    with each backward pass, for loops without an optimizer) too (``tracer.loops.steps.StepTrace``),
    and what this returns is a ``StepTrace``, else a ``TraceSession`` (``with ... as t`` gives
    the ``Trace``).

    Only the thread that enters the block is traced. Nothing stays installed after the block,
    also when it raises; then the trace is marked ``failed`` and the exception propagates.
    """
    chosen = TraceOptions.from_kwargs(**{k: v for k, v in options.items() if k in OPTION_NAMES})
    step_options = {k: v for k, v in options.items() if k not in OPTION_NAMES}
    if steps is not None or every is not None:
        unknown = sorted(set(step_options) - STEP_OPTIONS)
        if unknown:
            raise TraceError(f"unknown option(s) for tracer.trace(): {', '.join(unknown)}")
        return StepTrace(chosen, steps=steps, every=every, **step_options)
    if step_options:
        hint = " (only with steps= or every=)" if set(step_options) <= STEP_OPTIONS else ""
        raise TraceError(f"unknown option(s) for tracer.trace(): {', '.join(sorted(step_options))}{hint}")
    return TraceSession(chosen, plugins=session_plugins(chosen))


def check_numerics(*, raise_on_nonfinite: bool = False, stacks: bool = True,
                   out: str | os.PathLike[str] | None = None, optimizer_state: bool = False) -> TraceSession:
    """A light trace that only looks for NaN/Inf (no checksums); ``t.anomalies`` says where.
    ``optimizer_state``: check an optimizer step's state tensors too (off: a NaN the step
    finds or makes there shows in the parameters it updates; the state is half of the values
    a ResNet step with AdamW would check)."""
    options = TraceOptions(hash="none", stacks=stacks, stats=None, out=_path(out), check_numerics=True,
                           raise_on_nonfinite=raise_on_nonfinite, optimizer_state=optimizer_state)
    return TraceSession(options, plugins=session_plugins(options))


def explain_errors(*, out: str | os.PathLike[str] | None = None) -> TraceSession:
    """A light trace (names, links and stacks; no checksums, no stats) whose purpose is to
    explain exceptions raised in backward: the failing grad node, the call and line that
    created it, and every enclosing custom-Function level."""
    # Every node's run: the one that fails is known from the runs that finished before it.
    options = TraceOptions(hash="none", stacks=True, stats=False, out=_path(out), node_runs=True)
    return TraceSession(options, plugins=session_plugins(options))


@contextlib.contextmanager
def record_memory(**trace_options: Unpack[TraceKwargs]) -> Iterator[MemoryRecord]:
    """Record every allocation and free of the block; the record is filled when the block ends.

    Runs a light trace (``hash="none"``, stacks on) with ``memory=True``; ``trace_options`` are
    ``tracer.trace``'s (not ``steps``/``every``). ``rec.trace`` is that trace.
    """
    options = TraceOptions.from_kwargs(**{"hash": "none", "stacks": True, **trace_options, "memory": True})
    rec = MemoryRecord()
    t: Trace | None = None
    try:
        with TraceSession(options, plugins=session_plugins(options)) as t:
            yield rec
    finally:
        if t is not None:
            rec.fill(t)
