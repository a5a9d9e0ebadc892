"""The HTML view of a trace comparison: one self-contained file, no network.

What the page shows, top to bottom:
- the verdict line (green: equal, red: diverged);
- per section (forward calls, backward steps) a small graph of the records around the first
  divergence: the origin in red, records it contaminated in orange, equal ones in green,
  inserted/removed ones in yellow; arrows follow the data (forward: tensor producer to consumer;
  backward: gradient flow from a node to the nodes it sends gradients to);
- the origin's two call stacks side by side, folded as ``gradtrace show`` folds them (the user's
  frames and the innermost one; each run of other frames one line that opens on a click);
- a side-by-side table of every aligned record (A | status | B), the origin row marked, the
  contaminated region shaded, inserted and removed rows in yellow with the user's line that made
  them; a record whose checksums differ while every stat is equal reads ``checksum only``, not a
  difference of 0; a filter keeps only the rows that differ.

All data travels as one JSON document inside ``<script type="application/json">`` with ``<``,
``>`` and ``&`` escaped, and the script writes every string with ``textContent``: a module name or
a file path holding ``</script>`` or markup shows as text. A Content-Security-Policy forbids any
fetch, so the page cannot reach the network even by mistake.
"""

from __future__ import annotations

import html
import os
from collections import defaultdict
from typing import Any

from export.diff.console import differing_of, record_line
from export.diff.result import DiffResult, Divergence, Row, frame_json, module_table
from export.html.template import fill, json_for_script, script, style
from tracer.model import Call, Frame, GradNode, Trace
from tracer.model.display import clip_long, inert, json_number
from tracer.model.frames import fold_label, folded

_COLUMN = 6   # nodes per graph column
_DEPTH = 3    # levels drawn downstream of the origin


def _row(r: Row, a: Trace, b: Trace) -> list[Any]:
    # basis: what max abs / max rel are differences of ("stats": min/max/mean/absmax only);
    # checksum_only: the checksums differ, every stat is equal (no number to show); line: the
    # user's line of a record only one trace has; shapes: an output's shape mismatch (no number).
    line = None
    if r.status in ("inserted", "removed", "cast"):
        line = record_line(a, r.a) if r.a is not None else record_line(b, r.b)
    return [r.a, r.b, r.module, r.what, r.status, json_number(r.max_abs), json_number(r.max_rel), r.note,
            r.basis or None, r.phase or None, r.checksum_only, line, r.rule or None, r.shapes or None]


def _frames(frames: tuple[Frame, ...]) -> list[dict[str, Any]]:
    """A stack for the page: each frame with ``folded`` (a short view hides it) and, on the first
    frame of each folded run, that run's ``fold`` label (``3 frames folded (2 library, 1 framework)``)."""
    hide = folded(frames)
    out: list[dict[str, Any]] = []
    k = 0
    while k < len(frames):
        if not hide[k]:
            out.append({**frame_json(frames[k]), "folded": False})
            k += 1
            continue
        end = k
        while end < len(frames) and hide[end]:
            end += 1
        label = fold_label(frames[k:end])
        out += [{**frame_json(f), "folded": True, "fold": label if i == 0 else None}
                for i, f in enumerate(frames[k:end])]
        k = end
    return out


# ---- graph of the records around the divergence ----------------------------------------------------
def _status_maps(d: Divergence) -> tuple[dict[str, str], dict[str, str]]:
    by_a = {r.a: r.status for r in d.rows if r.a is not None}
    by_b = {r.b: r.status for r in d.rows if r.b is not None}
    return by_a, by_b


def _center(d: Divergence) -> tuple[str, str] | None:
    """(side, name) of the record the graph is drawn around."""
    if d.origin is not None and d.origin.a is not None:
        return "a", d.origin.a
    s = d.first_structural
    if s is not None:
        return ("a", s.a) if s.a is not None else ("b", s.b or "")
    first = next((r for r in d.rows if r.differs and r.a is not None), None)
    return None if first is None else ("a", first.a or "")


def _forward_graph(t: Trace, center: str, status: dict[str, str]) -> dict[str, Any]:
    calls = {c.name: c for c in t.calls}
    consumers: dict[str, list[str]] = defaultdict(list)
    for c in t.calls:
        for i in c.inputs:
            consumers[i].append(c.name)
    c0 = calls.get(center)
    if c0 is None:
        return {"nodes": [], "edges": []}
    nodes: list[dict[str, Any]] = []
    ids: dict[str, int] = {}
    edges: list[list[int]] = []

    def add(name: str, col: int, label: str, sub: str, st: str) -> int | None:
        if name in ids:
            return ids[name]
        if sum(1 for n in nodes if n["col"] == col) >= _COLUMN:
            return None
        ids[name] = len(nodes)
        nodes.append({"name": name, "col": col, "label": label, "sub": sub, "status": st})
        return ids[name]

    def call_node(c: Call, col: int) -> int | None:
        return add(c.name, col, c.name, c.module or "<root>", status.get(c.name, "equal"))

    me = call_node(c0, 0)
    for i in c0.inputs:
        rec = t.tensors.get(i)
        prod = calls.get(rec.producer) if rec is not None and rec.producer else None
        k = call_node(prod, -1) if prod is not None else add(
            i, -1, i, rec.role if rec is not None else "tensor", "source")
        if k is not None and me is not None:
            edges.append([k, me])
    frontier = [c0]
    for col in range(1, _DEPTH + 1):
        nxt = []
        for c in frontier:
            src = ids.get(c.name)
            for o in c.outputs:
                for cn in consumers.get(o, []):
                    k = call_node(calls[cn], col)
                    if k is None:
                        continue
                    if src is not None and [src, k] not in edges:
                        edges.append([src, k])
                    nxt.append(calls[cn])
        frontier = nxt
    return {"nodes": nodes, "edges": edges}


def _backward_graph(t: Trace, center: str, status: dict[str, str]) -> dict[str, Any]:
    nodes_by = {n.name: n for n in t.grad_nodes}
    senders: dict[str, list[str]] = defaultdict(list)
    for n in t.grad_nodes:
        for m in n.next:
            if m is not None:
                senders[m].append(n.name)
    n0 = nodes_by.get(center)
    if n0 is None:
        return {"nodes": [], "edges": []}
    nodes: list[dict[str, Any]] = []
    ids: dict[str, int] = {}
    edges: list[list[int]] = []

    def add(n: GradNode, col: int) -> int | None:
        if n.name in ids:
            return ids[n.name]
        if sum(1 for x in nodes if x["col"] == col) >= _COLUMN:
            return None
        ids[n.name] = len(nodes)
        sub = n.kind if n.call is None else f"{n.kind} · {n.call}"
        nodes.append({"name": n.name, "col": col, "label": n.name, "sub": sub,
                      "status": status.get(n.name, "equal")})
        return ids[n.name]

    me = add(n0, 0)
    for s in senders.get(n0.name, []):
        k = add(nodes_by[s], -1)
        if k is not None and me is not None:
            edges.append([k, me])
    frontier = [n0]
    for col in range(1, _DEPTH + 1):
        nxt = []
        for n in frontier:
            src = ids.get(n.name)
            for m in n.next:
                dest = nodes_by.get(m) if m is not None else None
                if dest is None:
                    continue
                k = add(dest, col)
                if k is None:
                    continue
                if src is not None and [src, k] not in edges:
                    edges.append([src, k])
                nxt.append(dest)
        frontier = nxt
    return {"nodes": nodes, "edges": edges}


def _graph(d: Divergence, a: Trace, b: Trace) -> dict[str, Any]:
    c = _center(d)
    if c is None:
        return {"nodes": [], "edges": [], "side": None}
    side, name = c
    by_a, by_b = _status_maps(d)
    t, st = (a, by_a) if side == "a" else (b, by_b)
    g = _forward_graph(t, name, st) if d.section == "forward" else _backward_graph(t, name, st)
    g["side"] = side.upper()
    return g


# ---- page -----------------------------------------------------------------------------------------
def _section(d: Divergence, a: Trace, b: Trace) -> dict[str, Any]:
    o = d.origin
    return {"name": d.section, "summary": d.summary(), "equal": d.equal, "reason": d.reason,
            "origin": None if o is None else {"a": o.a, "b": o.b, "module": o.module, "what": o.what,
                                              "difference": o.describe() or None},
            "origin_phase": None if o is None else o.phase or None,
            "stack_a": _frames(d.stack_a), "stack_b": _frames(d.stack_b),
            "contaminated": dict(sorted(d.contaminated.items())),
            "rows": [_row(r, a, b) for r in d.rows], "graph": _graph(d, a, b)}


def diff_payload(result: DiffResult, a: Trace, b: Trace) -> dict[str, Any]:
    """The JSON document the page renders (tests read it back out of the page)."""
    return {
        "verdict": result.verdict(), "equal": result.equal, "a": result.a_label, "b": result.b_label,
        "tolerance": None if result.tolerance is None else str(result.tolerance),
        "notes": result.notes,
        "sections": [_section(result.forward, a, b), _section(result.backward, a, b)],
        "modules": [{**m, "max_abs": json_number(m["max_abs"]), "max_rel": json_number(m["max_rel"])}
                    for m in module_table(result)],
        "params": [p.to_json() for p in result.differing_params],
        # how many differ of those both traces have, and those one alone has: the console's words
        "params_of": differing_of(result.differing_params, result.params) if result.differing_params else None,
    }


def diff_html_text(result: DiffResult, a: Trace, b: Trace) -> str:
    """The page as text (see ``diff_html``)."""
    return fill("diff.html", title=html.escape(inert(f"gradtrace diff: {result.a_label} vs {result.b_label}")),
                data=json_for_script(_shown(diff_payload(result, a, b)), sort_keys=True),
                css=style("diff.css"), js=script("diff.js"))


def _shown(value: Any) -> Any:
    """Every string of the page's data as the page shows it: clipped (``clip_long``) and with its
    control and invisible characters escaped (``inert``); the page only displays them."""
    if isinstance(value, str):
        return inert(clip_long(value))
    if isinstance(value, dict):
        return {k: _shown(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shown(v) for v in value]
    return value


def diff_html(result: DiffResult, a: Trace, b: Trace, path: str | os.PathLike[str]) -> None:
    """Write the self-contained HTML view of ``result`` (the comparison of ``a`` with ``b``)."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(diff_html_text(result, a, b))
