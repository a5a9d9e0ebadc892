"""How diff results read in a REPL and a notebook: the verdict as one line (``repr``) and a
compact HTML card (``_repr_html_``: verdict, each section's origin with its line, the differing
parameters), built with ``tracer.model.reprs`` (every string escaped, no script)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from export.diff.console import differing_of, state_count, states_noun
from tracer.model.display import clip, format_number, plural
from tracer.model.frames import user_frame
from tracer.model.reprs import NAME_LIMIT, card, esc, names, names_html, source_link

if TYPE_CHECKING:
    from export.diff.ranks import Departure, RankDiffResult
    from export.diff.result import DiffResult, Divergence, ParamDiff, Row

VERDICT_LIMIT = 300  # characters of a verdict in a repr or a card
TOP_PARAMS = 5  # differing parameters named in a card


def row_repr(r: Row) -> str:
    """``<Row linear1 F.linear in enc.2: origin, stats max |Δ| 0.5>`` (``element-wise max abs``
    where both traces kept the values)."""
    a, b = clip(r.a or "-", NAME_LIMIT), clip(r.b or "-", NAME_LIMIT)
    name = a if r.a == r.b else f"{a} (B: {b})"
    if r.max_abs is None:
        size = ""
    elif r.basis == "values":
        size = f", element-wise max abs {format_number(r.max_abs, 3)}"
    else:  # a difference of min/max/mean/absmax, not of any element
        size = f", stats max |Δ| {format_number(r.max_abs, 3)}"
    return f"<Row {name} {clip(r.what, NAME_LIMIT)} in {clip(r.module or '<root>', NAME_LIMIT)}: {r.status}{size}>"


def divergence_repr(d: Divergence) -> str:
    return f"<Divergence {d.label}: {clip(d.summary(), VERDICT_LIMIT)}>"


def param_repr(p: ParamDiff) -> str:
    """``<ParamDiff enc.0.weight value differ, grad differ, updated differ>``."""
    if p.only_in is not None:
        return f"<ParamDiff {clip(p.name, NAME_LIMIT)} only in {p.only_in}>"
    parts = [f"{label} {c.status}" for label, c in (("value", p.value), ("grad", p.grad), ("updated", p.updated))
             if c is not None]
    return f"<ParamDiff {clip(p.name, NAME_LIMIT)} {', '.join(parts)}>"


def result_repr(r: DiffResult) -> str:
    return f"<DiffResult {clip(r.a_label, NAME_LIMIT)} vs {clip(r.b_label, NAME_LIMIT)}: {clip(r.verdict(), VERDICT_LIMIT)}>"


def _section(d: Divergence) -> str:
    text = esc(d.summary(), VERDICT_LIMIT)
    where = user_frame(d.stack_a or d.stack_b)  # the user's line, also when a library made the call
    return text + (f" at {source_link(where)}" if where is not None else "")


def result_html(r: DiffResult) -> str:
    facts = [("A", f"<code>{esc(r.a_label)}</code>"), ("B", f"<code>{esc(r.b_label)}</code>"),
             (r.forward.label, _section(r.forward)), (r.backward.label, _section(r.backward))]
    bad = r.differing_params
    if bad:
        facts.append((states_noun(r.params), f"{esc(differing_of(bad, r.params, ' differ'))}: "
                                             f"{names_html([p.name for p in bad], TOP_PARAMS)}"))
    elif r.params:
        facts.append((states_noun(r.params), f"{esc(state_count(r.params))} compared, none differs"))
    for note in r.notes[:3]:
        facts.append(("note", esc(note, VERDICT_LIMIT)))
    return card("diff", "EQUAL" if r.equal else "DIFFERENT", facts, note="" if r.equal else r.verdict())


def departure_repr(d: Departure) -> str:
    return (f"<Departure rank {d.rank} at {clip(d.what, NAME_LIMIT)} {clip(d.record, NAME_LIMIT)}: "
            f"{clip(d.reason, VERDICT_LIMIT)}>")


def ranks_repr(r: RankDiffResult) -> str:
    return f"<RankDiffResult ranks {names([str(x) for x in r.ranks], 8)}: {clip(r.verdict(), VERDICT_LIMIT)}>"


def ranks_html(r: RankDiffResult) -> str:
    facts = [("ranks", esc(", ".join(str(x) for x in r.ranks))), ("compared", f"{r.compared} records")]
    first = r.first
    if first is not None:
        facts.append(("first", f"rank {first.rank}: {esc(first.what)} <code>{esc(first.record)}</code> "
                               f"({esc(first.reason, VERDICT_LIMIT)})"))
        if first.stack:
            facts.append(("line", source_link(first.stack[-1])))
        facts.append(("departing", plural(len(r.departures), "record")))
    for problem in r.problems[:3]:
        facts.append(("problem", esc(problem, VERDICT_LIMIT)))
    title = "AGREE" if r.equal else ("CANNOT COMPARE" if r.problems else f"RANK {first.rank if first else '?'} DEPARTED")
    return card("ranks diff", title, facts)
