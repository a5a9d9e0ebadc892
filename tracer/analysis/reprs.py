"""How the analyses read in a REPL and a notebook: ``t.anomalies`` (a ``NumericsReport`` and its
``Anomaly`` records) and a memory record, as one line (``repr``) and a compact HTML card built
with ``tracer.model.reprs`` (every string of the trace escaped, no script)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracer.model.display import all_finite, clip, format_bytes, plural
from tracer.model.reprs import NAME_LIMIT, card, esc, names_html, source_link

if TYPE_CHECKING:
    from tracer.analysis.memory import MemoryRecord
    from tracer.analysis.numerics import Anomaly, NumericsReport

TOP_ROWS = 5  # owners listed in a memory card


# ---- numerics --------------------------------------------------------------------------------------
# An optimizer step made the first NaN/Inf from finite parameters and gradients, in a trace that
# did not check its state (Anomaly.state_unchecked).
STATE_UNCHECKED = ("the optimizer's state was not checked: a NaN or Inf in it shows first here, as does one "
                   "its hyperparameters make (lr, eps); check_numerics(optimizer_state=True) checks the state")


def anomaly_repr(a: Anomaly) -> str:
    """``<Anomaly first NaN in forward: sqrt0:out by sqrt0 [torch.sqrt] in h.7.mlp (origin), 3 more>``."""
    role = "origin" if a.origin else "propagated"
    more = f", {a.contaminated} more" if a.contaminated else ""
    return (f"<Anomaly first {a.what} in {a.phase}: {clip(a.tensor, NAME_LIMIT)} by {clip(a.producer, NAME_LIMIT)} "
            f"[{clip(a.producer_kind, NAME_LIMIT)}] in {clip(a.module or '<root>', NAME_LIMIT)} ({role}){more}>")


def _anomaly_facts(a: Anomaly) -> list[tuple[str, str]]:
    facts = [("tensor", f"{names_html([a.tensor])} ({a.nan} NaN, {a.inf} Inf)"),
             ("made by", f"{names_html([a.producer])} <code>{esc(a.producer_kind)}</code>"),
             ("module", f"<code>{esc(a.module or '<root>')}</code>"),
             ("cause", "origin: its inputs were finite" if a.origin
              else f"propagated from {names_html(a.bad_inputs)}")]
    if a.state_unchecked:
        facts.append(("note", esc(STATE_UNCHECKED)))
    if a.stack:
        facts.append(("line", source_link(a.stack[-1])))
    if a.contaminated:
        mods = list(a.contaminated_by_module)
        span = esc(mods[0] or "<root>") + (f" … {esc(mods[-1] or '<root>')}" if len(mods) > 1 else "")
        facts.append(("then", f"{a.contaminated} more in {plural(len(mods), 'module')} ({span})"))
    return facts


def anomaly_html(a: Anomaly) -> str:
    return card(f"first {a.what} in {a.phase}", a.tensor, _anomaly_facts(a))


def numerics_repr(r: NumericsReport) -> str:
    """``<NumericsReport forward: NaN at sqrt0:out (h.7.mlp); backward: clean; 142 checked>``."""
    if r.checked == 0:
        return "<NumericsReport no tensor stats (record with check_numerics=True)>"
    sides = []
    for phase, found in (("forward", (r.forward_nan, r.forward_inf)), ("backward", (r.backward_nan, r.backward_inf))):
        bad = [f"{a.what} at {clip(a.tensor, NAME_LIMIT)} ({clip(a.module or '<root>', NAME_LIMIT)})"
               for a in found if a is not None]
        sides.append(f"{phase}: {', '.join(bad) or 'clean'}")
    return f"<NumericsReport {'; '.join(sides)}; {r.checked} checked>"


def numerics_html(r: NumericsReport) -> str:
    if r.checked == 0:
        return card("numerics", "no tensor stats", [("how", "record with <code>check_numerics=True</code>")])
    if r.clean:
        facts = [("verdict", all_finite(r.checked))]
        if r.intended_inf:
            facts.append(("intended Inf", f"{r.intended_inf} (e.g. -inf attention masks)"))
        return card("numerics", "clean", facts)
    parts = [anomaly_html(a) for a in r.anomalies()]
    head = card("numerics", f"{plural(len(parts), 'anomaly', 'anomalies')} in {plural(r.checked, 'checked tensor')}",
                [("GradScaler", esc(o.describe(), 1000)) for o in r.scaler_overflows])
    return head + "".join(parts)


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
