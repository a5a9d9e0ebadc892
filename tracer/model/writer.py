"""Writing ``.gtrace`` files: a whole trace at once (``write_trace``), or as it grows while
recording (``TraceStream``, over ``StreamWriter``). JSON lines, gzip-compressed when the path ends
in ``.gz``; the format is documented in docs/trace-format.md, and ``tracer.model.fileformat``
reads it back. The records a trace is written as are made here and by the records' own
``to_json`` (``Trace.records()`` and ``TraceStream`` write the same ones)."""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import os
import stat
import tempfile
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracer.model.records import Frame
    from tracer.model.trace import Trace

from tracer.model.claims import OutputClaim, claim_output

GZIP_MAGIC = b"\x1f\x8b"


def _dumps(record: dict[str, Any]) -> str:
    # allow_nan: stats of tensors full of Inf are real data; JSON's NaN/Infinity extension is
    # what Python reads back, and the loader accepts nothing else beyond strict JSON.
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


def meta_record(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {"t": "meta", **fields}


def stack_record(stack_id: int, frames: Sequence[int]) -> dict[str, Any]:
    return {"t": "stack", "id": stack_id, "frames": list(frames)}


def module_record(path: str, cls: str) -> dict[str, Any]:
    return {"t": "module", "path": path, "class": cls}


def memory_record(event: Mapping[str, Any]) -> dict[str, Any]:
    return {"t": "memory", **event}


def write_trace(records: Iterable[dict[str, Any]], path: str) -> None:
    """Write a complete trace's records (``Trace.records()``, in canonical order).

    Written to a fresh temporary file in the target's directory (``mkstemp``: created with
    ``O_EXCL`` under an unpredictable name, so a link planted there is never followed) and renamed
    over the target: the file is either complete or absent."""
    path = os.fspath(path)
    folder, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as raw:
            binary: IO[bytes] = raw
            if path.endswith(".gz"):
                binary = gzip.GzipFile(filename=base, mode="wb", fileobj=raw)  # type: ignore[assignment]
            with io.TextIOWrapper(binary, encoding="utf-8") as fh:
                for rec in records:
                    fh.write(_dumps(rec))
                    fh.write("\n")
                fh.flush()
                if binary is not raw:
                    binary.close()  # the gzip trailer, before the raw file closes
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _mode_for(path: str) -> int:
    """``mkstemp`` makes the file private (0600); a saved trace gets what ``open()`` would have
    given it: the existing file's mode, or 0666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


class StreamWriter:
    """Appends records to a trace file as recording goes, flushing so a crash loses little.

    Every ``write`` reaches the operating system before it returns (a SIGKILL right after loses
    nothing of it); a gzip file gets a sync flush there (``Z_SYNC_FLUSH``), so a reader can
    decompress everything up to that point even if the file ends right after it. ``append=True``
    adds a segment after what the file holds (a multi-step file) instead of starting afresh.
    """

    def __init__(self, path: str, append: bool = False) -> None:
        self.path = str(path)
        # Claimed before it is opened (and truncated): a second process writing the same file
        # gets OutputInUse and the first one's file is untouched.
        self._claim: OutputClaim | None = claim_output(self.path)
        try:
            self._raw: IO[bytes] | None = open(self.path, "ab" if append else "wb")  # noqa: SIM115 (kept open)
            self._gz: gzip.GzipFile | None = gzip.GzipFile(filename=os.path.basename(self.path), mode="wb",
                                                           fileobj=self._raw) if self.path.endswith(".gz") else None
        except BaseException:
            self._claim.release()
            raise
        _OPEN.add(self)

    def disown(self) -> None:
        """In a process forked while this file was open (a DataLoader worker started inside a
        traced block): the file is the parent's. This process's copy of the descriptor is
        pointed at /dev/null, so nothing it writes, flushes or closes (a gzip trailer at exit)
        reaches the parent's file, and the writer writes nothing more."""
        raw, self._raw, self._gz = self._raw, None, None
        self._claim = None  # the parent's (tracer.model.claims forgets it in the child)
        if raw is None:
            return
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, raw.fileno())
            finally:
                os.close(null)
        except OSError:  # no /dev/null: the objects are kept, unflushed, and never written
            _DISOWNED.append(raw)

    def write(self, records: list[dict[str, Any]]) -> None:
        if self._raw is None or not records:
            return
        data = "".join(_dumps(r) + "\n" for r in records).encode("utf-8")
        if self._gz is not None:
            self._gz.write(data)
            self._gz.flush(zlib.Z_SYNC_FLUSH)  # complete deflate blocks, byte-aligned, in the file
        else:
            self._raw.write(data)
        self._raw.flush()

    def close(self) -> None:
        if self._raw is None:
            return
        raw, gz, claim = self._raw, self._gz, self._claim
        self._raw = self._gz = self._claim = None
        try:
            try:
                if gz is not None:
                    gz.close()  # the gzip trailer (CRC and size): the member is complete
            finally:
                raw.close()  # (raises where its last buffered bytes cannot be written: a full disk)
        finally:
            if claim is not None:  # the file is given back whatever its close said
                claim.release()


class TraceStream:
    """A trace written to its file while it is recorded: at each ``write_new`` the records made
    since the last one, in the file's order within each kind (frames, stacks, modules, tensors,
    calls, grad nodes, backward runs), the same records ``Trace.records()`` saves.

    What may still change is held back: a tensor record whose checksum is pending (written once
    it is done), a backward run still being filled (written once it has ended, in order). The
    calls are appended in the order they finished; at the end, the calls not yet written are
    written by their place (``seq``), which the loader sorts by.
    """

    def __init__(self, path: str, append: bool = False) -> None:
        self.writer = StreamWriter(path, append=append)
        self._written = {"frames": 0, "stacks": 0, "modules": 0, "tensors": 0, "calls": 0, "nodes": 0, "runs": 0}
        self._held: list[Any] = []  # tensor records waiting for their checksum
        self._seqs_written: set[int] = set()

    @property
    def calls_written(self) -> int:
        """How many of the trace's calls have been written."""
        return self._written["calls"]

    @property
    def runs_written(self) -> int:
        return self._written["runs"]

    def begin(self, trace: Trace) -> None:
        self.writer.write([trace.header_record(), meta_record(trace.meta)])

    def new_records(self, trace: Trace, frames_from: Callable[[int], Sequence[Frame]],
                    stacks: Sequence[Sequence[int]], pending: set[int], done_runs: int,
                    final: bool) -> list[dict[str, Any]]:
        """The records of what ``trace`` gained since the last call, counted as written (the
        caller writes them: ``write``). ``frames_from(k)``: the interned frames from the k-th on;
        ``stacks``: every interned stack; ``pending``: ``id()`` of the tensor records whose
        checksum is not done; ``done_runs``: how many backward runs, from the first, have ended;
        ``final``: the trace is complete (memory events too)."""
        n = self._written
        out: list[dict[str, Any]] = []
        frames = frames_from(n["frames"])
        out += [f.to_json(n["frames"] + i) for i, f in enumerate(frames)]
        n["frames"] += len(frames)
        new_stacks = stacks[n["stacks"]:]
        out += [stack_record(n["stacks"] + i, s) for i, s in enumerate(new_stacks)]
        n["stacks"] += len(new_stacks)
        mods = list(itertools.islice(trace.modules.items(), n["modules"], None))
        out += [module_record(p, c) for p, c in mods]
        n["modules"] += len(mods)
        new_tensors = list(itertools.islice(trace.tensors.values(), n["tensors"], None))
        n["tensors"] += len(new_tensors)
        waiting = self._held + new_tensors
        self._held = [r for r in waiting if id(r) in pending]
        out += [r.to_json() for r in waiting if id(r) not in pending]
        # The live list is appended in completion order and sorted only at the end.
        calls = trace.calls[n["calls"]:] if not final else [c for c in trace.calls if c.seq not in self._seqs_written]
        out += [c.to_json() for c in calls]
        if not final:
            self._seqs_written.update(c.seq for c in calls)
        n["calls"] = len(trace.calls)
        nodes = trace.grad_nodes[n["nodes"]:]
        out += [g.to_json() for g in nodes]
        n["nodes"] += len(nodes)
        # A run is written once it has ended, never while open: a run that started nested
        # runs (reentrant checkpointing) is still filled after they end, and runs are
        # written in order, so nothing after the first open run is written yet.
        out += [b.to_json() for b in trace.backward_runs[n["runs"]:done_runs]]
        n["runs"] = max(n["runs"], done_runs)
        if final:  # memory events are written by their listener's finish(), at the end
            out += [memory_record(m) for m in trace.memory]
        return out

    def write(self, records: list[dict[str, Any]]) -> None:
        self.writer.write(records)

    def end(self, trace: Trace) -> None:
        """The block's last records: how long it took and the end record."""
        self.writer.write([meta_record({"seconds": trace.meta["seconds"]}), trace.end_record()])

    def close(self) -> None:
        self.writer.close()


# Stream writers with an open file, for the fork handler below.
_OPEN: weakref.WeakSet[StreamWriter] = weakref.WeakSet()
_DISOWNED: list[IO[bytes]] = []


def _disown_in_child() -> None:
    for w in list(_OPEN):
        w.disown()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_in_child)
