"""The notebook view of a trace (``Trace._repr_html_``): a summary line, the NaN/Inf story, the first
calls, and how to open the full report, in at most ``NOTEBOOK_MAX_BYTES`` of HTML with no script.

The interactive report is a page of its own (≈160 kB even for a 7-call model: its script and
styles), so it is never embedded by default: a notebook that displays a few traces would grow by
megabytes. ``inline_report(trace)`` embeds it on request (a sandboxed ``iframe``); ``export.html``
writes it to a file.
"""

from __future__ import annotations

import html as _html

from export.html.page import render
from export.views import first_params, nonfinite
from tracer.model import Trace
from tracer.model.display import format_size, plural, shape_times
from tracer.model.reprs import esc

# The inline view's budget: what one displayed trace may add to a notebook (rows past it are
# left out, and the view says how many).
NOTEBOOK_MAX_BYTES = 20_000


def _row(trace: Trace, i: int) -> str:
    c = trace.calls[i]
    out = trace.tensors.get(c.outputs[0]) if c.outputs else None
    shape = shape_times(out.shape) if out else ""
    md5 = (out.md5 or "")[:12] if out else ""
    bad = ' style="color:#d1242f"' if out is not None and out.stats is not None and not out.stats.finite else ""
    return (f"<tr{bad}><td><code>{esc(c.name)}</code></td><td><code>{esc(c.api)}</code></td>"
            f"<td><code>{esc(c.module)}</code></td><td>{esc(shape)}</td><td><code>{esc(md5)}</code></td>"
            f"<td>{len(c.grad_nodes)}</td></tr>")


def _how_to_open(trace: Trace) -> str:
    path = trace.meta.get("out")
    cli = f" or <code>gradtrace report {esc(path, 200)}</code>" if isinstance(path, str) and path else ""
    return ("<div>Full interactive report: <code>export.html(t, 'step.html')</code>"
            f"{cli}; inline: <code>export.inline_report(t)</code>.</div>")


def notebook_html(trace: Trace, *, top: int = 12, max_bytes: int = NOTEBOOK_MAX_BYTES) -> str:
    """What ``Trace._repr_html_`` shows: a summary line, the NaN/Inf story, the first ``top``
    calls and how to open the full report; never more than ``max_bytes`` of UTF-8 (rows that would
    pass it are left out and counted)."""
    model = trace.modules.get("", "") or "trace"
    params = first_params(trace)
    nonfinite_names = [t.name for t in nonfinite(trace)]
    facts = [f"status <b>{esc(trace.status)}</b>", plural(len(trace.calls), "call"),
             plural(len(trace.grad_nodes), "grad node"), plural(len(trace.tensors), "tensor"),
             plural(len(trace.backward_runs), "backward run"),
             f"{plural(len(params), 'parameter')} ({plural(sum(t.numel for t in params), 'value')})",
             f"hash {esc(trace.hash_algorithm)}",
             f"device {esc(', '.join(sorted({t.device for t in trace.tensors.values()})) or '–')}"]
    head = ['<div class="gradtrace-summary" style="font-family:sans-serif;font-size:13px">',
            f"<div><b>gradtrace · {esc(model)}</b> — {' · '.join(facts)}</div>"]
    if nonfinite_names:
        # The numerics report's story, its words (an intended -inf mask is never the headline).
        report = trace.anomalies
        color = "#9a6700" if report.clean or report.skipped_step is not None else "#d1242f"
        lines = [report.headline_text()]
        if report.spread.count:
            lines.append(report.spread.line())
        lines += report.notes()
        head.append(f'<div style="color:{color}">' + "<br>".join(esc(line, 400) for line in lines)
                    + " (<code>t.anomalies</code> has the story)</div>")
    if trace.status != "ok" and trace.error:
        head.append(f'<div style="color:#d1242f">{esc(str(trace.error), 300)}</div>')
    table_head = ('<table style="font-size:12px"><tr><th>call</th><th>API</th><th>module</th><th>output</th>'
                  "<th>md5</th><th>grad nodes</th></tr>")
    tail = [_how_to_open(trace), "</div>"]
    used = sum(len(p.encode("utf-8")) for p in (*head, table_head, "</table>", *tail)) + 200  # + the "more" line
    rows: list[str] = []
    for i in range(min(top, len(trace.calls))):
        row = _row(trace, i)
        size = len(row.encode("utf-8"))
        if used + size > max_bytes:
            break
        rows.append(row)
        used += size
    parts = [*head, table_head, *rows, "</table>"]
    more = len(trace.calls) - len(rows)
    if more > 0:
        parts.append(f"<div>… {more} more calls</div>")
    return "".join(parts + tail)


class InlineReport:
    """The full interactive report embedded in a notebook cell (a sandboxed ``iframe``)."""

    def __init__(self, trace: Trace, height: int = 640) -> None:
        self.page = render(trace)
        self.height = height

    def __repr__(self) -> str:
        return f"<InlineReport {format_size(len(self.page.encode('utf-8')))}>"

    def _repr_html_(self) -> str:
        # The page's data is already escaped for its own script element; srcdoc escapes the page.
        return (f'<iframe srcdoc="{_html.escape(self.page, quote=True)}" '
                f'style="width:100%;height:{self.height}px;border:1px solid #ddd" sandbox="allow-scripts"></iframe>')


def inline_report(trace: Trace, height: int = 640) -> InlineReport:
    """The interactive report inside the notebook, on request (its size: the page's, ≈160 kB and up)."""
    return InlineReport(trace, height)
