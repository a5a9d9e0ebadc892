"""The notebook view of a trace (``Trace._repr_html_``): a summary line, the first calls, and
the interactive report embedded (iframe ``srcdoc``) when its page is small."""

from __future__ import annotations

import html as _html

from export.html.page import render
from export.views import first_params, nonfinite
from tracer.model import Trace
from tracer.model.display import shape_times

NOTEBOOK_INLINE_MAX_BYTES = 400_000  # a notebook embeds the full page only when it is this small


def notebook_html(trace: Trace, *, top: int = 12) -> str:
    """What ``Trace._repr_html_`` shows: a summary line and the first calls; the interactive
    report is embedded (iframe ``srcdoc``) only when its page is small."""
    e = _html.escape
    model = trace.modules.get("", "") or "trace"
    params = first_params(trace)
    nonfinite_names = [t.name for t in nonfinite(trace)]
    facts = [f"status <b>{e(trace.status)}</b>", f"{len(trace.calls)} calls", f"{len(trace.grad_nodes)} grad nodes",
             f"{len(trace.tensors)} tensors", f"{len(trace.backward_runs)} backward runs",
             f"{len(params)} parameters ({sum(t.numel for t in params):,} values)",
             f"hash {e(trace.hash_algorithm)}",
             f"device {e(', '.join(sorted({t.device for t in trace.tensors.values()})) or '–')}"]
    rows = []
    for c in trace.calls[:top]:
        out = trace.tensors.get(c.outputs[0]) if c.outputs else None
        shape = shape_times(out.shape) if out else ""
        md5 = (out.md5 or "")[:12] if out else ""
        bad = ' style="color:#d1242f"' if out is not None and out.stats is not None and not out.stats.finite else ""
        rows.append(f"<tr{bad}><td><code>{e(c.name)}</code></td><td><code>{e(c.api)}</code></td>"
                    f"<td><code>{e(c.module)}</code></td><td>{e(shape)}</td><td><code>{e(md5)}</code></td>"
                    f"<td>{len(c.grad_nodes)}</td></tr>")
    more = len(trace.calls) - top
    parts = [
        '<div class="gradtrace-summary" style="font-family:sans-serif;font-size:13px">',
        f"<div><b>gradtrace · {e(model)}</b> — {' · '.join(facts)}</div>",
    ]
    if nonfinite_names:
        parts.append(f'<div style="color:#d1242f">{len(nonfinite_names)} tensor(s) with NaN/Inf, first '
                     f"<code>{e(nonfinite_names[0])}</code></div>")
    if trace.status != "ok" and trace.error:
        parts.append(f'<div style="color:#d1242f">{e(str(trace.error))}</div>')
    parts.append('<table style="font-size:12px"><tr><th>call</th><th>API</th><th>module</th><th>output</th>'
                 "<th>md5</th><th>grad nodes</th></tr>" + "".join(rows) + "</table>")
    if more > 0:
        parts.append(f"<div>… {more} more calls</div>")
    page = render(trace)
    if len(page.encode("utf-8")) <= NOTEBOOK_INLINE_MAX_BYTES:
        parts.append('<details><summary>interactive report</summary>'
                     f'<iframe srcdoc="{e(page, quote=True)}" style="width:100%;height:640px;border:1px solid #ddd" '
                     'sandbox="allow-scripts"></iframe></details>')
    else:
        parts.append("<div><code>export.html(trace, 'step.html')</code> writes the interactive report.</div>")
    parts.append("</div>")
    return "".join(parts)
