"""Self-contained interactive HTML report: ``html(trace, path)``, ``gradtrace report TRACE``.

One file that opens from ``file://`` with no network: the page is ``templates/report.html``; our
page code (``assets/report.js``, ``assets/report.css``, ``assets/memory.css``) and the vendored
layout library (``assets/vendor/dagre.min.js``, MIT, see ``scripts/vendor_assets.sh``) are
inlined from package data (``export.html.template``), and the trace is embedded as JSON
(``export.html.data``) in a ``<script type="application/json">`` whose ``<``, ``>``, ``&`` and
U+2028/2029 are escaped, so no string from the trace can end the script or start markup. The
page puts trace strings into the document only through ``textContent``/``setAttribute``.

What the page shows: forward calls (blue, data flowing down) beside backward grad nodes (orange;
green for AccumulateGrad) with gradients flowing up, both folded by module invocation into grey
boxes; a red outline marks a call whose outputs, or a grad node whose gradients, hold NaN/Inf
(a folded box: on the side holding one), and two buttons jump to the first NaN of forward and of
backward (``tracer.analysis.numerics``). Clicking an item
shows its names, API, module, tensors (shape, dtype, device, MD5, stats), call stack and its
counterpart on the other side (purple, joined by a dashed line).

Size: the page is bounded by ``max_bytes``. Past it, the report keeps the first calls in
execution order (with their grad nodes, tensors and backward steps) that fit, and a banner on the
page says how many were left out; ``gradtrace show``/``summary`` still read the full trace.
"""

from __future__ import annotations

import html as _html
import os
from dataclasses import replace
from typing import Any

from export.html.data import build_payload
from export.html.memory import memory_svg, memory_tables
from export.html.template import fill, json_for_script, script, style
from tracer.model import Trace
from tracer.model.display import sibling

DEFAULT_MAX_BYTES = 20_000_000


def _assemble(payload: dict[str, Any], model: str, memory: str | None = None) -> str:
    title = f"gradtrace · {model}" if model else "gradtrace report"
    # The memory timeline (escaped inline SVG) and the tables of `gradtrace memory` (escaped
    # HTML) are rendered here: a tab of their own when the trace recorded memory
    # (trace(memory=True)), absent otherwise.
    memory_tab = '<button data-tab="memory">Memory</button>' if memory else ""
    memory_view = f'<div id="gt-memory-wrap">{memory}</div>' if memory else ""
    return fill("report.html", title=_html.escape(title), model=_html.escape(model or "trace"),
                memory_tab=memory_tab, memory_view=memory_view, css=style("report.css", "memory.css"),
                data=json_for_script(payload), dagre=script("vendor/dagre.min.js"), js=script("report.js"))


def render(trace: Trace, *, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The report page as text, within ``max_bytes`` of UTF-8 (see the module docstring)."""
    return _render(trace, max_bytes)[0]


def _render(trace: Trace, max_bytes: int) -> tuple[str, dict[str, Any] | None]:
    """The page and, when the budget cut it, what was left out."""
    model = trace.modules.get("", "")
    memory = ((memory_svg(trace) or "") + memory_tables(trace)) or None
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


# ---- file names -------------------------------------------------------------------------------
def default_output(trace_path: str) -> str:
    """Where the report of a trace goes by default: beside it, ``step.gtrace.gz`` -> ``step.html``."""
    return sibling(trace_path, ".html")


__all__ = ["DEFAULT_MAX_BYTES", "default_output", "html", "render", "write_page"]
