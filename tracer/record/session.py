"""``TraceSession``: one traced block, from installing the recorder to the finished ``Trace``
(what ``tracer.trace()`` returns without ``steps``/``every``)."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal, Protocol

import torch

from tracer.model import Trace, TraceStream
from tracer.options import TraceError, TraceOptions
from tracer.record import recorder as _recorder
from tracer.record import warning_sites
from tracer.record.checksums.fingerprint import ALGORITHM as FINGERPRINT_ALGORITHM
from tracer.record.end_progress import checksum_progress
from tracer.record.mode import COMPILED
from tracer.record.protocol import RecorderAPI
from tracer.record.stacks import user_stacklevel
from tracer.version import __version__

# Whether the user's gc thresholds come back after the end's results are filled in (see
# TraceSession._exit), not before; a switch for benchmarks/lever_ab.py.
RESTORE_GC_AFTER_END = True

# One trace at a time per process (the apply wrapper, the module hooks and the gc thresholds are
# process-wide): a session claims the process under this lock before it installs anything, and
# gives it back once everything is uninstalled and restored.
_CLAIM_LOCK = threading.Lock()
_claimed_by: tuple[TraceSession, int, str] | None = None  # (session, thread ident, thread name)


def _claim(session: TraceSession) -> None:
    global _claimed_by
    with _CLAIM_LOCK:
        active = _recorder.active_recorder()
        if _claimed_by is not None or (active is not None and not active.closed):
            where = "this thread" if _claimed_by is None or _claimed_by[1] == threading.get_ident() \
                else f"thread {_claimed_by[2]!r}"
            raise TraceError(f"tracer.trace() is already active in this process (entered by {where}); traces "
                             "do not nest and one process records one trace at a time. Close the other "
                             "`with tracer.trace()` block first, or trace the outer block only.")
        _claimed_by = (session, threading.get_ident(), threading.current_thread().name)


def _release(session: TraceSession) -> None:
    global _claimed_by
    with _CLAIM_LOCK:
        if _claimed_by is not None and _claimed_by[0] is session:
            _claimed_by = None


def _note_unfinished_checksums(t: Trace, algorithm: str, err: Exception) -> None:
    """Where the checksums could not be finished at the end of the block: every record still
    without one says why, the trace says so once, and so does a warning; the rest of the trace
    (calls, names, links, stacks) is complete."""
    reason = f"checksum not finished: gradtrace failed at the end of the block ({type(err).__name__}: {err})"
    field = {"md5": "md5", "fast": "fingerprint"}.get(algorithm)
    missing = 0
    if field is not None:
        for r in t.tensors.values():
            if getattr(r, field) is None and r.hash_note is None and not r.uninitialized:
                r.hash_note = reason
                missing += 1
    message = (f"the checksums and stats could not be finished at the end of the block "
               f"({type(err).__name__}: {err}); {missing} tensors have no checksum (their hash_note says so), "
               "everything else in the trace is complete. Please report this as a gradtrace bug.")
    t.notes.append(message)
    warnings.warn(f"gradtrace: {message}", RuntimeWarning, stacklevel=user_stacklevel())


# A streamed file is flushed (written through to the OS, gzip with a sync flush) every
# ``flush_every`` calls, at the first call this many seconds after the last flush, after every
# backward run and after every optimizer step: a SIGKILL loses fewer than ``flush_every`` calls,
# none recorded this long before a later call, and none of a step whose optimizer step ended.
FLUSH_SECONDS = 1.0


class NumericsWarning(RuntimeWarning):
    """``check_numerics`` found a NaN or Inf; the message is the report."""


class SessionPlugin(Protocol):
    """A feature a trace session composes in (memory records, the NaN guard, logs, distributed
    runs): ``prepare`` before the recorder exists (header fields, the output path), ``attach``
    once it is installed, returning what undoes it (or None). The session imports no feature:
    ``tracer.features.plugins`` picks them from the options."""

    def prepare(self, session: TraceSession, trace: Trace) -> None: ...

    def attach(self, recorder: RecorderAPI) -> Callable[[], None] | None: ...


class TraceSession:
    """One traced block (what ``trace()`` returns without ``steps``/``every``).

    ``options``: what to record (``tracer.options.TraceOptions``). ``plugins``: the features to
    compose in. ``append``: a streamed file gets this block as one more segment instead of being
    started afresh (the steps of one run); ``header_extra``: fields for the header (``step``).
    """

    def __init__(self, options: TraceOptions, *, plugins: Sequence[SessionPlugin] = (), append: bool = False,
                 header_extra: dict[str, Any] | None = None) -> None:
        self.options = options
        self.plugins = list(plugins)
        self.append = append
        self.header_extra = dict(header_extra or {})
        self.out = options.out  # plugins may change it (one file per rank)
        self.offset = 0  # where this block's records start in its file (appending)
        self.trace: Trace | None = None
        self._recorder: _recorder.Recorder | None = None
        self._stream: TraceStream | None = None
        self._last_flush_time = 0.0
        self._detach: list[Callable[[], None]] = []
        self._gc_threshold: tuple[int, int, int] | None = None
        self._thread: tuple[int, str] | None = None  # (ident, name) of the thread that entered the block

    @property
    def recorder(self) -> _recorder.Recorder | None:
        """The recorder of the block while it runs."""
        return self._recorder

    # ---- enter / exit -------------------------------------------------------------------------
    def __enter__(self) -> Trace:
        _claim(self)
        self._thread = threading.get_ident(), threading.current_thread().name
        try:
            return self._enter()
        except BaseException:
            _release(self)  # (__exit__ ran already where anything was installed)
            raise

    def _enter(self) -> Trace:
        o = self.options
        t = Trace(header={"hash": o.hash, "stacks": o.stacks, "stats": o.effective_stats,
                          "check_numerics": o.numerics, "optimizer_ops": o.optimizer_ops,
                          "node_runs": o.every_node_run, "optimizer_state": o.records_optimizer_state,
                          "torch": torch.__version__, "gradtrace": __version__,
                          "python": platform.python_version()},
                  meta={"host": socket.gethostname(), "pid": os.getpid(), "cwd": os.getcwd(),
                        "argv": list(sys.argv), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "out": self.out})
        self.trace = t
        for plugin in self.plugins:
            plugin.prepare(self, t)
        t.meta["out"] = self.out
        rec = _recorder.Recorder(t, o, on_records=self._maybe_flush if self.out else None)
        t.header["node_attribution"] = rec.node_attribution
        if o.hash == "fast":
            t.header["fingerprint"] = FINGERPRINT_ALGORITHM
        t.header.update(self.header_extra)
        rec.listeners.extend(o.listeners)
        self._t0 = time.perf_counter()
        if self.out:
            # The file first, before anything is installed: a path that cannot be opened (a
            # missing directory, no permission, another process writing it) raises here as it is,
            # and the program's own modes and hooks are left exactly as they were.
            if self.append and os.path.exists(self.out):
                self.offset = os.path.getsize(self.out)
            self._stream = TraceStream(self.out, append=self.append)
        self._recorder = rec
        try:
            if self._stream is not None:
                self._stream.begin(t)
            self._last_flush_time = time.monotonic()
            COMPILED.ran = False
            # Every call adds a few small records; with CPython's default thresholds the young
            # generation fills every few dozen calls and collections over the growing trace cost as
            # much as the recording itself (measured: 29.8 -> 16.0 us/call on a 20k-call trace).
            # 50,000 is about one GPT-2-small training step's records (calls, nodes, tensors and
            # their hooks): a young collection then comes about once per step, mostly after the
            # backward pass has freed the step's graph and activations, instead of several times
            # in the middle of it, each walking (and promoting) all those live objects (measured on
            # benchmarks/overhead.py tiny12: 6.6 -> 4.2 ms of collection per traced step). Cyclic
            # garbage is still collected at least that often; the user's thresholds come back on
            # exit.
            self._gc_threshold = gc.get_threshold()
            t0, t1, t2 = self._gc_threshold
            if t0 > 0:
                gc.set_threshold(max(t0, 50_000), max(t1, 50), max(t2, 100))
            rec.install()
            warning_sites.install()  # warnings inside traced ops point at the user's line
            quiet = warning_sites.quiet_global_hooks_warning(rec)
            if quiet is not None:
                self._detach.append(quiet)
            for plugin in self.plugins:
                undo = plugin.attach(rec)
                if undo is not None:
                    self._detach.append(undo)
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return t

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if self._thread is not None and self._thread[0] != threading.get_ident():
            # The recording mode is on the entering thread's stack of modes (each thread has its
            # own), and the block's calls run there: it can only be undone there.
            raise TraceError(f"a traced block must end on the thread that entered it (thread {self._thread[1]!r}), "
                             f"not on thread {threading.current_thread().name!r}; it is still recording: "
                             "leave it (call __exit__) on its own thread")
        try:
            self._exit(exc)
        finally:
            _release(self)  # last: the next trace may start once everything here is undone
        return False

    def _exit(self, exc: BaseException | None) -> None:
        rec, t = self._recorder, self.trace
        assert rec is not None and t is not None
        if not RESTORE_GC_AFTER_END:  # (the lever off: as before)
            self._give_back_gc()
        try:
            rec.uninstall()  # first: whatever happens below, nothing stays installed
            while self._detach:
                self._detach.pop()()
            try:
                self._finalize(rec, t, exc)
            finally:
                if self._stream is not None:
                    try:
                        self._stream.close()  # (gzip writes its trailer here)
                    except OSError as exc:
                        self._stream_failed(exc)
                # The recorder's flush callback points back at this session, and its parts at the
                # recorder: drop both, so that the finished recorder and trace are freed by reference
                # counting, not by the cycle collector walking every record.
                rec.on_records = None
                rec.release()
        finally:
            # The user's thresholds come back last: the end's checksums and stats make a record's
            # results (a Stats object each, the fetched rows) by the thousand, and with the
            # user's young-generation threshold (700) each few hundred of them set off a
            # collection, whose survivors went on to the older generations (resnet50-tiny under
            # hash="fast": 9 young and 0.8 middle collections a step at the end, 4.2 ms). Now
            # the one young collection comes at the program's next allocations.
            self._give_back_gc()

    def _give_back_gc(self) -> None:
        if self._gc_threshold is not None:
            gc.set_threshold(*self._gc_threshold)
            self._gc_threshold = None

    def _finalize(self, rec: _recorder.Recorder, t: Trace, exc: BaseException | None) -> None:
        try:
            with checksum_progress(rec.hasher.queued_bytes()) as on_bytes:
                rec.hasher.close(on_bytes)
        except Exception as err:  # a fault of the checksums must not cost the trace
            rec.hasher.abandon()
            _note_unfinished_checksums(t, self.options.hash, err)
        for li in rec.listeners:
            finish = getattr(li, "finish", None)  # listeners that write into the trace at the end
            if finish is not None:
                finish(t)
        t.frames = rec.stack_table.symbolize()
        t.stacks = list(rec.stack_table.stacks)
        t.calls.sort(key=lambda c: c.seq)
        t.meta["seconds"] = round(time.perf_counter() - self._t0, 6)
        if COMPILED.ran:
            t.notes.append("torch.compile'd functions ran in this block: what their compiled code ran was not seen "
                           "(an op that runs as eager Python, e.g. under backend='eager', is recorded as usual)")
        if rec.hasher.capturing_skipped:
            t.notes.append(f"{rec.hasher.capturing_skipped} tensors were not hashed during CUDA graph capture")
        if exc is not None:
            t.status = "failed"
            t.error = {"type": type(exc).__name__, "message": str(exc),
                       "last_call": t.calls[-1].name if t.calls else ""}
        t.resolve()
        if self.options.numerics and exc is None:
            report = t.anomalies
            # The report's story, the same words as every other surface; a step GradScaler skipped
            # for an overflow of its loss scale is not a fault (the report still says so).
            if not report.clean and report.skipped_step is None:
                warnings.warn(f"gradtrace: {report}", NumericsWarning, stacklevel=user_stacklevel())
        if self._stream is not None:
            try:
                self._flush(final=True)
                self._stream.end(t)
            except OSError as exc:  # the block ended well: its end must not fail the program now
                self._stream_failed(exc)

    # ---- streaming ----------------------------------------------------------------------------
    def _maybe_flush(self) -> None:
        t, stream = self.trace, self._stream
        assert t is not None and stream is not None
        unwritten = len(t.calls) - stream.calls_written
        # (an optimizer step just ended: a training loop often waits for its next batch now, and
        # a crash while it waits would lose the whole step's calls)
        if unwritten >= self.options.flush_every or (unwritten and (
                time.monotonic() - self._last_flush_time >= FLUSH_SECONDS or t.calls[-1].kind == "optimizer")) or (
                stream.runs_written < len(t.backward_runs) and self._recorder is not None
                and stream.runs_written < self._recorder.finished_runs):  # a run has just ended
            try:
                self._flush(final=False)
            except OSError as exc:  # a full disk, a quota, a file grown past its limit
                self._stream_failed(exc)

    def _stream_failed(self, exc: OSError) -> None:
        """Writing the streamed file failed while the block runs (inside the program's own torch
        calls and backward): recording stops, the file keeps what reached it, the trace in
        memory keeps what was recorded, and the program goes on untraced, as after any failure
        of gradtrace's own (tracer.record.failsafe). Nothing more is written to the file."""
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
        rec = self._recorder
        if rec is not None:
            rec.on_records = None  # (nothing more to flush)
        reason = (f"recording stopped: writing the trace to {self.out} failed ({type(exc).__name__}: "
                  f"{exc.strerror or exc}); the program went on untraced from there. The file holds what "
                  "was written before (readable as a trace cut short); the trace in memory holds every call "
                  "recorded before the failure (the trace the block returned: t.save(path) keeps it elsewhere)")
        if rec is not None and not rec.stopped:
            rec.stop(reason)
        elif self.trace is not None:
            self.trace.notes.append(reason)
            warnings.warn(f"gradtrace: {reason}", RuntimeWarning, stacklevel=user_stacklevel())

    def _flush(self, final: bool) -> None:
        """Write what the trace gained since the last flush (tracer.model.writer.TraceStream)."""
        t, rec, stream = self.trace, self._recorder, self._stream
        assert t is not None and rec is not None and stream is not None
        with rec.lock:
            rec.hasher.drain(wait=final)
            pending = set() if final else rec.hasher.pending()
            table = rec.stack_table
            frames_from = (lambda k: t.frames[k:]) if final else table.symbolize
            records = stream.new_records(t, frames_from, table.stacks, pending,
                                         len(t.backward_runs) if final else rec.finished_runs, final)
            self._last_flush_time = time.monotonic()
        stream.write(records)
