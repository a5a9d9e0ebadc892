"""The step log (``.gtsteps``): a few facts per optimizer step of a whole run, to find where two
runs part (``gradtrace bisect``). This module is its data model and its reader; the recording
side is ``tracer.features.steplog``. Pure data: nothing here imports torch.

A log is JSON lines, appended one record at a time (``docs/trace-format.md``, "The step log"):

- ``steplog``: the first line; the format version, the fingerprint algorithm, and ``meta`` (the
  program's command line and working directory, what wrote the log, the host and the time);
- ``layout``: the parameters one optimizer steps, in execution order (the order in which their
  modules were first called), with their shapes and dtypes; every later ``step`` of that
  optimizer lists its tensors in this order;
- ``step``: one optimizer step: the losses backward started from, a digest of the batch (the
  tensors given to the outermost module calls of the step), digests of the random number
  generators, the learning rates and a digest of the other hyperparameters, and a fingerprint
  and an L2 norm of every parameter (as the optimizer step begins) and of every gradient the
  optimizer read;
- ``final``: the parameters after the last step (written when the log is closed);
- ``end``: the log was closed (a log without it was cut short: the program failed or was killed).

A log is untrusted input, like a trace: every line is parsed as JSON (no pickle, nothing
executed) and checked by type, length and range; a line holds at most ``MAX_LINE_BYTES``. A last
line without its newline (the writer was killed mid-line) is dropped: the last complete step is
kept. Anything else that is wrong is a ``StepLogFormatError`` (a ``TraceFormatError``) naming
the line. Reading streams the file (``StepLogReader``), so comparing two long logs holds one step
of each at a time.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, Any

from tracer.model.fileformat import depth_within
from tracer.model.records import MAX_DIMS, MAX_INT, TraceFormatError

STEPLOG_FORMAT = "gradtrace-steps"
STEPLOG_VERSION = 1
SUFFIX = ".gtsteps"
FP_CHARS = 16  # one fingerprint: 64 bits as hexadecimal digits
NO_GRAD = "-" * FP_CHARS  # no fingerprint: a parameter without a gradient, or a tensor without plain bytes here
# Limits on what a reader accepts (far above real logs: a step of a model with 100,000 parameter
# tensors is about 5 MB).
MAX_LINE_BYTES = 64 << 20
MAX_PARAMS = 1 << 20
MAX_NAME = 4096
MAX_LIST = 1 << 16  # losses, learning rates, batch tensors of one step
MAX_META_DEPTH = 16
_HEX = re.compile(r"[0-9a-f]*")
_FINGERPRINTS = re.compile(r"(?:[0-9a-f]{16}|-{16})*")


class StepLogFormatError(TraceFormatError):
    """A step log that cannot be read: corrupt, foreign, or from a newer version."""


@dataclass(frozen=True)
class LogParam:
    """One parameter tensor of a layout."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Layout:
    """The parameters optimizer ``opt`` steps, in execution order."""

    opt: int
    params: list[LogParam]

    def to_json(self) -> dict[str, Any]:
        return {"t": "layout", "opt": self.opt, "params": [[p.name, list(p.shape), p.dtype] for p in self.params]}


@dataclass
class StepEntry:
    """One optimizer step of a log. Tensor facts are lists in the order of ``layout.params``;
    a number that was not finite is ``nan``/``inf``/``-inf``."""

    step: int
    opt: int
    layout: Layout
    loss: list[float]  # the scalar each backward of the step started from, exactly (as float64)
    backward: int  # backward passes in the step (micro-batches)
    forward: int  # outermost module calls in the step
    batch: str | None  # digest of the tensors given to the outermost module calls (None: no call)
    batch_tensors: int
    rng: dict[str, str]  # generator -> digest of its state as the step's first forward began
    lr: list[float | None]  # per param group (None: not a number)
    hyper: str  # digest of the param groups' other hyperparameters
    params: list[str | None]  # fingerprints as the optimizer step begins (None: no plain bytes here)
    grads: list[str | None]  # fingerprints of the gradients the optimizer read (None: no gradient)
    param_norms: list[float | None]
    grad_norms: list[float | None]

    def to_json(self) -> dict[str, Any]:
        return {"t": "step", "step": self.step, "opt": self.opt, "loss": self.loss, "backward": self.backward,
                "forward": self.forward, "batch": self.batch, "batch_tensors": self.batch_tensors, "rng": self.rng,
                "lr": self.lr, "hyper": self.hyper, "params": _joined(self.params),
                "grads": _joined(self.grads),
                "param_norms": self.param_norms, "grad_norms": self.grad_norms}


@dataclass
class Final:
    """The parameters of optimizer ``opt`` when the log was closed (after the last step)."""

    opt: int
    layout: Layout
    params: list[str | None]
    param_norms: list[float | None]

    def to_json(self) -> dict[str, Any]:
        return {"t": "final", "opt": self.opt, "params": _joined(self.params), "param_norms": self.param_norms}


def _joined(fingerprints: list[str | None]) -> str:
    return "".join(NO_GRAD if f is None else f for f in fingerprints)


@dataclass
class StepLog:
    """A whole log in memory (``read_steplog``); ``StepLogReader`` streams one instead."""

    path: str
    version: int
    fingerprint: str
    meta: dict[str, Any]
    steps: list[StepEntry] = field(default_factory=list)
    layouts: dict[int, Layout] = field(default_factory=dict)
    finals: dict[int, Final] = field(default_factory=dict)
    ended: bool = False  # the writer closed it (an ``end`` record)
    truncated: bool = False  # its last line was cut off mid-record (dropped)


def header_json(fingerprint: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The first record of a log."""
    return {"t": "steplog", "format": STEPLOG_FORMAT, "version": STEPLOG_VERSION, "fingerprint": fingerprint,
            "meta": meta}


def encode(record: dict[str, Any]) -> bytes:
    """One record as its line (non-finite floats as JSON's NaN/Infinity extension)."""
    return (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")


# ---- reading --------------------------------------------------------------------------------------
def _parse_constant(name: str) -> float:
    return float(name)  # NaN, Infinity, -Infinity: a loss or a norm that was not finite


_DECODER = json.JSONDecoder(parse_constant=_parse_constant)


class StepLogReader:
    """Reads a log one record at a time: ``header`` at once, then iterating gives its steps
    (``StepEntry``, layouts attached); ``finals``, ``ended`` and ``truncated`` are known once the
    iteration is over. Use it as a context manager (it holds the file open)."""

    def __init__(self, path: str | os.PathLike[str], *, max_line: int = MAX_LINE_BYTES) -> None:
        self.path = os.fspath(path)
        self.max_line = max_line
        self.layouts: dict[int, Layout] = {}
        self.finals: dict[int, Final] = {}
        self.ended = False
        self.truncated = False
        self.line = 0
        self._fh: IO[bytes] = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        try:
            first = self._next_record()
            if first is None:
                raise self._error("empty file: not a step log")
            self.version, self.fingerprint, self.meta = _header(first, self)
        except BaseException:
            self._fh.close()
            raise

    def __enter__(self) -> StepLogReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._fh.close()

    def _error(self, why: str) -> StepLogFormatError:
        where = f" (line {self.line})" if self.line else ""
        return StepLogFormatError(f"{self.path}{where}: {why}")

    def _next_record(self) -> dict[str, Any] | None:
        """The next record, or None at the end of the file (a cut-off last line included)."""
        while True:
            raw = self._fh.readline(self.max_line + 1)
            if not raw:
                return None
            self.line += 1
            if not raw.endswith(b"\n"):
                if len(raw) > self.max_line:
                    raise self._error(f"a line longer than {self.max_line:,} bytes")
                self.truncated = True  # the writer was killed mid-line: the last complete step is kept
                return None
            if not raw.strip():
                continue
            try:
                rec = _DECODER.decode(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise self._error("not UTF-8 text") from None
            except json.JSONDecodeError as exc:
                raise self._error(f"not JSON ({exc.msg} at column {exc.colno})") from None
            except (RecursionError, ValueError):
                raise self._error("not a JSON value a step log holds") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("t"), str):
                raise self._error("a record must be a JSON object with a string 't'")
            return rec

    def __iter__(self) -> Iterator[StepEntry]:
        while True:
            rec = self._next_record()
            if rec is None:
                return
            kind = rec["t"]
            if self.ended:
                raise self._error(f"a {kind[:40]!r} record after the end record")
            if kind == "step":
                yield _step(rec, self)
            elif kind == "layout":
                layout = _layout(rec, self)
                self.layouts[layout.opt] = layout
            elif kind == "final":
                final = _final(rec, self)
                self.finals[final.opt] = final
            elif kind == "end":
                self.ended = True
            elif kind == "steplog":
                raise self._error("a second header: two logs in one file")
            # Records of a type this version does not know are skipped (docs/trace-format.md).


def read_steplog(path: str | os.PathLike[str]) -> StepLog:
    """The whole log at ``path`` (``StepLogFormatError`` when it is not a readable step log)."""
    with StepLogReader(path) as r:
        steps = list(r)
        return StepLog(r.path, r.version, r.fingerprint, r.meta, steps, dict(r.layouts), dict(r.finals), r.ended,
                       r.truncated)


# ---- validation (a log is untrusted input) ---------------------------------------------------------
def _header(rec: dict[str, Any], r: StepLogReader) -> tuple[int, str, dict[str, Any]]:
    if rec.get("t") != "steplog" or rec.get("format") != STEPLOG_FORMAT:
        raise r._error("not a gradtrace step log (no steplog header; a .gtrace is read by the other commands)")
    version = rec.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise r._error(f"bad step log version {str(version)[:20]!r}")
    if version > STEPLOG_VERSION:
        raise r._error(f"step log format version {version} is newer than this gradtrace reads "
                       f"(version {STEPLOG_VERSION}); upgrade gradtrace")
    fingerprint = rec.get("fingerprint")
    if not isinstance(fingerprint, str) or len(fingerprint) > 64:
        raise r._error("the header's 'fingerprint' must name an algorithm")
    meta = rec.get("meta", {})
    if not isinstance(meta, dict) or not depth_within(meta, MAX_META_DEPTH):
        raise r._error(f"the header's 'meta' must be an object nested at most {MAX_META_DEPTH} levels")
    return version, fingerprint, meta


def _layout(rec: dict[str, Any], r: StepLogReader) -> Layout:
    opt = _count(rec, "opt", r, limit=MAX_LIST)
    raw = rec.get("params")
    if not isinstance(raw, list) or len(raw) > MAX_PARAMS:
        raise r._error(f"layout: 'params' must be a list of at most {MAX_PARAMS:,} parameters")
    params = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and len(item[0]) <= MAX_NAME
                and isinstance(item[1], list) and len(item[1]) <= MAX_DIMS and all(_is_int(d) for d in item[1])
                and isinstance(item[2], str) and len(item[2]) <= 64):
            raise r._error("layout: each parameter must be [name, shape, dtype]")
        params.append(LogParam(item[0], tuple(item[1]), item[2]))
    return Layout(opt, params)


def _layout_of(rec: dict[str, Any], r: StepLogReader) -> Layout:
    opt = _count(rec, "opt", r, limit=MAX_LIST)
    layout = r.layouts.get(opt)
    if layout is None:
        raise r._error(f"a {rec['t']} record of optimizer {opt} before its layout")
    return layout


def _step(rec: dict[str, Any], r: StepLogReader) -> StepEntry:
    layout = _layout_of(rec, r)
    n = len(layout.params)
    batch = rec.get("batch")
    if batch is not None and not _is_digest(batch):
        raise r._error("step: 'batch' must be a digest (16 hexadecimal digits) or null")
    rng = rec.get("rng", {})
    if not (isinstance(rng, dict) and len(rng) <= 16
            and all(isinstance(k, str) and len(k) <= 64 and _is_digest(v) for k, v in rng.items())):
        raise r._error("step: 'rng' must map generator names to digests")
    hyper = rec.get("hyper", "")
    if not (hyper == "" or _is_digest(hyper)):
        raise r._error("step: 'hyper' must be a digest")
    return StepEntry(
        step=_count(rec, "step", r), opt=layout.opt, layout=layout, loss=_floats(rec, "loss", r),
        backward=_count(rec, "backward", r), forward=_count(rec, "forward", r), batch=batch,
        batch_tensors=_count(rec, "batch_tensors", r), rng=dict(rng), lr=_floats(rec, "lr", r, nullable=True),
        hyper=hyper, params=_fingerprints(rec, "params", n, r), grads=_fingerprints(rec, "grads", n, r),
        param_norms=_floats(rec, "param_norms", r, length=n, nullable=True),
        grad_norms=_floats(rec, "grad_norms", r, length=n, nullable=True))


def _final(rec: dict[str, Any], r: StepLogReader) -> Final:
    layout = _layout_of(rec, r)
    n = len(layout.params)
    return Final(layout.opt, layout, _fingerprints(rec, "params", n, r),
                 _floats(rec, "param_norms", r, length=n, nullable=True))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


def _is_digest(v: Any) -> bool:
    return isinstance(v, str) and len(v) == FP_CHARS and _HEX.fullmatch(v) is not None


def _count(rec: dict[str, Any], key: str, r: StepLogReader, limit: int = MAX_INT) -> int:
    v = rec.get(key, 0)
    if not _is_int(v) or v > limit:
        raise r._error(f"{rec['t']}: {key!r} must be an integer from 0 to {limit:,}")
    return int(v)


def _floats(rec: dict[str, Any], key: str, r: StepLogReader, *, length: int | None = None,
            nullable: bool = False) -> Any:
    v = rec.get(key, [])
    if not isinstance(v, list) or len(v) > (MAX_PARAMS if length is not None else MAX_LIST):
        raise r._error(f"{rec['t']}: {key!r} must be a list of numbers")
    if length is not None and len(v) != length:
        raise r._error(f"{rec['t']}: {key!r} holds {len(v):,} numbers for {length:,} parameters")
    for x in v:
        if not ((isinstance(x, int | float) and not isinstance(x, bool)) or (nullable and x is None)):
            raise r._error(f"{rec['t']}: {key!r} must be a list of numbers{' or nulls' if nullable else ''}")
    return [float(x) if x is not None else None for x in v]


def _fingerprints(rec: dict[str, Any], key: str, n: int, r: StepLogReader) -> list[str | None]:
    v = rec.get(key)
    if not isinstance(v, str) or len(v) != n * FP_CHARS or _FINGERPRINTS.fullmatch(v) is None:
        raise r._error(f"{rec['t']}: {key!r} must be {n:,} fingerprints of {FP_CHARS} hexadecimal digits (or "
                       f"{FP_CHARS} dashes: none)")
    return [None if p == NO_GRAD else p for p in (v[i:i + FP_CHARS] for i in range(0, len(v), FP_CHARS))]


__all__ = ["FP_CHARS", "NO_GRAD", "STEPLOG_FORMAT", "STEPLOG_VERSION", "SUFFIX", "Final", "Layout", "LogParam",
           "StepEntry", "StepLog", "StepLogFormatError", "StepLogReader", "encode", "header_json", "read_steplog"]
