"""One HTML page for a multi-rank run: a rank switcher over each rank's full report.

Each rank's report is the ordinary self-contained page, embedded as the ``srcdoc`` of its own
frame (attribute-escaped, so nothing in a trace can break out of it); the switcher only shows
one frame at a time. Still one file, still no network.
"""

from __future__ import annotations

import html as _html
import os
from typing import Any

from export.html import DEFAULT_MAX_BYTES, render
from tracer.model import Trace

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; frame-src 'self' about:; img-src data:">
<title>gradtrace · {n} ranks</title>
<style>
body {{ margin: 0; font: 13px system-ui, sans-serif; display: flex; flex-direction: column; height: 100vh; }}
#gt-ranks {{ padding: 6px 10px; border-bottom: 1px solid #d1d5db; background: #f9fafb; }}
#gt-ranks button {{ margin-right: 4px; padding: 3px 10px; border: 1px solid #9ca3af; background: #fff; border-radius: 4px; cursor: pointer; }}
#gt-ranks button.on {{ background: #dbeafe; border-color: #2563eb; }}
iframe {{ flex: 1; border: 0; width: 100%; display: none; }}
iframe.on {{ display: block; }}
</style></head><body>
<div id="gt-ranks"><b>gradtrace</b> · {n} ranks · {buttons}</div>
{frames}
<script>
document.querySelectorAll('#gt-ranks button').forEach(function (b) {{
  b.addEventListener('click', function () {{
    var r = b.getAttribute('data-rank');
    document.querySelectorAll('#gt-ranks button').forEach(function (x) {{ x.classList.toggle('on', x === b); }});
    document.querySelectorAll('iframe').forEach(function (f) {{ f.classList.toggle('on', f.getAttribute('data-rank') === r); }});
  }});
}});
</script>
</body></html>
"""


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
    text = _PAGE.format(n=len(ranked), buttons="".join(buttons), frames="\n".join(frames))
    data = text.encode("utf-8")
    with open(path, "wb") as fh:
        fh.write(data)
    return len(data)
