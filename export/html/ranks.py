"""One HTML page for a multi-rank run: a rank switcher over each rank's full report.

Each rank's report is the ordinary self-contained page, embedded as the ``srcdoc`` of its own
frame (attribute-escaped, so nothing in a trace can break out of it); the switcher only shows
one frame at a time (``templates/ranks.html``, ``assets/ranks.css``, ``assets/ranks.js``). Still
one file, still no network.
"""

from __future__ import annotations

import html as _html
import os
from typing import Any

from export.html.page import DEFAULT_MAX_BYTES, render
from export.html.template import fill, script, style
from tracer.model import Trace


def rank_of(trace: Trace, default: int) -> int:
    info: Any = trace.header.get("distributed") or {}
    rank = info.get("rank") if isinstance(info, dict) else None
    return int(rank) if isinstance(rank, int) else default


def html_ranks(traces: list[Trace], path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Write one page that switches between the reports of ``traces`` (one per rank)."""
    ranked = sorted(((rank_of(t, i), t) for i, t in enumerate(traces)), key=lambda p: p[0])
    per_rank = max(max_bytes // max(len(ranked), 1), 1_000_000)
    buttons, frames = [], []
    for i, (rank, trace) in enumerate(ranked):
        on = ' class="on"' if i == 0 else ""
        buttons.append(f'<button data-rank="{rank}"{on}>rank {rank}</button>')
        page = render(trace, max_bytes=per_rank)
        frames.append(f'<iframe data-rank="{rank}"{on} title="rank {rank}" '
                      f'srcdoc="{_html.escape(page, quote=True)}"></iframe>')
    text = fill("ranks.html", n=str(len(ranked)), buttons="".join(buttons), frames="\n".join(frames),
                css=style("ranks.css"), js=script("ranks.js"))
    data = text.encode("utf-8")
    with open(path, "wb") as fh:
        fh.write(data)
    return len(data)
