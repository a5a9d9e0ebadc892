"""Self-contained interactive HTML report: ``html(trace, path)``, ``gradtrace report TRACE``.

One file that opens from ``file://`` with no network: our page code (``assets/report.js``,
``assets/report.css``) and the vendored layout library (``assets/vendor/dagre.min.js``, MIT, see
``scripts/vendor_assets.sh``) are inlined from package data, and the trace is embedded as JSON
(``export.html_data``) in a ``<script type="application/json">`` whose ``<``, ``>``, ``&`` and
U+2028/2029 are escaped, so no string from the trace can end the script or start markup. The
page puts trace strings into the document only through ``textContent``/``setAttribute``.

What the page shows: forward calls (blue, data flowing down) beside backward grad nodes (orange;
green for AccumulateGrad) with gradients flowing up, both folded by module invocation into grey
boxes; a red outline marks a call or grad node whose tensors hold NaN/Inf. Clicking an item
shows its names, API, module, tensors (shape, dtype, device, MD5, stats), call stack and its
counterpart on the other side (purple, joined by a dashed line).

Size: the page is bounded by ``max_bytes``. Past it, the report keeps the first calls in
execution order (with their grad nodes, tensors and backward steps) that fit, and a banner on the
page says how many were left out; ``gradtrace show``/``summary`` still read the full trace.
"""

from __future__ import annotations

import html as _html
import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from export.html_data import build_payload
from export.memory_svg import MEMORY_CSS, memory_svg
from export.views import first_params, nonfinite
from tracer.model import Trace, install_view
from tracer.model.display import shape_times, sibling

DEFAULT_MAX_BYTES = 20_000_000
NOTEBOOK_INLINE_MAX_BYTES = 400_000  # a notebook embeds the full page only when it is this small

_SOURCE_MAP = re.compile(r"^//# sourceMappingURL=.*$", re.MULTILINE)
_SCRIPT_END = re.compile(r"</(script)", re.IGNORECASE)


_ASSETS = Path(__file__).resolve().parent / "assets"


def _asset(name: str) -> str:
    # Read beside this module: works installed, editable, and while ``export`` is a namespace package.
    return (_ASSETS / name).read_text(encoding="utf-8")


def _inline_js(code: str) -> str:
    # No source map look-ups (they would be a request) and no way to close the script element.
    return _SCRIPT_END.sub(r"<\\/\1", _SOURCE_MAP.sub("", code))


def _inline_css(code: str) -> str:
    return code.replace("</", "<\\/")


def json_for_script(data: Any) -> str:
    """JSON text safe inside ``<script type="application/json">`` (and as a JS literal)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<meta name="generator" content="gradtrace">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<header id="gt-header">
  <span id="gt-title"><span class="brand">gradtrace ·</span> {model}</span>
  <span id="gt-summary"></span>
  <div id="gt-banners"></div>
</header>
<nav id="gt-toolbar">
  <div class="group"><button data-tab="graph" class="on">Graph</button><button data-tab="table">Table</button>{memory_tab}</div>
  <div class="group"><label>show</label><button data-side="both" class="on">both</button><button data-side="fwd">forward</button><button data-side="bwd">backward</button></div>
  <div class="group"><label for="gt-module">module</label><select id="gt-module"></select></div>
  <div class="group"><label>fold</label><button id="gt-collapse" title="fold the deepest open level">− level</button><button id="gt-expand" title="unfold the next module level (stops before the page gets slow)">+ level</button><button id="gt-foldall" title="fold everything">all</button><button id="gt-initial" title="the folding the page opened with">reset</button><span id="gt-count" class="legend"></span></div>
  <div id="gt-search-wrap"><input id="gt-search" type="search" placeholder="search names, APIs, modules  ( / )" autocomplete="off" spellcheck="false"><div id="gt-results"></div></div>
</nav>
<main id="gt-main">
  <section id="gt-view">
    <div id="gt-graph"><svg id="gt-svg" xmlns="http://www.w3.org/2000/svg"><defs>
      <marker id="gt-arrow-f" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path class="arrow-f" d="M0,0L10,5L0,10z"/></marker>
      <marker id="gt-arrow-b" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path class="arrow-b" d="M0,0L10,5L0,10z"/></marker>
      <marker id="gt-arrow-h" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path class="arrow-h" d="M0,0L10,5L0,10z"/></marker>
    </defs><g id="gt-vp"></g></svg></div>
    <div id="gt-zoom"><button id="gt-zin" title="zoom in">+</button><button id="gt-zout" title="zoom out">−</button><button id="gt-fit" title="fit (f)">fit</button></div>
    <div id="gt-legend" class="legend"><span><i class="sw call"></i>call</span><span><i class="sw node"></i>grad node</span><span><i class="sw acc"></i>AccumulateGrad</span><span><i class="sw grp"></i>folded group</span><span><i class="sw bad"></i>NaN/Inf</span><span>drag to pan · wheel to zoom</span></div>
    <div id="gt-toast"></div>
    <div id="gt-table-wrap"></div>
    {memory_view}
  </section>
  <aside id="gt-details"></aside>
</main>
<script type="application/json" id="gt-data">{data}</script>
<script>{dagre}</script>
<script>{js}</script>
</body>
</html>
"""


def _assemble(payload: dict[str, Any], model: str, memory: str | None = None) -> str:
    title = f"gradtrace · {model}" if model else "gradtrace report"
    # The memory timeline is rendered here as escaped inline SVG: a tab of its own when the
    # trace recorded memory (trace(memory=True)), absent otherwise.
    memory_tab = '<button data-tab="memory">Memory</button>' if memory else ""
    memory_view = f'<div id="gt-memory-wrap">{memory}</div>' if memory else ""
    return _PAGE.format(title=_html.escape(title), model=_html.escape(model or "trace"),
                        memory_tab=memory_tab, memory_view=memory_view,
                        css=_inline_css(_asset("report.css") + MEMORY_CSS), data=json_for_script(payload),
                        dagre=_inline_js(_asset("vendor/dagre.min.js")), js=_inline_js(_asset("report.js")))


def render(trace: Trace, *, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The report page as text, within ``max_bytes`` of UTF-8 (see the module docstring)."""
    return _render(trace, max_bytes)[0]


def _render(trace: Trace, max_bytes: int) -> tuple[str, dict[str, Any] | None]:
    """The page and, when the budget cut it, what was left out."""
    model = trace.modules.get("", "")
    memory = memory_svg(trace)
    page = _assemble(build_payload(trace), model, memory)
    if len(page.encode("utf-8")) <= max_bytes:
        return page, None
    # Too big: keep the longest prefix of calls that fits (binary search on the page size).
    lo, hi, best = 0, len(trace.calls) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        payload = build_payload(_first_calls(trace, mid))
        payload["omitted"] = _omitted(trace, mid, max_bytes)
        candidate = _assemble(payload, model, memory)
        if len(candidate.encode("utf-8")) <= max_bytes:
            best, lo = (candidate, payload["omitted"]), mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise ValueError(f"max_bytes={max_bytes} is too small for the report page itself "
                         f"({len(_assemble(build_payload(Trace()), model).encode('utf-8'))} bytes with no calls)")
    return best


def _omitted(trace: Trace, kept: int, max_bytes: int) -> dict[str, Any]:
    return {"calls": len(trace.calls) - kept, "kept_calls": kept, "max_bytes": max_bytes,
            "message": (f"This page shows the first {kept} of {len(trace.calls)} calls (and their grad nodes, "
                        f"tensors and backward steps) to stay within {max_bytes:,} bytes. Raise max_bytes "
                        f"(gradtrace report --max-bytes) or use `gradtrace show` for the rest.")}


def _first_calls(trace: Trace, k: int) -> Trace:
    """A copy of ``trace`` cut to its first ``k`` calls and everything they reach."""
    calls = trace.calls[:k]
    kept = {c.name for c in calls}
    nodes = [n for n in trace.grad_nodes if n.call in kept]
    names = {n.name for n in nodes}
    leaves = {m for n in nodes for m in n.next if m is not None}
    nodes = [n for n in trace.grad_nodes if n.name in names or (n.call is None and n.name in leaves)]
    names = {n.name for n in nodes}
    runs = [replace(r, steps=[s for s in r.steps if s.node in names]) for r in trace.backward_runs]
    used: set[str] = set()
    for c in calls:
        used.update(c.inputs, c.outputs)
    for r in runs:
        for s in r.steps:
            used.update(t for t in (*s.grads_in, *s.grads_out) if t is not None)
    tensors = {name: t for name, t in trace.tensors.items() if name in used}
    cut = Trace(header=trace.header, meta=trace.meta, calls=calls, grad_nodes=nodes, tensors=tensors,
                backward_runs=runs, modules=trace.modules,
                frames=trace.frames, stacks=trace.stacks, status=trace.status, error=trace.error,
                notes=list(trace.notes))
    cut.resolve()
    return cut


def html(trace: Trace, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Write the self-contained report for ``trace`` to ``path``; return the bytes written."""
    return write_page(trace, path, max_bytes=max_bytes)[0]


def write_page(trace: Trace, path: str | os.PathLike[str], *,
               max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[int, dict[str, Any] | None]:
    """Write the report; the bytes written and, when ``max_bytes`` cut the page, what was left
    out (``message`` says it in words)."""
    page, omitted = _render(trace, max_bytes)
    data = page.encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
    return len(data), omitted


# ---- Jupyter ----------------------------------------------------------------------------------
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


# ---- file names -------------------------------------------------------------------------------
def default_output(trace_path: str) -> str:
    """Where the report of a trace goes by default: beside it, ``step.gtrace.gz`` -> ``step.html``."""
    return sibling(trace_path, ".html")


__all__ = ["DEFAULT_MAX_BYTES", "default_output", "html", "json_for_script", "notebook_html", "render", "write_page"]


install_view("notebook", notebook_html)  # Trace._repr_html_ in notebooks, once export is imported
