"""``Trace``: one recorded block (usually a training step), its records linked by unified names."""

from __future__ import annotations

import difflib
import html
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracer.model.display import plural
from tracer.model.names import KINDS, qualified, split_qualified
from tracer.model.records import (
    FORMAT,
    SCHEMA_VERSION,
    BackwardRun,
    Call,
    Frame,
    GradNode,
    MemoryEvent,
    NodeRun,
    Record,
    TensorRecord,
)
from tracer.model.writer import memory_record, meta_record, module_record, stack_record, write_trace

if TYPE_CHECKING:
    from tracer.analysis.numerics import NumericsReport


class _Views:
    """Views of a trace that live in upper layers and plug themselves in when imported, so that
    the data model imports nothing above it: the numerics analysis (``tracer.analysis``, which
    ``import tracer`` always loads) and the notebook view (``export``)."""

    anomalies: Callable[[Trace], NumericsReport] | None = None
    notebook: Callable[[Trace], str] | None = None


_views = _Views()


def install_view(name: str, fn: Callable[..., Any]) -> None:
    """Plug in ``Trace.anomalies`` (``"anomalies"``) or ``Trace._repr_html_`` (``"notebook"``)."""
    if name not in ("anomalies", "notebook"):
        raise ValueError(f"unknown trace view {name!r}")
    setattr(_views, name, fn)


def ambiguity(name: str, kinds: list[str]) -> str:
    """What to say of a bare name that several kinds share: which, and how to spell each."""
    each = [f"a {KINDS[k]}" for k in kinds]
    what = f"{', '.join(each[:-1])} and {each[-1]}"
    spellings = ", ".join(qualified(k, name) for k in kinds)
    return f"{name!r} names {what} in this trace: say which one, {spellings}"


@dataclass(slots=True)
class Trace:
    """A recorded step: calls, grad nodes, tensors and backward runs, linked by unified names.

    ``header`` holds what makes two traces comparable (format version, hash algorithm, torch
    version, settings); ``meta`` holds what does not (host, time, paths, argv) and is ignored by
    ``diff``. ``status`` is ``ok``, ``failed`` (the traced block raised: ``error`` says what) or
    ``truncated`` (the file ended before its end record).
    """

    header: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    grad_nodes: list[GradNode] = field(default_factory=list)
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    backward_runs: list[BackwardRun] = field(default_factory=list)
    modules: dict[str, str] = field(default_factory=dict)
    frames: list[Frame] = field(default_factory=list)
    stacks: list[tuple[int, ...]] = field(default_factory=list)
    status: str = "ok"
    error: dict[str, str] | None = None
    notes: list[str] = field(default_factory=list)
    # Allocation/free events of a memory record (``trace(memory=True)``).
    memory: list[MemoryEvent] = field(default_factory=list)
    _index: dict[str, Record] | None = field(default=None, compare=False, repr=False)
    # The numerics report, computed once per state of the trace (the sizes of its lists and the
    # number of tensors with stats: a live trace grows, its stats arrive at the end).
    _anomalies: tuple[tuple[int, ...], NumericsReport] | None = field(default=None, compare=False, repr=False)
    _kind_index: dict[str, dict[str, Record]] | None = field(default=None, compare=False, repr=False)

    # ---- look-up -------------------------------------------------------------------------
    # Names are unique within a kind (calls, tensors, grad nodes, backward runs), not across
    # kinds: ``kind:name`` (``call:linear0``, ``tensor:linear0``) always names one record, and a
    # bare name that several kinds share is refused with those spellings (tracer.model.names).
    @property
    def index(self) -> dict[str, Record]:
        """Name -> record for all four kinds; where kinds share a name, the call, else the
        backward run, else the grad node (``t[name]`` refuses such a name instead)."""
        if self._index is None:
            idx: dict[str, Record] = {}
            records: list[Record] = [*self.tensors.values(), *self.grad_nodes, *self.backward_runs, *self.calls]
            for rec in records:
                idx[rec.name] = rec
            self._index = idx
        return self._index

    def _table(self, kind: str) -> dict[str, Record]:
        """The records of one kind (``names.KINDS``) by name."""
        if kind == "tensor":
            return self.tensors  # type: ignore[return-value]
        if self._kind_index is None:
            self._kind_index = {
                "call": {c.name: c for c in self.calls},
                "node": {n.name: n for n in self.grad_nodes},
                "backward": {b.name: b for b in self.backward_runs},
            }
        return self._kind_index[kind]

    def kinds_of(self, name: str) -> list[str]:
        """The kinds (``call``, ``tensor``, ``node``, ``backward``) that have a record of this bare
        name: more than one when it needs a qualified spelling."""
        return [k for k in KINDS if name in self._table(k)]

    def __getitem__(self, name: str) -> Record:
        kind, bare = split_qualified(name)
        if kind is not None:
            rec = self._table(kind).get(bare)
            if rec is not None:
                return rec
            if name in self.index:  # (a tensor whose own name starts so: a module attribute "call:x")
                return self.index[name]
            close = [qualified(kind, n) for n in difflib.get_close_matches(bare, list(self._table(kind)), n=5, cutoff=0.6)]
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise KeyError(f"no {KINDS[kind]} named {bare!r} in this trace{hint}")
        kinds = self.kinds_of(name)
        if len(kinds) > 1:
            raise KeyError(ambiguity(name, kinds))
        if kinds:
            return self._table(kinds[0])[name]
        close = difflib.get_close_matches(name, list(self.index), n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"no call, tensor, grad node or backward run named {name!r} in this trace{hint}")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def get(self, name: str) -> Record | None:
        """The record of that name, None where there is none: never raises. A bare name that
        several kinds share gives the call, else the backward run, else the grad node (links
        name producers: calls, nodes, runs); a qualified name (``tensor:linear0``) that one."""
        kind, bare = split_qualified(name)
        if kind is not None:
            rec = self._table(kind).get(bare)
            if rec is not None:
                return rec
        return self.index.get(name)

    @property
    def anomalies(self) -> NumericsReport:
        """The story of the step's NaN/Inf (``tracer.analysis.numerics.find_anomalies``), computed
        once: every surface renders this one report."""
        if _views.anomalies is None:
            raise RuntimeError("tracer.analysis.numerics is not imported: `import tracer` installs it")
        key = (len(self.calls), len(self.tensors), len(self.grad_nodes), len(self.backward_runs),
               sum(1 for r in self.tensors.values() if r.stats is not None), len(self.frames))
        if self._anomalies is None or self._anomalies[0] != key:
            self._anomalies = (key, _views.anomalies(self))
        return self._anomalies[1]

    @property
    def hash_algorithm(self) -> str:
        return str(self.header.get("hash", "none"))

    def stack_of(self, stack_id: int | None) -> tuple[Frame, ...]:
        if stack_id is None or stack_id >= len(self.stacks):
            return ()
        return tuple(self.frames[i] for i in self.stacks[stack_id])

    def tensors_in_order(self) -> list[TensorRecord]:
        return sorted(self.tensors.values(), key=lambda t: t.seq)

    def invalidate(self) -> None:
        """Drop cached look-ups after the lists were changed."""
        self._index = None
        self._anomalies = None
        self._kind_index = None

    def resolve(self) -> None:
        """Attach stacks and per-node gradient names to records (after load or recording)."""
        # One tuple per distinct stack, shared by every record made at that line: a step has
        # thousands of records and a few hundred distinct stacks.
        stacks: dict[int | None, tuple[Frame, ...]] = {}

        def stack(stack_id: int | None) -> tuple[Frame, ...]:
            hit = stacks.get(stack_id)
            if hit is None:
                hit = stacks[stack_id] = self.stack_of(stack_id)
            return hit

        for c in self.calls:
            c.stack = stack(c.stack_id)
        for b in self.backward_runs:
            b.stack = stack(b.stack_id)
        by_name = {n.name: n for n in self.grad_nodes}
        last: dict[str, NodeRun] = {}
        for b in self.backward_runs:
            for s in b.steps:
                if s.node in by_name:  # the last run that executed a node wins
                    last[s.node] = s
        for n in self.grad_nodes:
            n.stack = stack(n.stack_id)
            run = last.get(n.name) if by_name[n.name] is n else None
            if run is None:
                n.grads_in, n.grads_out = [], []
            else:
                n.grads_in, n.grads_out = list(run.grads_in), list(run.grads_out)
        self.invalidate()

    # ---- records -------------------------------------------------------------------------
    def header_record(self) -> dict[str, Any]:
        return {"t": "header", "format": FORMAT, "version": SCHEMA_VERSION, **{
            k: v for k, v in self.header.items() if k not in ("t", "format", "version")}}

    def end_record(self) -> dict[str, Any]:
        return {"t": "end", "status": self.status, "error": self.error, "notes": self.notes,
                "counts": {"calls": len(self.calls), "grad_nodes": len(self.grad_nodes),
                           "tensors": len(self.tensors), "backward_runs": len(self.backward_runs)}}

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record of the trace in canonical order (what ``save`` writes)."""
        yield self.header_record()
        yield meta_record(self.meta)
        for i, f in enumerate(self.frames):
            yield f.to_json(i)
        for i, s in enumerate(self.stacks):
            yield stack_record(i, s)
        for path, cls in self.modules.items():
            yield module_record(path, cls)
        for t in self.tensors_in_order():
            yield t.to_json()
        for c in self.calls:
            yield c.to_json()
        for n in self.grad_nodes:
            yield n.to_json()
        for b in self.backward_runs:
            yield b.to_json()
        for m in self.memory:
            yield memory_record(m)
        yield self.end_record()

    def save(self, path: str) -> None:
        """Write the whole trace as JSON lines (gzip when the path ends in ``.gz``)."""
        write_trace(self.records(), path)

    # ---- display -------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"<Trace {self.status}: {plural(len(self.calls), 'call')}, {plural(len(self.grad_nodes), 'grad node')}, "
                f"{plural(len(self.tensors), 'tensor')}, {plural(len(self.backward_runs), 'backward run')}, "
                f"hash={self.hash_algorithm}>")

    def _repr_html_(self) -> str:
        """The notebook view: the one ``export`` installs (``import export``), else the repr."""
        if _views.notebook is not None:
            return _views.notebook(self)
        return f"<pre>{html.escape(repr(self))}</pre>"
