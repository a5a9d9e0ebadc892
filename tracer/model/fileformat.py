"""Reading ``.gtrace`` files: JSON lines, optionally gzip, validated, never executed.

A file is a ``header`` record, then any mix of ``meta``, ``frame``, ``stack``, ``module``,
``tensor``, ``call``, ``node`` and ``backward`` records, then an ``end`` record. Records may come
in any order after the header because a streamed file writes each one as soon as it is final
(a tensor when its checksum is ready, a backward run when it ends). A file without its ``end``
record was cut short (a crash): it loads with a warning and ``status == "truncated"``.

A file may also hold several complete traces one after another (``tracer.trace(steps=...)``
appends one per traced training step): each segment starts with its own ``header`` record, which
carries the segment's ``step`` number, and ends with its ``end`` record. ``load`` returns the
first segment (or ``step=N``) and lists the steps in ``meta["steps_in_file"]``; ``load_steps``
returns them all; ``read_trace`` also says what each step of the file holds (``StepInfo``).

A trace file is untrusted input (they are attached to bug reports): the file is read as a stream
(gzip decompressed incrementally, one line at a time) so that memory follows the records kept,
not the size of the file; decompression stops at a limit (``max_decompressed``, the
``GRADTRACE_MAX_DECOMPRESSED`` environment variable) and a record at ``MAX_RECORD_BYTES``; every
field is checked by type and range (``tracer.model.records``) and the links between records by
``tracer.model.structure``. Every refusal is a ``TraceFormatError`` with a one-line reason.
"""

from __future__ import annotations

import json
import os
import re
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import IO, Any, cast

from tracer.model.phases import upgrade_phases
from tracer.model.records import (
    FORMAT,
    MAX_INT,
    MAX_MODULE_DEPTH,
    PHASES,
    SCHEMA_VERSION,
    TRACE_STATUSES,
    BackwardRun,
    Call,
    Frame,
    GradNode,
    MemoryEvent,
    TensorRecord,
    TraceFormatError,
)
from tracer.model.structure import check_structure
from tracer.model.trace import Trace
from tracer.model.writer import GZIP_MAGIC

ENV_MAX_DECOMPRESSED = "GRADTRACE_MAX_DECOMPRESSED"
# Generous: the largest real traces (a multi-billion-parameter model's step with stacks) stay
# well under it, and a gzip bomb stops there instead of filling memory or disk time.
DEFAULT_MAX_DECOMPRESSED = 4 << 30
MAX_BLANK_LINES = 10_000  # in one file (gradtrace writes none)
# Traces (segments) in one file. A traced step is a whole trace, tens of kB at the least, so
# 10,000 steps in one file is gigabytes; an empty segment is two short lines, and 100,000 of
# them gzip to 17 kB. Runs that trace more steps write one file per step (per_step_files).
MAX_SEGMENTS = 10_000
# One record (one line). The longest real records are backward runs of large models (a step per
# grad node run) at a few MB; parsing a line costs several times its size in memory.
MAX_RECORD_BYTES = 64 << 20
# Nesting of free-form values (header, meta): the format itself nests four levels deep.
MAX_DEPTH = 32
_CHUNK = 1 << 20


class TruncatedTraceWarning(UserWarning):
    """The trace file ended before its end record; what was written is returned."""


@dataclass(slots=True)
class StepInfo:
    """One trace of a file (a segment: one traced step of a multi-step file), as read.

    ``status`` is the end record's (``ok``, ``failed``) or ``truncated``; ``nonfinite`` counts
    the tensors whose stats saw a NaN or an Inf; ``error`` is the end record's error.
    """

    step: int | None
    line: int
    status: str = "truncated"
    calls: int = 0
    tensors: int = 0
    nonfinite: int = 0
    error: dict[str, str] | None = None


# ---- sizes -------------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A size as a person writes it: the one grammar of every size gradtrace reads (the command
    line's ``--max-bytes``, ``--keep-values-bytes``, ``--max-decompressed``, and
    ``GRADTRACE_MAX_DECOMPRESSED``). Plain bytes (``4096``, ``4096B``); ``k``, ``M``, ``G``,
    ``T`` (also ``kB``, ``MB``, ...) are powers of 1000, as gradtrace prints sizes (``3.2 MB``);
    ``KiB``, ``MiB``, ``GiB``, ``TiB`` (also ``Ki``, ``Mi``, ...) powers of 1024; the case does not
    matter, a fraction is rounded down to whole bytes (``1.5G``: 1,500,000,000)."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text[:40]!r} (write e.g. 500M, 8G or 8GiB)")
    unit, binary = (m.group(2) or "").lower(), m.group(3)
    power = (1024 if binary else 1000) ** " kmgt".index(unit or " ")
    value = int(Fraction(m.group(1)) * power)  # exact: 4.1G is 4,100,000,000, not one byte less
    if value < 1:
        raise ValueError(f"not a size: {text[:40]!r} (must be at least 1 byte)")
    return value


def default_max_decompressed() -> int:
    """The decompression limit: ``GRADTRACE_MAX_DECOMPRESSED`` if set, else 4 GiB."""
    text = os.environ.get(ENV_MAX_DECOMPRESSED)
    if not text:
        return DEFAULT_MAX_DECOMPRESSED
    try:
        return parse_size(text)
    except ValueError as exc:
        raise TraceFormatError(f"{ENV_MAX_DECOMPRESSED}: {exc}") from None


# ---- bytes to lines ------------------------------------------------------------------------------------
def _plain_chunks(fh: IO[bytes], head: bytes) -> Iterator[bytes]:
    yield head
    while chunk := fh.read(_CHUNK):
        yield chunk


class _Gunzip:
    """Decompresses gzip members back to back, keeping every byte that decompresses: a stream
    cut short yields what it held up to the cut and sets ``cut``."""

    def __init__(self, path: str, limit: int) -> None:
        self.path, self.limit = path, limit
        self.total = 0
        self.cut = False

    def chunks(self, fh: IO[bytes], head: bytes) -> Iterator[bytes]:
        d = zlib.decompressobj(31)
        in_member = False
        data = head
        while True:
            if not data:
                data = fh.read(_CHUNK)
                if not data:
                    break
            if not in_member:
                data = data.lstrip(b"\0")  # zero padding after the last member, as gzip allows
                if not data:
                    continue
                in_member = True
            try:
                out = d.decompress(data, _CHUNK)
            except zlib.error as exc:
                raise TraceFormatError(f"{self.path}: corrupt gzip data after {self.total:,} "
                                       f"decompressed bytes ({exc})") from None
            yield self._count(out)
            if d.eof:
                data = d.unused_data
                d = zlib.decompressobj(31)
                in_member = False
            else:
                data = d.unconsumed_tail
        if in_member:  # the stream ends inside a member: keep what it held
            self.cut = True
            try:
                yield self._count(d.flush())
            except zlib.error:
                pass

    def _count(self, out: bytes) -> bytes:
        self.total += len(out)
        if self.total > self.limit:
            raise TraceFormatError(
                f"{self.path}: decompresses to more than {self.limit:,} bytes (a gzip bomb?); if the "
                f"trace is real, raise the limit with {ENV_MAX_DECOMPRESSED}=16G or --max-decompressed 16G")
        return out


def _lines(chunks: Iterator[bytes], path: str, record_limit: int) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, line, ended by a newline) for each line; a line longer than the record
    limit is refused before it is held whole."""
    buf = bytearray()
    lineno = 0
    for chunk in chunks:
        scan = len(buf)
        buf += chunk
        start = 0
        while (i := buf.find(b"\n", scan)) >= 0:
            lineno += 1
            yield lineno, bytes(buf[start:i]), True
            start = scan = i + 1
        del buf[:start]
        if len(buf) > record_limit:
            raise TraceFormatError(f"{path}: line {lineno + 1} is longer than {record_limit:,} bytes "
                                   "(no record is that long)")
    if buf:
        yield lineno + 1, bytes(buf), False


# ---- one line to one record ---------------------------------------------------------------------------
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _parse_constant(name: str) -> float:
    # JSON's NaN/Infinity extension, used by stats; the record checks refuse it where a float
    # has no place.
    return float(name)


# One decoder for every line (``json.loads`` with an option builds a new one per call).
_DECODER = json.JSONDecoder(parse_constant=_parse_constant)


class _BadLine(Exception):
    """A line that is not a JSON value gradtrace accepts; the message says why."""


def _parse(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _BadLine("not UTF-8 text") from None
    try:
        rec = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise _BadLine(f"{exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise _BadLine("nested too deeply") from None
    except ValueError as exc:  # an integer of thousands of digits
        raise _BadLine(str(exc).split(";")[0][:120]) from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(rec, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _BadLine("a string holds a lone UTF-16 surrogate (not text)") from None
    return rec


def depth_within(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON ``value`` nests at most ``limit`` levels deep (walked without recursion: a
    hostile file nests a million levels)."""
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict | list):
            if depth >= limit:
                return False
            todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


# ---- segments -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Segment:
    """One trace of the file being read; only a kept one holds its records (a segment that is
    only counted costs its ``StepInfo``)."""

    info: StepInfo
    keep: bool
    trace: Trace = field(default_factory=Trace)
    frames: dict[int, Frame] = field(default_factory=dict)
    stacks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    ended: bool = False


_COUNTED = Trace()  # what every segment that is not kept points at: never filled, never returned


_HEADER_TYPES: dict[str, type | tuple[type, ...]] = {
    "hash": str, "fingerprint": str, "stacks": bool, "stats": bool, "optimizer_ops": bool, "node_runs": bool,
    "optimizer_state": bool,
    "check_numerics": bool, "torch": str, "gradtrace": str, "python": str, "node_attribution": str,
    "distributed": dict,
}


def _check_header(path: str, rec: dict[str, Any]) -> None:
    if rec.get("t") != "header" or rec.get("format") != FORMAT:
        raise TraceFormatError(f"{path}: not a gradtrace file (no gradtrace header on line 1)")
    version = rec.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise TraceFormatError(f"{path}: header has no integer format version")
    if version > SCHEMA_VERSION:
        raise TraceFormatError(f"{path}: trace format version {version} is newer than this gradtrace "
                               f"reads (version {SCHEMA_VERSION}); upgrade gradtrace")
    if version < 1:
        raise TraceFormatError(f"{path}: unknown trace format version {version} (this gradtrace reads "
                               f"version {SCHEMA_VERSION})")
    for key, kind in _HEADER_TYPES.items():
        if key in rec and not isinstance(rec[key], kind):
            raise TraceFormatError(f"{path}: header field {key!r} has the wrong type ({type(rec[key]).__name__})")
    step = rec.get("step")
    if step is not None and not _is_id(step):
        raise TraceFormatError(f"{path}: header field 'step' must be an integer from 0 to 2**63-1")
    if "distributed" in rec:
        _check_distributed(path, rec["distributed"])
    if not depth_within(rec):
        raise TraceFormatError(f"{path}: header nested more than {MAX_DEPTH} levels deep")


def _check_distributed(path: str, info: dict[str, Any]) -> None:
    """A rank is one of its world: readers size things by these numbers, checked here (how many
    ranks a world has is the file's claim; readers bound what they do with it by the ranks they
    are given)."""
    for key in ("rank", "world_size"):
        if key in info and not _is_id(info[key]):
            raise TraceFormatError(f"{path}: header field 'distributed.{key}' must be an integer from 0 to 2**63-1")
    rank, world = info.get("rank"), info.get("world_size")
    if rank is not None and world is not None and rank >= world:
        raise TraceFormatError(f"{path}: header says rank {rank} of a world of {world} ranks (ranks count from 0)")


def read_trace(path: str | os.PathLike[str], step: int | None = None, *, all_steps: bool = False,
               max_decompressed: int | None = None) -> tuple[list[Trace], list[StepInfo]]:
    """Read a trace file in one pass: the traces kept, and what every trace of the file holds.

    Keeps the first trace, or the first of step ``step``, or with ``all_steps`` every one. Every
    record of every trace is validated, kept or not. Raises ``TraceFormatError`` (one line).
    """
    path = os.fspath(path)
    limit = default_max_decompressed() if max_decompressed is None else max_decompressed
    try:
        fh = open(path, "rb")  # noqa: SIM115 (closed below; the open's own errors get their own words)
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceFormatError(f"{path}: is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    try:
        with fh:
            return _read(fh, path, step, all_steps, limit)
    except OSError as exc:  # a read error after opening (an I/O error, a directory on some systems)
        raise TraceFormatError(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    except MemoryError:
        raise TraceFormatError(f"{path}: out of memory while reading (the trace is too large for this "
                               "machine)") from None


def _read(fh: IO[bytes], path: str, step: int | None, all_steps: bool,
          limit: int) -> tuple[list[Trace], list[StepInfo]]:
    head = fh.read(2)
    gunzip = _Gunzip(path, limit) if head == GZIP_MAGIC else None
    chunks = gunzip.chunks(fh, head) if gunzip is not None else _plain_chunks(fh, head)
    segments: list[_Segment] = []
    current: _Segment | None = None
    found = False
    blank = 0
    for lineno, raw, terminated in _lines(chunks, path, min(MAX_RECORD_BYTES, limit)):
        if not raw.strip():
            # gradtrace writes none; a file of them (a small gzip of newlines) would otherwise
            # take minutes to read up to the decompression limit.
            blank += 1
            if blank > MAX_BLANK_LINES:
                raise TraceFormatError(f"{path}: more than {MAX_BLANK_LINES:,} blank lines: not a trace "
                                       "gradtrace wrote")
            continue
        try:
            rec = _parse(raw)
        except _BadLine as exc:
            if not terminated and current is not None:  # the last line, cut off mid-record by a crash
                break
            if current is None:
                raise TraceFormatError(f"{path}: not a gradtrace file (line {lineno} is not JSON: {exc})") from None
            raise TraceFormatError(f"{path}: corrupt record at line {lineno}: {exc}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("t"), str):
            if current is None:
                raise TraceFormatError(f"{path}: not a gradtrace file (line {lineno} is not a gradtrace header)")
            raise TraceFormatError(f"{path}: corrupt record at line {lineno}: not a typed JSON object")
        kind = rec["t"]
        if current is None or kind == "header":
            if current is not None and not current.ended:
                raise TraceFormatError(f"{path}: line {lineno}: a second header record before the end record "
                                       "of the trace above it")
            if current is None:
                _check_header(path, rec)
            else:
                try:
                    _check_header(path, rec)
                except TraceFormatError as exc:
                    reason = str(exc).split(": ", 1)[-1]
                    raise TraceFormatError(f"{path}: line {lineno}: bad header of a later trace ({reason})") from None
            if len(segments) >= MAX_SEGMENTS:
                raise TraceFormatError(f"{path}: more than {MAX_SEGMENTS:,} traces in one file (line {lineno}): "
                                       "not a file gradtrace reads; runs that trace more steps write one file per "
                                       "step (per_step_files=True, --per-step-files)")
            number = rec.get("step")
            keep = all_steps or (not found and (step is None or number == step))
            found = found or keep
            current = _Segment(StepInfo(number, lineno), keep) if keep else \
                _Segment(StepInfo(number, lineno), keep, _COUNTED)
            if keep:
                current.trace.header = {k: v for k, v in rec.items() if k != "t"}
            segments.append(current)
            continue
        try:
            _apply(current, kind, rec)
        except TraceFormatError as exc:
            raise TraceFormatError(f"{path}: line {lineno}: {exc}") from None
    if not segments:
        raise TraceFormatError(f"{path}: empty file, not a gradtrace trace")
    infos = [s.info for s in segments]
    if step is not None and not found:
        held = ", ".join(str(s.step) for s in infos if s.step is not None)
        raise TraceFormatError(f"{path}: no step {step} in this file "
                               f"({'steps: ' + held if held else 'it holds no step numbers'})")
    kept = [_finish(path, s) for s in segments if s.keep]
    for t in kept:
        _note_steps(t, [s.step for s in infos])
    return kept, infos


def _apply(seg: _Segment, kind: str, rec: dict[str, Any]) -> None:
    """Validate one record, count it in its segment's facts, and keep it if the segment is kept."""
    trace, info, keep = seg.trace, seg.info, seg.keep
    if kind == "call":
        call = Call.from_json(rec)
        info.calls += 1
        if keep:
            trace.calls.append(call)
    elif kind == "node":
        node = GradNode.from_json(rec)
        if keep:
            trace.grad_nodes.append(node)
    elif kind == "tensor":
        t = TensorRecord.from_json(rec)
        info.tensors += 1
        if t.stats is not None and not t.stats.finite:
            info.nonfinite += 1
        if keep:
            trace.tensors[t.name] = t
    elif kind == "backward":
        run = BackwardRun.from_json(rec)
        if keep:
            trace.backward_runs.append(run)
    elif kind == "frame":
        fid = _id(rec, "frame")
        frame = Frame(_text(rec, "file", "?"), _count(rec, "line"), _text(rec, "function", "?"), _text(rec, "code", ""))
        if keep:
            seg.frames[fid] = frame
    elif kind == "stack":
        sid = _id(rec, "stack")
        fids = rec.get("frames")
        if not isinstance(fids, list) or not all(_is_id(f) for f in fids):
            raise TraceFormatError(f"stack {sid}: 'frames' must be a list of frame ids")
        if keep:
            seg.stacks[sid] = tuple(fids)
    elif kind == "module":
        path, cls = _text(rec, "path", None), _text(rec, "class", None)
        if path.count(".") >= MAX_MODULE_DEPTH:
            raise TraceFormatError(f"module record: 'path' is a module path of more than {MAX_MODULE_DEPTH} levels")
        if keep:
            trace.modules[path] = cls
    elif kind == "meta":
        if not depth_within(rec):
            raise TraceFormatError(f"meta record nested more than {MAX_DEPTH} levels deep")
        if keep:
            trace.meta.update({k: v for k, v in rec.items() if k != "t"})
    elif kind == "end":
        _apply_end(seg, rec)
    elif kind == "memory":
        event = _memory_event(rec)
        if keep:
            trace.memory.append(event)
    # Unknown record types from the same major version are skipped: readers stay forward
    # compatible with additive changes, which is what a version bump is reserved against.


def _apply_end(seg: _Segment, rec: dict[str, Any]) -> None:
    status = rec.get("status", "ok")
    if status not in TRACE_STATUSES:
        raise TraceFormatError(f"end record: 'status' must be one of {', '.join(TRACE_STATUSES)}")
    err = rec.get("error")
    if err is not None and not (isinstance(err, dict)
                                and all(v is None or isinstance(v, str) for v in err.values())):
        raise TraceFormatError("end record: 'error' must be an object of strings or null")
    notes = rec.get("notes") or []
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise TraceFormatError("end record: 'notes' must be a list of strings")
    error = {str(k): v for k, v in err.items() if v is not None} if err is not None else None
    seg.ended = True
    seg.info.status, seg.info.error = str(status), error
    if seg.keep:
        seg.trace.status, seg.trace.error, seg.trace.notes = str(status), error, list(notes)


_MEMORY_FIELDS: dict[str, str] = {
    "seq": "count", "bytes": "count", "addr": "opt_count", "allocated_after": "opt_count",
    "reserved_after": "opt_count", "requested": "opt_count", "device": "str", "owner": "opt_str",
    "tensor": "opt_str", "source": "str", "after": "bool", "action": "action", "phase": "phase",
}
_MEMORY_ACTIONS = ("alloc", "free", "start", "end")
# Every event gradtrace has written carries these (markers too; "source" and "requested" are the
# markers' own): the memory views read them without a default.
_MEMORY_REQUIRED = ("seq", "action", "bytes", "device", "addr", "allocated_after", "reserved_after", "owner",
                    "after", "phase", "tensor")


def _memory_event(rec: dict[str, Any]) -> MemoryEvent:
    out: dict[str, Any] = {}
    for key, kind in _MEMORY_FIELDS.items():
        if key not in rec:
            continue
        v = rec[key]
        ok = {"count": _is_id(v), "opt_count": v is None or _is_id(v), "str": isinstance(v, str),
              "opt_str": v is None or isinstance(v, str), "bool": isinstance(v, bool),
              "action": v in _MEMORY_ACTIONS, "phase": v in PHASES}[kind]
        if not ok:
            raise TraceFormatError(f"memory record: {key!r} has a value of the wrong type or range")
        out[key] = v
    missing = [key for key in _MEMORY_REQUIRED if key not in out]
    if missing:
        raise TraceFormatError(f"memory record is missing {', '.join(missing)}")
    return cast(MemoryEvent, out)


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


def _id(rec: dict[str, Any], what: str) -> int:
    v = rec.get("id")
    if not _is_id(v):
        raise TraceFormatError(f"{what} record: 'id' must be an integer from 0 to 2**63-1")
    return cast(int, v)


def _count(rec: dict[str, Any], key: str) -> int:
    v = rec.get(key, 0)
    if not _is_id(v):
        raise TraceFormatError(f"{rec['t']} record: {key!r} must be an integer from 0 to 2**63-1")
    return cast(int, v)


def _text(rec: dict[str, Any], key: str, default: str | None) -> str:
    v = rec.get(key, default)
    if not isinstance(v, str):
        raise TraceFormatError(f"{rec['t']} record: {key!r} must be a string")
    return v


def _finish(path: str, seg: _Segment) -> Trace:
    trace = seg.trace
    trace.frames = _table(path, seg.frames, "frame", lambda: Frame("?", 0, "?", ""))
    trace.stacks = _table(path, seg.stacks, "stack", tuple)
    for sid, fids in seg.stacks.items():
        for fid in fids:
            if fid not in seg.frames:
                raise TraceFormatError(f"{path}: stack {sid} refers to missing frame {fid}")
    if not seg.ended:
        trace.status = "truncated"
        warnings.warn(f"{path}: trace ends before its end record (recording was cut off); "
                      f"loaded {len(trace.calls)} calls that were written", TruncatedTraceWarning, stacklevel=5)
    trace.calls.sort(key=lambda c: c.seq)
    trace.grad_nodes.sort(key=lambda n: n.seq)
    trace.backward_runs.sort(key=lambda b: b.seq)
    try:
        check_structure(trace, complete=seg.ended)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{path}: {exc}") from None
    if trace.header.get("version", SCHEMA_VERSION) < 3:  # two phases then: the optimizer's is derived
        upgrade_phases(trace)
    trace.resolve()
    return trace


def _table(path: str, by_id: dict[int, Any], what: str, missing: Any) -> list[Any]:
    # Ids count from 0 in the order things were first seen, so they index a table of that many
    # entries. An id far past the records there are would make a table of millions of empty
    # entries from one line of the file: it is refused, not allocated.
    span = max(by_id) + 1 if by_id else 0
    if span > 2 * len(by_id) + 1024:
        raise TraceFormatError(f"{path}: {what} id {span - 1} in a file of {len(by_id)} {what} records "
                               f"({what} ids count from 0)")
    return [by_id[i] if i in by_id else missing() for i in range(span)]


def _note_steps(trace: Trace, steps: list[int | None]) -> None:
    # The step list is the reader's finding, never the file's claim.
    trace.meta.pop("steps_in_file", None)
    if any(s is not None for s in steps):
        trace.meta["steps_in_file"] = list(steps)


# ---- the public readers -------------------------------------------------------------------------------
def load(path: str | os.PathLike[str], step: int | None = None, *, max_decompressed: int | None = None) -> Trace:
    """Load a trace file. Raises ``TraceFormatError`` with a one-line reason if it can't.

    A file of several traced steps gives its first step, or step ``step``; the step numbers the
    file holds are then in ``meta["steps_in_file"]``. ``max_decompressed`` bounds what a gzip
    file may decompress to (default: ``GRADTRACE_MAX_DECOMPRESSED`` or 4 GiB).
    """
    kept, _ = read_trace(path, step, max_decompressed=max_decompressed)
    return kept[0]


def load_steps(path: str | os.PathLike[str], *, max_decompressed: int | None = None) -> dict[int, Trace]:
    """Every step of a multi-step trace file, by step number, in file order.

    Raises ``TraceFormatError`` for a file whose traces carry no step number (a plain trace:
    use ``load``). Where a step number occurs twice the first segment is kept.
    """
    path = os.fspath(path)
    kept, infos = read_trace(path, all_steps=True, max_decompressed=max_decompressed)
    out: dict[int, Trace] = {}
    for info, t in zip(infos, kept, strict=True):
        if info.step is None:
            where = f"the trace at line {info.line}" if len(infos) > 1 else "this trace"
            raise TraceFormatError(f"{path}: {where} has no step number (not a file of traced steps; "
                                   "use tracer.load)")
        out.setdefault(info.step, t)
    return out


__all__ = ["DEFAULT_MAX_DECOMPRESSED", "ENV_MAX_DECOMPRESSED", "MAX_RECORD_BYTES", "StepInfo",
           "TruncatedTraceWarning", "default_max_decompressed", "load", "load_steps", "parse_size", "read_trace"]
