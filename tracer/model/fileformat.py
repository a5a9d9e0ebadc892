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
returns them all.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import warnings
from typing import Any, cast

from tracer.model.records import (
    FORMAT,
    SCHEMA_VERSION,
    BackwardRun,
    Call,
    Frame,
    GradNode,
    MemoryEvent,
    TensorRecord,
    TraceFormatError,
)
from tracer.model.trace import Trace
from tracer.model.writer import GZIP_MAGIC


class TruncatedTraceWarning(UserWarning):
    """The trace file ended before its end record; what was written is returned."""


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceFormatError(f"{path}: is a directory, not a trace file") from None
    if head == GZIP_MAGIC:
        try:
            with gzip.open(path, "rb") as gz:
                raw = gz.read()
        except EOFError:  # a gzip stream cut short: keep what decompressed
            raw = _read_partial_gzip(path)
        except (OSError, gzip.BadGzipFile) as exc:
            raise TraceFormatError(f"{path}: corrupt gzip data ({exc})") from None
    else:
        with open(path, "rb") as fh:
            raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceFormatError(f"{path}: not a gradtrace file (not UTF-8 text)") from None
    return text.split("\n")


def _read_partial_gzip(path: str) -> bytes:
    out = bytearray()
    with gzip.open(path, "rb") as gz:
        try:
            while chunk := gz.read(1 << 16):
                out += chunk
        except EOFError:
            pass
    return bytes(out)


def _parse_constant(name: str) -> float:
    # JSON's NaN/Infinity extension, used by stats; anything else stays refused.
    return float(name)


def load(path: str | os.PathLike[str], step: int | None = None) -> Trace:
    """Load a trace file. Raises ``TraceFormatError`` with a one-line reason if it can't.

    A file of several traced steps gives its first step, or step ``step``; the step numbers the
    file holds are then in ``meta["steps_in_file"]``.
    """
    path = os.fspath(path)
    lines = _read_lines(path)
    segments = _segments(path, lines)
    steps = [h.get("step") if h is not None else None for _, _, h in segments]
    index = 0
    if step is not None:
        matches = [i for i, s in enumerate(steps) if s == step]
        if not matches:
            held = ", ".join(str(s) for s in steps if s is not None)
            raise TraceFormatError(f"{path}: no step {step} in this file "
                                   f"({'steps: ' + held if held else 'it holds no step numbers'})")
        index = matches[0]
    trace = _load_segment(path, lines, segments, index)
    _note_steps(trace, steps)
    return trace


def load_steps(path: str | os.PathLike[str]) -> dict[int, Trace]:
    """Every step of a multi-step trace file, by step number, in file order.

    Raises ``TraceFormatError`` for a file whose traces carry no step number (a plain trace:
    use ``load``). Where a step number occurs twice the first segment is kept.
    """
    path = os.fspath(path)
    lines = _read_lines(path)
    segments = _segments(path, lines)
    steps = [h.get("step") if h is not None else None for _, _, h in segments]
    out: dict[int, Trace] = {}
    for i, s in enumerate(steps):
        if not isinstance(s, int) or isinstance(s, bool):
            where = f"the trace at line {segments[i][0] + 1}" if len(segments) > 1 else "this trace"
            raise TraceFormatError(f"{path}: {where} has no step number (not a file of traced steps; "
                                   "use tracer.load)")
        if s not in out:
            out[s] = _load_segment(path, lines, segments, i)
            _note_steps(out[s], steps)
    return out


def _note_steps(trace: Trace, steps: list[Any]) -> None:
    if any(s is not None for s in steps):
        trace.meta["steps_in_file"] = list(steps)


# Where a new segment starts: a header record on a line of its own. The writer always puts the
# type first ('{"t":"header"'); the pattern also takes hand-written spacing.
_HEADER_LINE = re.compile(r'\s*\{\s*"t"\s*:\s*"header"')


def _segments(path: str, lines: list[str]) -> list[tuple[int, int, dict[str, Any] | None]]:
    """(first line, end line, header) of each trace in the file; the first header is parsed
    leniently here (``_load_segment`` reports its errors), the later ones strictly."""
    first = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    starts = [first] + [i for i in range(first + 1, len(lines)) if _HEADER_LINE.match(lines[i])]
    out: list[tuple[int, int, dict[str, Any] | None]] = []
    for k, start in enumerate(starts):
        stop = starts[k + 1] if k + 1 < len(starts) else len(lines)
        try:
            head = json.loads(lines[start], parse_constant=_parse_constant) if start < len(lines) else None
        except json.JSONDecodeError as exc:
            if k == 0:
                head = None
            elif start == len(lines) - 1:  # a header cut off mid-line by a crash: nothing follows it
                break
            else:
                raise TraceFormatError(f"{path}: corrupt record at line {start + 1}: {exc.msg}") from None
        if k > 0:
            try:
                _check_header(path, head if isinstance(head, dict) else {})
            except TraceFormatError as exc:
                reason = str(exc).split(": ", 1)[-1]
                raise TraceFormatError(f"{path}: line {start + 1}: bad header of a later trace ({reason})") from None
        out.append((start, stop, head if isinstance(head, dict) else None))
    return out


def _load_segment(path: str, lines: list[str], segments: list[tuple[int, int, dict[str, Any] | None]],
                  index: int) -> Trace:
    start, stop, _ = segments[index]
    # A final empty string after the last newline is normal; an unterminated last line means
    # the writer was cut off mid-record.
    trace = Trace()
    seen_header = False
    ended = False
    frames: dict[int, Frame] = {}
    stacks: dict[int, tuple[int, ...]] = {}
    last = len(lines) - 1
    for lineno in range(start + 1, stop + 1):
        line = lines[lineno - 1]
        if not line.strip():
            continue
        try:
            rec = json.loads(line, parse_constant=_parse_constant)
        except json.JSONDecodeError as exc:
            if lineno - 1 == last and seen_header:  # a cut-off last line: truncated, not corrupt
                break
            if not seen_header:
                raise TraceFormatError(f"{path}: not a gradtrace file (line 1 is not JSON)") from None
            raise TraceFormatError(f"{path}: corrupt record at line {lineno}: {exc.msg}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("t"), str):
            if not seen_header:
                raise TraceFormatError(f"{path}: not a gradtrace file (line 1 is not a gradtrace header)")
            raise TraceFormatError(f"{path}: corrupt record at line {lineno}: not a typed JSON object")
        kind = rec["t"]
        if not seen_header:
            _check_header(path, rec)
            trace.header = {k: v for k, v in rec.items() if k != "t"}
            seen_header = True
            continue
        try:
            _apply(trace, kind, rec, frames, stacks)
        except TraceFormatError as exc:
            raise TraceFormatError(f"{path}: line {lineno}: {exc}") from None
        except (TypeError, ValueError, KeyError) as exc:
            raise TraceFormatError(f"{path}: line {lineno}: malformed {kind} record ({exc})") from None
        if kind == "end":
            ended = True
    if not seen_header:
        raise TraceFormatError(f"{path}: empty file, not a gradtrace trace")
    if not ended and index + 1 < len(segments):
        # Only a finished trace may be followed by another one.
        raise TraceFormatError(f"{path}: line {segments[index + 1][0] + 1}: a second header record "
                               "before the end record of the trace above it")
    trace.frames = [frames[i] if i in frames else Frame("?", 0, "?", "") for i in range(_span(frames))]
    trace.stacks = [stacks.get(i, ()) for i in range(_span(stacks))]
    for sid in stacks.values():
        for fid in sid:
            if fid >= len(trace.frames):
                raise TraceFormatError(f"{path}: stack refers to missing frame {fid}")
    if not ended:
        trace.status = "truncated"
        warnings.warn(f"{path}: trace ends before its end record (recording was cut off); "
                      f"loaded {len(trace.calls)} calls that were written", TruncatedTraceWarning, stacklevel=3)
    trace.calls.sort(key=lambda c: c.seq)
    trace.grad_nodes.sort(key=lambda n: n.seq)
    trace.backward_runs.sort(key=lambda b: b.seq)
    trace.resolve()
    return trace


def _span(d: dict[int, Any]) -> int:
    return max(d) + 1 if d else 0


def _check_header(path: str, rec: dict[str, Any]) -> None:
    if rec.get("t") != "header" or rec.get("format") != FORMAT:
        raise TraceFormatError(f"{path}: not a gradtrace file (no gradtrace header on line 1)")
    version = rec.get("version")
    if not isinstance(version, int):
        raise TraceFormatError(f"{path}: header has no integer format version")
    if version > SCHEMA_VERSION:
        raise TraceFormatError(f"{path}: trace format version {version} is newer than this gradtrace "
                               f"reads (version {SCHEMA_VERSION}); upgrade gradtrace")
    if version < 1:
        raise TraceFormatError(f"{path}: unknown trace format version {version} (this gradtrace reads "
                               f"version {SCHEMA_VERSION})")


def _apply(trace: Trace, kind: str, rec: dict[str, Any], frames: dict[int, Frame],
           stacks: dict[int, tuple[int, ...]]) -> None:
    if kind == "call":
        trace.calls.append(Call.from_json(rec))
    elif kind == "node":
        trace.grad_nodes.append(GradNode.from_json(rec))
    elif kind == "tensor":
        t = TensorRecord.from_json(rec)
        trace.tensors[t.name] = t
    elif kind == "backward":
        trace.backward_runs.append(BackwardRun.from_json(rec))
    elif kind == "frame":
        fid = rec["id"]
        if not isinstance(fid, int) or fid < 0 or fid > 10_000_000:
            raise TraceFormatError(f"bad frame id {fid!r}")
        frames[fid] = Frame(str(rec.get("file", "?")), int(rec.get("line", 0)),
                            str(rec.get("function", "?")), str(rec.get("code", "")))
    elif kind == "stack":
        sid, fids = rec["id"], rec["frames"]
        if not isinstance(sid, int) or sid < 0 or sid > 10_000_000 or not isinstance(fids, list) \
                or not all(isinstance(f, int) and f >= 0 for f in fids):
            raise TraceFormatError(f"bad stack record {sid!r}")
        stacks[sid] = tuple(fids)
    elif kind == "module":
        trace.modules[str(rec["path"])] = str(rec["class"])
    elif kind == "meta":
        trace.meta.update({k: v for k, v in rec.items() if k != "t"})
    elif kind == "end":
        trace.status = str(rec.get("status", "ok"))
        err = rec.get("error")
        trace.error = {str(k): str(v) for k, v in err.items()} if isinstance(err, dict) else None
        notes = rec.get("notes") or []
        trace.notes = [str(n) for n in notes] if isinstance(notes, list) else []
    elif kind == "memory":
        trace.memory.append(cast(MemoryEvent, {k: v for k, v in rec.items() if k != "t"}))
    elif kind == "header":
        raise TraceFormatError("a second header record")
    # Unknown record types from the same major version are skipped: readers stay forward
    # compatible with additive changes, which is what a version bump is reserved against.
