"""What ``diff`` finds, as data: aligned rows, the divergence of each section (forward calls,
backward steps), the parameters compared by name, and the verdict. ``to_json()`` gives each as
strict JSON (non-finite numbers as strings); ``render(console)`` prints it (``export.diff.console``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from export.diff import reprs
from export.diff.console import differing_parts, render_diff, state_count, state_counts
from export.diff.elements import STATS_WORDS, ElementDiff, difference_text
from export.diff.rules import parted_earlier
from tracer.analysis.numerics import NumericsReport, find_anomalies
from tracer.model import Frame, Trace
from tracer.model.display import PHASE_ORDER, format_number, json_number, phase_key, plural, plural_verb

TOP_NAMED = 5  # parameters named in a verdict before "… N more"
# The statuses of the later records a section's verdict counts as contaminated: carried on from
# the origin, or a difference of their own after it (``Divergence.independent``).
LATER_DIFFERING = frozenset({"contaminated", "new"})


# ---- one tensor compared -----------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    rtol: float = 0.0
    atol: float = 0.0

    def __str__(self) -> str:
        return f"rtol={self.rtol:g} atol={self.atol:g}"


@dataclass(frozen=True)
class Compared:
    """One tensor of A against its counterpart in B.

    ``status`` is ``equal``, ``differ``, ``unknown`` (not recorded, or neither hash nor stats to
    judge by) or ``skipped`` (uninitialised memory: nothing to compare). ``abs``/``rel`` are the
    largest differences, and ``basis`` says of what: ``values`` (element-wise, both traces kept
    the values: ``elements`` has the details), ``stats`` (of min/max/mean/absmax only), or
    ``""`` (no number, or a shape or dtype mismatch). ``mismatch``: ``why`` is a shape or dtype
    mismatch; ``shapes_differ``: a shape mismatch, which no number measures (``abs``/``rel`` are
    None: two shapes are not infinitely far apart, and an ``inf`` would outrank every real
    difference in a table's largest).
    """

    status: str
    abs: float | None = None
    rel: float | None = None
    why: str = ""
    basis: str = ""
    elements: ElementDiff | None = None
    mismatch: bool = False
    shapes_differ: bool = False

    @property
    def checksum_only(self) -> bool:
        """It differs by checksum alone: every recorded stat is equal (a permutation, a change
        smaller than the stats round to)."""
        return self.status == "differ" and checksum_only(self.abs, self.basis)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "max_abs": json_number(self.abs), "max_rel": json_number(self.rel),
                "basis": self.basis or None, "difference": self.describe() or None,
                "elements": None if self.elements is None else self.elements.to_json(),
                "checksum_only": self.checksum_only}

    def describe(self) -> str:
        """The difference in words that say where it came from (``difference_text``); nothing
        for an equal tensor (its stats match, and its checksums, or they are within tolerance)."""
        if self.status == "equal":
            return ""
        if self.shapes_differ:  # no number: the shapes in words (``shape [2] vs [3]``)
            return self.why
        return difference_text(self.abs, self.rel, self.basis, self.elements)


# ---- result records ----------------------------------------------------------------------------
@dataclass
class Row:
    """One aligned record (a call or a backward step) of A and B.

    ``status``: ``equal``, ``origin`` (the first divergence), ``new`` (a later record whose inputs
    match but outputs differ: another place where a difference enters), ``contaminated``,
    ``gradient`` (differs only because it reads gradients), ``inserted`` (only in B), ``removed``
    (only in A), ``cast`` (a dtype conversion only one side made, compared with a tolerance),
    ``unknown`` (could not be compared). ``rule`` names the rule of ``export.diff.rules`` that
    gave the status and the note; ``phase`` is the call's ``Call.phase`` (``backward`` for a grad
    node's step); ``shapes``: the first output whose shape differs, in words (``shape [3, 3] vs
    [3, 5]``), which ``max_abs``/``max_rel`` do not measure; ``missing``: gradients a grad node
    makes on one side only, in words (``B makes no gradient for 0.bias (A does)``), which no
    number measures either.
    """

    a: str | None
    b: str | None
    module: str
    what: str
    status: str = "equal"
    max_abs: float | None = None
    max_rel: float | None = None
    note: str = ""
    # What max_abs/max_rel are differences of: "values" (element-wise), "stats", "mixed", "".
    basis: str = ""
    elements: ElementDiff | None = None  # of the first output compared element-wise that differs
    rule: str = ""
    phase: str = ""
    shapes: str = ""
    missing: str = ""

    # One line in a REPL (export/diff/reprs.py).
    def __repr__(self) -> str:
        return reprs.row_repr(self)

    @property
    def checksum_only(self) -> bool:
        """It differs, and by checksums alone: every recorded stat of its outputs is equal (and
        every output's shape, and both sides make every output: else that is what differs)."""
        return self.differs and not self.shapes and not self.missing and checksum_only(self.max_abs, self.basis)

    def absorb(self, c: Compared) -> None:
        """Take in one compared tensor of this record: the largest numbers, and their basis; a
        shape mismatch (no number) is kept in words."""
        if c.shapes_differ and not self.shapes:
            self.shapes = c.why
        if c.abs is None and c.rel is None:
            return
        self.max_abs = c.abs if self.max_abs is None else self.max_abs if c.abs is None else max(self.max_abs, c.abs)
        self.max_rel = c.rel if self.max_rel is None else self.max_rel if c.rel is None else max(self.max_rel, c.rel)
        if c.basis:
            self.basis = c.basis if self.basis in ("", c.basis) else "mixed"
        if self.elements is None and c.elements is not None and c.elements.differing:
            self.elements = c.elements

    def describe(self) -> str:
        """The measured difference in words that say where it came from, and an output's shape
        mismatch (``shape [3, 3] vs [3, 5]``)."""
        if (self.shapes or self.missing) and not self.max_abs:
            # the outputs both make, of one shape, measured equal: the shapes or the missing ones differ
            return "; ".join(x for x in (self.missing, self.shapes) if x)
        return "; ".join(x for x in (self.missing, self.shapes, difference_text(self.max_abs, self.max_rel,
                                                                                 self.basis, self.elements)) if x)

    @property
    def differs(self) -> bool:
        return self.status in ("origin", "new", "contaminated", "gradient")

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "module": self.module, "what": self.what, "status": self.status,
                "max_abs": json_number(self.max_abs), "max_rel": json_number(self.max_rel), "note": self.note,
                "basis": self.basis or None, "difference": self.describe() or None,
                "elements": None if self.elements is None else self.elements.to_json(),
                "rule": self.rule or None, "phase": self.phase or None, "shapes": self.shapes or None,
                "missing": self.missing or None}


def checksum_only(max_abs: float | None, basis: str) -> bool:
    """A difference measured on the stats as 0: only the checksums tell the values apart."""
    return basis == "stats" and max_abs == 0


@dataclass
class ModuleStat:
    compared: int = 0
    differing: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    where: str | None = None
    basis: str = ""  # of max_abs/max_rel, as Row.basis
    # Rows with an output whose shape differs: counted, not measured (no number for max_abs).
    shapes: int = 0
    # Rows that make an output on one side only (a frozen parameter's gradient): not measured either.
    missing: int = 0

    def add(self, row: Row) -> None:
        self.compared += 1
        if row.shapes:
            self.shapes += 1
        if row.missing:
            self.missing += 1
        if row.basis:
            self.basis = row.basis if self.basis in ("", row.basis) else "mixed"
        if row.differs:
            self.differing += 1
        if row.max_rel is not None and (row.max_rel > self.max_rel or self.where is None):
            self.max_rel, self.where = row.max_rel, row.a
        if row.max_abs is not None:
            self.max_abs = max(self.max_abs, row.max_abs)


@dataclass
class PhaseCount:
    """One phase's records in a section (``Divergence.phase_counts``): ``compared`` records both
    traces have, ``differing`` of those (``Row.differs``), of which ``later`` carried on from an
    origin or new after it (``LATER_DIFFERING``) and ``via_gradients`` differing only because
    they read gradients; ``inserted`` only in B, ``removed`` only in A. The calls' section holds
    every phase but backward: counted per phase, a row named ``optimizer`` counts the optimizer's
    calls, not the forward's with them."""

    phase: str
    compared: int = 0
    differing: int = 0
    later: int = 0
    via_gradients: int = 0
    inserted: int = 0
    removed: int = 0

    def to_json(self) -> dict[str, int]:
        return {"compared": self.compared, "differing": self.differing, "inserted": self.inserted,
                "removed": self.removed}


@dataclass
class Divergence:
    """What differs in one section (``forward`` API calls or ``backward`` grad-node steps).

    ``origin_a``/``origin_b`` name the first divergent record in each trace; ``stack_a``/``stack_b``
    are their call stacks (for a grad node, the stack of the call that created it).
    ``contaminated`` counts differing records after the origin per module; ``from_backward`` counts
    forward calls that differ only because they read gradients (optimizer steps).
    """

    section: str
    rows: list[Row] = field(default_factory=list)
    origin: Row | None = None
    reason: str = ""
    stack_a: tuple[Frame, ...] = ()
    stack_b: tuple[Frame, ...] = ()
    contaminated: dict[str, int] = field(default_factory=dict)
    from_backward: dict[str, int] = field(default_factory=dict)
    independent: list[str] = field(default_factory=list)
    inserted: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    casts: list[str] = field(default_factory=list)
    compared: int = 0
    unknown: int = 0
    per_module: dict[str, ModuleStat] = field(default_factory=dict)
    largest: Row | None = None
    before_origin: float | None = None
    notes: list[str] = field(default_factory=list)
    # Set when next to nothing aligns (two different programs): the one line that says so.
    unrelated: str = ""

    # One line in a REPL (export/diff/reprs.py).
    def __repr__(self) -> str:
        return reprs.divergence_repr(self)

    @property
    def origin_a(self) -> str | None:
        return None if self.origin is None else self.origin.a

    @property
    def origin_b(self) -> str | None:
        return None if self.origin is None else self.origin.b

    @property
    def equal(self) -> bool:
        """No origin, no contamination, no structural change (``from_backward`` aside)."""
        return self.origin is None and not self.contaminated and not self.inserted and not self.removed

    @property
    def label(self) -> str:
        """The word every surface names this section's divergence by (the verdict, the summary's
        row, the origin's heading): the calls' section holds the optimizer phase too, and an origin
        there is named by its phase (``optimizer``); otherwise the section's name."""
        o = self.origin
        return o.phase if self.section == "forward" and o is not None and o.phase == "optimizer" else self.section

    @property
    def first_structural(self) -> Row | None:
        return next((r for r in self.rows if r.status in ("inserted", "removed")), None)

    @property
    def structure_first(self) -> Row | None:
        """The first inserted or removed record, where it comes before the origin in the order
        the records ran: the first difference of all, and the likelier cause (B's extra layer,
        whose init drew from the RNG before the init both runs made), else None."""
        s = self.first_structural
        if s is None or self.origin is None:
            return None
        at = {id(r): i for i, r in enumerate(self.rows)}
        return s if at[id(s)] < at.get(id(self.origin), len(self.rows)) else None

    def summary(self) -> str:
        """One phrase: where this section first diverges."""
        if self.unrelated:
            return self.unrelated
        n = sum(self.contaminated.values())
        k = sum(self.from_backward.values())
        if self.origin is not None:
            o = self.origin
            where = o.a if o.a == o.b else f"{o.a} (B: {o.b})"
            tail = f"; {plural(n, 'later record')} contaminated{self._phases(LATER_DIFFERING)}" if n else ""
            tail += f"; {plural_verb(k, 'call after backward', 'differs', 'differ', 'calls after backward')} " \
                    "via gradients" if k else ""
            at = f"at {where} ({o.what} in {o.module or '<root>'}{_phase_words(o.phase)}): {self.reason}{tail}"
            s = self.structure_first
            if s is not None:  # what ran first leads: the aligned origin may only follow from it
                counts = ", ".join(f"{n} {w}" for n, w in ((len(self.inserted), "inserted in B"),
                                                            (len(self.removed), "removed from A")) if n)
                return (f"{counts}; first {s.status}: {s.a or s.b} ({s.what} in {s.module or '<root>'}"
                        f"{_phase_words(s.phase)}), before the first aligned difference {at}")
            return f"first {at}"
        if self.inserted or self.removed:
            s = self.first_structural
            first = "" if s is None else (f"; first {s.status}: {s.a or s.b} ({s.what} in {s.module or '<root>'}"
                                          f"{_phase_words(s.phase)})")
            rest = "all aligned records equal" if not n else plural_verb(n, "aligned record", "differs", "differ")
            return f"{len(self.inserted)} inserted in B, {len(self.removed)} removed from A{first}; {rest}"
        if n:
            return f"{plural_verb(n, 'record', 'differs', 'differ')} with no single origin"
        if self.from_backward:
            return (f"equal up to backward; {plural_verb(k, 'call after it', 'differs', 'differ', 'calls after it')} "
                    "only because gradients differ")
        return f"equal ({self.compared} aligned)"

    def phase_counts(self) -> list[PhaseCount]:
        """The section's records counted per ``Row.phase``, in the order a step runs the phases.
        The backward section is one phase, counted as a whole: its ``compared`` are the grad
        nodes' steps (``Divergence.compared``), not the calls of their hooks among its rows."""
        if self.section != "forward":
            whole = PhaseCount(self.section, self.compared)
            for r in self.rows:
                _count(whole, r)
            return [whole]
        counts: dict[str, PhaseCount] = {}
        for r in self.rows:
            c = counts.setdefault(r.phase, PhaseCount(r.phase))
            if r.a is not None and r.b is not None:  # an aligned call: what ``compared`` counts
                c.compared += 1
            _count(c, r)
        return [counts[p] for p in sorted(counts, key=phase_key)]

    def phase_summary(self, c: PhaseCount) -> str:
        """One phase's words in the Summary table, where the section's calls span several phases:
        the section's summary (the headline's words) on the row of the phase that holds the
        origin; elsewhere what that phase's own records show, in the summary's words."""
        if self.unrelated:
            return self.unrelated
        if self.origin is not None and self.origin.phase == c.phase:
            return self.summary()
        parts = []
        if c.inserted or c.removed:
            s = next(r for r in self.rows if r.phase == c.phase and r.status in ("inserted", "removed"))
            parts.append(f"{c.inserted} inserted in B, {c.removed} removed from A; first {s.status}: {s.a or s.b} "
                         f"({s.what} in {s.module or '<root>'})")
        if c.later:
            parts.append(f"{plural(c.later, 'later record')} contaminated" if self.origin is not None
                         else plural_verb(c.later, "aligned record", "differs", "differ"))
        if c.via_gradients:
            parts.append(f"{plural_verb(c.via_gradients, 'call', 'differs', 'differ')} only because gradients differ")
        return "; ".join(parts) or f"equal ({c.compared} aligned)"

    def _phases(self, statuses: frozenset[str]) -> str:
        """`` (3 forward, 2 optimizer)``: the rows of ``statuses`` per phase, in the order a step
        runs them, when they span more than one phase; else ``""``."""
        counts = Counter(r.phase for r in self.rows if r.status in statuses)
        if len(counts) < 2:
            return ""
        return " (" + ", ".join(f"{counts[p]} {p or 'unknown'}" for p in sorted(counts, key=phase_key)) + ")"

    def to_json(self) -> dict[str, Any]:
        o = self.origin
        return {
            "equal": self.equal, "summary": self.summary(), "compared": self.compared, "unknown": self.unknown,
            "unrelated": self.unrelated or None,
            "origin": None if o is None else {**o.to_json(), "reason": self.reason,
                                              "stack_a": [frame_json(f) for f in self.stack_a],
                                              "stack_b": [frame_json(f) for f in self.stack_b]},
            "contaminated": dict(sorted(self.contaminated.items())),
            "from_backward": dict(sorted(self.from_backward.items())),
            "independent": self.independent, "inserted": self.inserted, "removed": self.removed,
            "casts": self.casts,
            "largest": None if self.largest is None else self.largest.to_json(),
            "within_before_origin": json_number(self.before_origin),
            "per_module": {m: {"compared": s.compared, "differing": s.differing, "max_abs": json_number(s.max_abs),
                               "max_rel": json_number(s.max_rel), "basis": s.basis or None, "where": s.where,
                               "shapes_differ": s.shapes}
                           for m, s in sorted(self.per_module.items())},
            "records": [r.to_json() for r in self.rows if r.status != "equal"],
            "notes": self.notes,
            "phases": {c.phase: c.to_json() for c in self.phase_counts()},
        }


def _count(c: PhaseCount, r: Row) -> None:
    """Count ``r`` in ``c`` by its status (``compared`` is the caller's)."""
    c.differing += r.differs
    c.later += r.status in LATER_DIFFERING
    c.via_gradients += r.status == "gradient"
    c.inserted += r.status == "inserted"
    c.removed += r.status == "removed"


@dataclass
class ParamDiff:
    """A parameter or buffer compared by name: the value the step read (``read``: that version's
    name in A; ``made_in_step``: the block made it, a model built inside the traced step), its
    gradient and its value after the step. ``buffer``: a buffer, not a parameter."""

    name: str
    value: Compared
    grad: Compared | None = None
    updated: Compared | None = None
    only_in: str | None = None
    read: str = ""
    made_in_step: bool = False
    buffer: bool = False

    # One line in a REPL (export/diff/reprs.py).
    def __repr__(self) -> str:
        return reprs.param_repr(self)

    @property
    def differs(self) -> bool:
        return self.only_in is not None or any(
            c is not None and c.status == "differ" for c in (self.value, self.grad, self.updated))

    def to_json(self) -> dict[str, Any]:
        def c(x: Compared | None) -> Any:
            return None if x is None else x.to_json()
        return {"name": self.name, "value": c(self.value), "grad": c(self.grad), "updated": c(self.updated),
                "only_in": self.only_in, "read": self.read or None, "buffer": self.buffer}


@dataclass
class DiffResult:
    """The comparison of trace A with trace B. ``exit_code``: 0 equal, 1 diverged."""

    a_label: str
    b_label: str
    tolerance: Tolerance | None
    forward: Divergence
    backward: Divergence
    params: list[ParamDiff] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trace_a: Trace | None = field(default=None, repr=False, compare=False)
    trace_b: Trace | None = field(default=None, repr=False, compare=False)

    # One line in a REPL, a card in a notebook (export/diff/reprs.py).
    def __repr__(self) -> str:
        return reprs.result_repr(self)

    def _repr_html_(self) -> str:
        return reprs.result_html(self)

    @property
    def equal(self) -> bool:
        return (self.forward.equal and self.backward.equal and not self.forward.from_backward
                and not any(p.differs for p in self.params))

    @property
    def values_kept(self) -> bool:
        """Whether both traces kept some tensors' values (``trace(keep_values=...)``)."""
        return all(t is not None and any(r.values is not None for r in t.tensors.values())
                   for t in (self.trace_a, self.trace_b))

    @property
    def exit_code(self) -> int:
        return 0 if self.equal else 1

    @property
    def differing_params(self) -> list[ParamDiff]:
        """Parameters that differ, those whose value before the step differs first."""
        bad = [p for p in self.params if p.differs]
        return [p for p in bad if p.value.status == "differ"] + [p for p in bad if p.value.status != "differ"]

    def _changed_values(self) -> str:
        """The parameters whose value differs before the step, named (a handful, then how many
        more), the difference of the first when there is one alone, and, when forward found no
        origin, the first call that read it (a change rounded away by that call). Only those
        both traces have, of one shape: the others are no value that differs (``_structure``)."""
        changed = [p for p in self.params if same_parameter(p) and p.value.status == "differ"]
        if not changed:
            return ""
        n = len(changed)
        head = f"{plural_verb(n, _kind(changed), 'differs', 'differ', _kinds(changed))}: {_names(changed)}"
        how = changed[0].value.describe() if n == 1 else ""
        if how:
            head += f" ({how})"
        if self.forward.origin is None and self.trace_a is not None:
            first = changed[0].name
            reader = next((c.name for c in self.trace_a.calls if c.phase != "backward" and first in c.inputs), None)
            if reader is not None:
                row = next((r for r in self.forward.rows if r.a == reader), None)
                matched = row is not None and row.b is not None and row.status == "equal"
                head += f"; first read by {reader}" + (", whose outputs matched" if matched else "")
        return head

    def _structure(self) -> str:
        """The parameters and buffers that are no one parameter of both traces, named as what they
        are: of another shape under one name, or in one trace only (a layer one run has, a buffer
        only one run reads: batch norm's step counter in ``train()``). A change of structure: a
        value of either says nothing of the other's."""
        shaped = [p for p in self.params if p.only_in is None and p.value.shapes_differ]
        parts = []
        if shaped:
            # (``shape [4, 16] vs [16, 16]``: the words of the comparison, without the first one)
            names = ", ".join(f"{p.name} ({p.value.why.removeprefix('shape ')})" for p in shaped[:TOP_NAMED])
            more = f" … {len(shaped) - TOP_NAMED} more" if len(shaped) > TOP_NAMED else ""
            parts.append(f"{plural(len(shaped), _kind(shaped), _kinds(shaped))} of another shape: {names}{more}")
        for side in ("A", "B"):
            only = [p for p in self.params if p.only_in == side]
            if only:
                parts.append(f"{plural(len(only), _kind(only), _kinds(only))} only in {side}: {_names(only)}")
        return "; ".join(parts)

    @property
    def parted_earlier(self) -> bool:
        """Every parameter (two or more; buffers aside: a step counter stays equal) already differed
        as the traced step began, in values from before the step: the runs parted at an earlier
        step, and the first call to read them is no origin worth a headline."""
        params = [p for p in self.params if not p.buffer]
        return len(params) >= 2 and all(same_parameter(p) and p.value.status == "differ" and not p.made_in_step
                                        for p in params)

    def verdict(self) -> str:
        """The one-line answer, printed first."""
        f, b = self.forward, self.backward
        if f.unrelated:
            return f"DIVERGED — {f.unrelated}"
        if self.equal:
            unknown = f.unknown + b.unknown
            tail = f" ({unknown} records could not be compared: no checksum or stats)" if unknown else ""
            if self.tolerance is None:
                return (f"EQUAL: {plural(f.compared, 'call')}, {plural(b.compared, 'backward step')} and "
                        f"{state_count(self.params)} bit-identical{tail}")
            top = max((d.largest for d in (f, b) if d.largest is not None),
                      key=lambda r: r.max_rel or 0.0, default=None)
            if top is None or not top.max_rel:
                at = ": no difference in the recorded stats" + (" or kept values" if self.values_kept else "")
            elif top.basis == "values":
                at = (f": largest element-wise relative difference {format_number(top.max_rel, 3)} at {top.a} "
                      f"(in {top.module or '<root>'})")
            else:
                at = (f": largest relative stats difference {format_number(top.max_rel, 3)} ({STATS_WORDS}) "
                      f"at {top.a} (in {top.module or '<root>'})")
            casts = len(f.casts) + len(b.casts)
            tail += f"; {plural(casts, 'dtype cast')} made by one side only, ignored" if casts else ""
            return f"EQUAL within {self.tolerance}{at}{tail}"
        parts = [f"{f.label}: {f.summary()}", f"{b.label}: {b.summary()}"]
        if self.parted_earlier:  # the cause lies before this step: say so first, and how to find it
            parts.insert(0, parted_earlier(sum(1 for p in self.params if not p.buffer)))
        elif self.differing_params:
            # Counted and named: only parameters both traces have, of one shape; the others are
            # a change of structure, named apart after the sections (``_structure``).
            bad = [p for p in self.differing_params if same_parameter(p)]
            changed = self._changed_values()
            n = len(bad)
            values = sum(1 for p in bad if p.value.status == "differ")
            if changed:  # the parameters that changed come first: they are what the user changed
                parts.insert(0, changed + (f"; {n} differ in all ({differing_parts(bad)})" if n > values else ""))
            last = [] if changed or not bad else [
                f"{state_count(bad)} {'differs' if n == 1 else 'differ'} ({differing_parts(bad)})"]
            structure = self._structure()
            if last or structure:
                parts.append("; ".join(last + ([structure] if structure else [])))
        head = "DIVERGED" if self.tolerance is None else f"BEYOND TOLERANCE ({self.tolerance})"
        if self.tolerance is not None and f.origin is not None:
            basis = "element-wise" if f.origin.basis == "values" else "by stats"
            head += f", within it ({basis}) up to rel {format_number(f.before_origin, 3)}"
        return f"{head} — " + " | ".join(parts)

    def to_json(self) -> dict[str, Any]:
        t = self.tolerance
        params, buffers = state_counts(self.params, False), state_counts(self.params, True)
        return {"equal": self.equal, "exit_code": self.exit_code, "verdict": self.verdict(),
                "a": self.a_label, "b": self.b_label, "mode": "exact" if t is None else "tolerance",
                "rtol": None if t is None else t.rtol, "atol": None if t is None else t.atol,
                "forward": self.forward.to_json(), "backward": self.backward.to_json(),
                "params": [p.to_json() for p in self.differing_params],
                # compared: by name, in both traces; those one trace alone has are counted apart
                "params_compared": params.compared, "buffers_compared": buffers.compared,
                "params_only_in": {"A": params.only_in_a, "B": params.only_in_b},
                "buffers_only_in": {"A": buffers.only_in_a, "B": buffers.only_in_b},
                # in both under one name, of another shape: a change of structure, never compared
                "params_of_another_shape": params.reshaped, "buffers_of_another_shape": buffers.reshaped,
                "notes": self.notes,
                "numerics": {side: r.to_json() for side, r in self.numerics().items()}}

    def numerics(self) -> dict[str, NumericsReport]:
        """Each side's first NaN/Inf (forward and backward), for the sides that have any."""
        out = {}
        for side, trace in (("A", self.trace_a), ("B", self.trace_b)):
            if trace is not None:
                report = find_anomalies(trace)
                if not report.clean:
                    out[side] = report
        return out

    def render(self, console: Console, *, all_frames: bool = False) -> None:
        """Rich output: the verdict line first, then the tables (``all_frames``: every frame of
        the origins' stacks, not only the user's and the innermost)."""
        render_diff(self, console, all_frames=all_frames)

    def modules(self) -> list[dict[str, Any]]:
        """``module_table(self)``."""
        return module_table(self)


def same_parameter(p: ParamDiff) -> bool:
    """Whether ``p`` is one parameter (or buffer) of both traces: in both, of one shape. Only such
    a one differs in value; another is a change of structure (``DiffResult._structure``)."""
    return p.only_in is None and not p.value.shapes_differ


def _kind(params: list[ParamDiff]) -> str:
    return "buffer" if all(p.buffer for p in params) else "parameter"


def _kinds(params: list[ParamDiff]) -> str | None:
    """The plural of a mix of parameters and buffers (two at least), else None."""
    buffers = sum(p.buffer for p in params)
    return "parameters and buffers" if 0 < buffers < len(params) else None


def _names(params: list[ParamDiff]) -> str:
    """A handful of names, then how many more."""
    n = len(params)
    return ", ".join(p.name for p in params[:TOP_NAMED]) + (f" … {n - TOP_NAMED} more" if n > TOP_NAMED else "")


def _phase_words(phase: str) -> str:
    """``, optimizer`` after a module where a record's phase is not the section's plain one: the
    forward section's calls of a later phase (the optimizer's) and any phase a newer file names."""
    return "" if phase in ("", PHASE_ORDER[0], PHASE_ORDER[1]) else f", {phase}"


def frame_json(f: Frame) -> dict[str, Any]:
    """A frame as the JSON of a result: ``file``, ``line``, ``function``, ``code``."""
    return {"file": f.file, "line": f.line, "function": f.function, "code": f.code}


def module_table(result: DiffResult) -> list[dict[str, Any]]:
    """Per module: differing records forward/backward, after-backward calls, largest differences
    (``basis``: of what, ``stats``, ``values`` element-wise, or ``mixed``; ``checksum_only``:
    records differ there by checksum alone, every stat equal; ``shapes_differ``: records with an
    output whose shape differs, which the largest differences leave out: no number measures it).

    Only modules where something differs, or, with a tolerance, where any difference was measured;
    sorted by largest relative difference with a tolerance, by module path otherwise.
    """
    out: list[dict[str, Any]] = []
    origins = {d.origin.module for d in (result.forward, result.backward) if d.origin is not None}
    for m in sorted(set(result.forward.per_module) | set(result.backward.per_module)):
        stats = [x for x in (result.forward.per_module.get(m), result.backward.per_module.get(m)) if x is not None]
        fwd = sum(1 for r in result.forward.rows if r.module == m and r.status in ("origin", "new", "contaminated"))
        bwd = sum(1 for r in result.backward.rows if r.module == m and r.status in ("origin", "new", "contaminated"))
        after = result.forward.from_backward.get(m, 0)
        rel = max((x.max_rel for x in stats), default=0.0)
        ab = max((x.max_abs for x in stats), default=0.0)
        bases = {x.basis for x in stats if x.basis}
        basis = "" if not bases else bases.pop() if len(bases) == 1 else "mixed"
        shapes = sum(x.shapes for x in stats)
        missing = sum(x.missing for x in stats)
        if fwd or bwd or after or (result.tolerance is not None and rel > 0):
            out.append({"module": m, "forward": fwd, "backward": bwd, "after_backward": after,
                        "max_abs": ab, "max_rel": rel, "basis": basis or None, "origin": m in origins,
                        # (shapes that differ are a difference the checksums are not alone to see)
                        "checksum_only": bool(fwd or bwd or after) and not shapes and not missing
                        and checksum_only(ab, basis),
                        "shapes_differ": shapes})
    if result.tolerance is not None:
        out.sort(key=lambda r: -r["max_rel"])
    return out
