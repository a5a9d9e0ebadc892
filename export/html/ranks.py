"""One HTML page for a multi-rank run: a rank switcher over each rank's full report, and the
verdict of ``diff_ranks`` on top: which rank departed first, on what, made by which call where.

Each rank's report is the ordinary self-contained page, embedded as the ``srcdoc`` of its own
frame (attribute-escaped, so nothing in a trace can break out of it); the switcher only shows
one frame at a time (``templates/ranks.html``, ``assets/ranks.css``, ``assets/ranks.js``). The
rank that departed first carries a badge on its button, and the verdict under the switcher says
what departed and where, with a button that opens that rank's report on the call that made the
departing value. Still one file, still no network.
"""

from __future__ import annotations

import html as _html
import os
from typing import Any

from export.diff.ranks import Departure, RankDiffResult, diff_ranks
from export.html.page import DEFAULT_MAX_BYTES, render
from export.html.template import fill, script, style
from tracer.model import Trace
from tracer.model.display import clip_long, inert, plural

FIRST_READ = " (first read)"  # how diff_ranks names a record's first reader when no call made it


def rank_of(trace: Trace, default: int) -> int:
    info: Any = trace.header.get("distributed") or {}
    rank = info.get("rank") if isinstance(info, dict) else None
    return int(rank) if isinstance(rank, int) else default


def html_ranks(traces: list[Trace], path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Write one page that switches between the reports of ``traces`` (one per rank) and marks
    the rank that departed first (``export.diff.diff_ranks``)."""
    ranked = sorted(((rank_of(t, i), t) for i, t in enumerate(traces)), key=lambda p: p[0])
    result = diff_ranks([t for _, t in ranked])
    first = result.first
    departing = {r for d in result.departures for r in d.ranks}
    per_rank = max(max_bytes // max(len(ranked), 1), 1_000_000)
    buttons, frames = [], []
    for i, (rank, trace) in enumerate(ranked):
        on = ' class="on"' if i == 0 else ""
        state, badge = "", ""
        if first is not None and rank == first.rank:
            state = "departed-first"
            badge = ' <span class="badge departed-first" title="the first value this rank disagrees on">departed first</span>'
        elif rank in departing:
            state = "departs"
            badge = ' <span class="badge departs" title="this rank also disagrees on later values">departs</span>'
        buttons.append(f'<button data-rank="{rank}"{on} data-state="{state}">rank {rank}{badge}</button>')
        page = render(trace, max_bytes=per_rank)
        frames.append(f'<iframe data-rank="{rank}"{on} title="rank {rank}" '
                      f'srcdoc="{_html.escape(page, quote=True)}"></iframe>')
    text = fill("ranks.html", n=str(len(ranked)), buttons="".join(buttons), frames="\n".join(frames),
                verdict=_verdict(result, dict(ranked)), css=style("ranks.css"), js=script("ranks.js"))
    data = text.encode("utf-8")
    with open(path, "wb") as fh:
        fh.write(data)
    return len(data)


def _shown(text: str) -> str:
    """A string of the traces in the banner: clipped (``clip_long``), its control and invisible
    characters escaped (``inert``), then HTML-escaped."""
    return _html.escape(inert(clip_long(text)))


def _verdict(result: RankDiffResult, by_rank: dict[int, Trace]) -> str:
    """The banner under the switcher: the first departure in words (escaped), or agreement, or
    why the ranks could not be compared."""
    esc = _shown
    d = result.first
    notes = "".join(f'<div class="note">note: {esc(n)}</div>' for n in result.notes)
    if result.problems or d is None:
        state = "unknown" if result.problems else "agree"
        return f'<div id="gt-rank-verdict" class="{state}">{esc(result.verdict())}{notes}</div>'
    where = f" (parameter <code>{esc(d.param)}</code>)" if d.param and d.param != d.record else ""
    lines = [f'<b>Rank {d.rank} departed first</b> at {esc(d.what)} <code class="record">{esc(d.record)}</code>'
             f"{where}: {esc(d.reason)}."]
    made = []
    if d.call:
        made.append(f'made by <code class="call">{esc(d.call)}</code>' + (f" ({esc(d.api)})" if d.api else ""))
    made.append(f"in module <code>{esc(d.module or '<root>')}</code>")
    if d.stack:
        f = d.stack[-1]
        made.append(f'at <span class="where">{esc(f.file)}:{f.line}</span> <code>{esc(f.code.strip())}</code>')
    if d.placement:
        made.append(f"placement {esc(d.placement)}")
    lines.append(" ".join(made) + ".")
    if d.carrier:
        lines.append(f'First carried off rank {d.rank} by <code class="carrier">{esc(d.carrier)}</code> '
                     f"({esc(d.carrier_api or '')}, {esc(d.carrier_args or '')}).")
    others = len(result.departures) - 1
    ref = list(d.reference)
    lines.append(f"Reference: {'rank' if len(ref) == 1 else 'ranks'} {', '.join(map(str, ref))}"
                 + (f"; {plural(others, 'more departing record')}." if others else "."))
    target = _show_target(d, by_rank)
    button = ""
    if target is not None:
        rank, name = target
        button = (f' <button id="gt-show-departure" data-goto-rank="{rank}" data-goto="{_html.escape(name, quote=True)}">'
                  f"show {esc(name)} in rank {rank}</button>")
    return (f'<div id="gt-rank-verdict" class="departed" data-rank="{d.rank}">' + "<br>".join(lines) + button
            + notes + "</div>")


def _show_target(d: Departure, by_rank: dict[int, Trace]) -> tuple[int, str] | None:
    """Where to show the departure: the call (or grad node) that made the record, on the
    departing rank if that rank has it, else on the reference rank; else the record itself."""
    call = d.call[: -len(FIRST_READ)] if d.call and d.call.endswith(FIRST_READ) else d.call
    for rank in (d.rank, *d.reference):
        t = by_rank.get(rank)
        if t is None:
            continue
        if call and (any(c.name == call for c in t.calls) or any(n.name == call for n in t.grad_nodes)):
            return rank, call
    for rank in (d.rank, *d.reference):
        t = by_rank.get(rank)
        if t is not None and d.record in t.tensors:
            return rank, d.record
    return None
