"""How the analyses read in a REPL and a notebook: ``t.anomalies`` (a ``NumericsReport`` and its
``Anomaly`` records) and a memory record, as one line (``repr``) and a compact HTML card built
with ``tracer.model.reprs`` (every string of the trace escaped, no script)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracer.model.display import clip, format_bytes, plural
from tracer.model.reprs import card, esc, names_html, source_link

if TYPE_CHECKING:
    from tracer.analysis.memory import MemoryRecord
    from tracer.analysis.numerics import Anomaly, NumericsReport

TOP_ROWS = 5  # owners listed in a memory card
TEXT_LIMIT = 600  # characters of a sentence of the story shown in a card (a headline with its line)


# ---- numerics --------------------------------------------------------------------------------------
# An optimizer step made the first NaN/Inf from finite parameters and gradients, in a trace that
# did not check its state (Anomaly.state_unchecked).
STATE_UNCHECKED = ("the optimizer's state was not checked: a NaN or Inf in it shows first here, as does one "
                   "its hyperparameters make (lr, eps); check_numerics(optimizer_state=True) checks the state")


def anomaly_repr(a: Anomaly) -> str:
    """``<Anomaly NaN made by sqrt0 (torch.sqrt) in forward, module h.7.mlp — x.py:12: …>``."""
    return f"<Anomaly {clip(a.headline(), 200)}>"


def _anomaly_facts(a: Anomaly) -> list[tuple[str, str]]:
    cause = ("origin: made here from finite inputs" if a.origin
             else f"arrived from outside the step in {names_html(a.bad_inputs)}" if a.arrived
             else f"carried from {names_html(a.bad_inputs)}")
    facts = [("tensor", f"{names_html([a.tensor])} ({a.nan} NaN, {a.inf} Inf)"),
             ("made by", f"{names_html([a.producer])} <code>{esc(a.producer_kind)}</code>"),
             ("where", esc(a.where(), TEXT_LIMIT)),
             ("cause", cause)]
    facts += [("note", esc(n, TEXT_LIMIT)) for n in a.notes()]
    line = a.line
    if line is not None:
        facts.append(("line", source_link(line)))
    return facts


def anomaly_html(a: Anomaly) -> str:
    return card(f"{a.what} in {a.phase}", a.tensor, _anomaly_facts(a))


def numerics_repr(r: NumericsReport) -> str:
    """``<NumericsReport NaN made by sqrt0 (torch.sqrt) in forward, …; 862 more; 142 checked>``."""
    if r.checked == 0:
        return "<NumericsReport no tensor stats (record with check_numerics=True)>"
    more = f"; {r.spread.count:,} more" if r.spread.count else ""
    return f"<NumericsReport {clip(r.headline_text(), 200)}{more}; {r.checked} checked>"


def numerics_html(r: NumericsReport) -> str:
    """The story as a card: the headline, what it reached, what is not a fault."""
    if r.checked == 0:
        return card("numerics", "no tensor stats", [("how", "record with <code>check_numerics=True</code>")])
    facts: list[tuple[str, str]] = []
    h = r.headline
    facts.append(("story", esc(r.headline_text(), TEXT_LIMIT)))
    if h is not None:
        facts += _anomaly_facts(h)
        if r.spread.count:
            facts.append(("then", esc(r.spread.line(), TEXT_LIMIT)))
    facts += [("not a fault", esc(n, TEXT_LIMIT)) for n in r.notes()]
    title = "clean" if h is None else f"{h.what} in {h.phase}"
    return card("numerics", title, facts)


# ---- memory ----------------------------------------------------------------------------------------
def memory_html(rec: MemoryRecord) -> str:
    facts = [("events", f"{plural(len(rec.allocs), 'alloc')}, {plural(len(rec.frees), 'free')}, "
                        f"net {esc(format_bytes(rec.net()))}")]
    peak = rec.peak
    if peak is not None:
        live = ", ".join(f"<code>{esc(t.label)}</code> {esc(format_bytes(t.bytes))}" for t in peak.tensors[:3])
        facts.append(("peak", f"{esc(format_bytes(peak.allocated))} on {esc(peak.device)} at #{peak.seq} "
                              f"({esc(peak.phase)}, <code>{esc(peak.owner or 'unknown')}</code>)"))
        if live:
            facts.append(("largest live", live))
    owners = sorted(rec.by_owner().items(), key=lambda kv: (-kv[1]["alloc_bytes"], kv[0] or "~"))
    for owner, d in owners[:TOP_ROWS]:
        facts.append(("allocator", f"<code>{esc(owner or 'unattributed')}</code> {d['allocs']} allocs, "
                                   f"{esc(format_bytes(d['alloc_bytes']))}"))
    if len(owners) > TOP_ROWS:
        facts.append(("", f"+{len(owners) - TOP_ROWS} more allocators: <code>print(rec.table())</code>"))
    return card("memory record", ", ".join(rec.devices()) or "no events", facts)
