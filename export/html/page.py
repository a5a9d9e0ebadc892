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
Free-text strings (source lines, module paths, args, errors, notes, the header's values) are
clipped to ``LONG_TEXT_LIMIT`` characters with their full length noted (``clip_long``), so a trace
whose source lines are megabytes long still makes a page; record names, the page's keys, are not.
"""

from __future__ import annotations

import html as _html
import os
from dataclasses import replace
from typing import Any

from export.clipping import clipped
from export.errors import UserError
from export.html.data import build_payload
from export.html.memory import memory_svg, memory_tables
from export.html.template import fill, json_for_script, script, style
from tracer.model import Trace
from tracer.model.display import inert, sibling

DEFAULT_MAX_BYTES = 20_000_000


class ReportTooLarge(UserError, ValueError):
    """``max_bytes`` cannot hold even the page without calls (its frames, modules and memory tab);
    one line on the command line (a ``ValueError``, as before, for callers)."""


def _assemble(payload: dict[str, Any], model: str, memory: str | None = None) -> str:
    model = inert(model)
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


# A page is first tried with this many calls; a prefix that fits grows four-fold from there.
FIRST_PREFIX = 1024


def _render(trace: Trace, max_bytes: int) -> tuple[str, dict[str, Any] | None]:
    """The page and, when the budget cut it, what was left out.

    Past the budget the page keeps the longest prefix of calls that fits, to within 2% (or 8
    calls): the prefix grows four-fold from ``FIRST_PREFIX`` calls until a page is too big, then
    a binary search on the page size. A trace far past the budget (a million tensor values) is
    never built whole: each page costs a build, and the whole one dominated (17 builds, 130 s
    for a trace of 72,000 calls)."""
    trace = clipped(trace)
    model = trace.modules.get("", "")
    memory = ((memory_svg(trace) or "") + memory_tables(trace)) or None
    n = len(trace.calls)

    def cut_page(k: int) -> tuple[str, dict[str, Any]]:
        payload = build_payload(_first_calls(trace, k))
        payload["omitted"] = _omitted(trace, k, max_bytes)
        return _assemble(payload, model, memory), payload["omitted"]

    def fits(page: str) -> bool:
        return len(page.encode("utf-8")) <= max_bytes

    best: tuple[int, str, dict[str, Any]] | None = None  # the longest prefix known to fit
    k = FIRST_PREFIX
    while True:
        if k >= n:
            page = _assemble(build_payload(trace), model, memory)
            if fits(page):
                return page, None
            hi = n - 1
            break
        page, omitted = cut_page(k)
        if not fits(page):
            hi = k - 1
            break
        best = (k, page, omitted)
        k *= 4
    lo = best[0] + 1 if best is not None else 0
    while lo <= hi and (best is None or hi - best[0] > max(8, best[0] // 50)):
        mid = (lo + hi) // 2
        page, omitted = cut_page(mid)
        if fits(page):
            best, lo = (mid, page, omitted), mid + 1
        else:
            hi = mid - 1
    if best is None:
        least = len(cut_page(0)[0].encode("utf-8"))
        raise ReportTooLarge(f"max_bytes={max_bytes:,} is too small for this trace's page: {least:,} bytes with no "
                             "calls at all (its frames, modules and memory tab); raise max_bytes "
                             "(gradtrace report --max-bytes)")
    return best[1], best[2]


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


__all__ = ["DEFAULT_MAX_BYTES", "ReportTooLarge", "clipped", "default_output", "html", "render", "write_page"]
