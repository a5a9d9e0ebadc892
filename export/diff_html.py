"""The HTML view of a trace comparison: one self-contained file, no network.

What the page shows, top to bottom:
- the verdict line (green: equal, red: diverged);
- per section (forward calls, backward steps) a small graph of the records around the first
  divergence: the origin in red, records it contaminated in orange, equal ones in green,
  inserted/removed ones in yellow; arrows follow the data (forward: tensor producer to consumer;
  backward: gradient flow from a node to the nodes it sends gradients to);
- the origin's two call stacks side by side;
- a side-by-side table of every aligned record (A | status | B), the origin row marked, the
  contaminated region shaded, inserted and removed rows in yellow; a filter keeps only the rows
  that differ.

All data travels as one JSON document inside ``<script type="application/json">`` with ``<``,
``>`` and ``&`` escaped, and the script writes every string with ``textContent``: a module name or
a file path holding ``</script>`` or markup shows as text. A Content-Security-Policy forbids any
fetch, so the page cannot reach the network even by mistake.
"""

from __future__ import annotations

import html
import json
import os
from collections import defaultdict
from typing import Any

from export.diff import DiffResult, Divergence, Row, module_table
from tracer.model import Call, Frame, GradNode, Trace
from tracer.model.display import json_number

_COLUMN = 6   # nodes per graph column
_DEPTH = 3    # levels drawn downstream of the origin


def _frames(stack: tuple[Frame, ...]) -> list[dict[str, Any]]:
    return [{"file": f.file, "line": f.line, "function": f.function, "code": f.code} for f in stack]


def _row(r: Row) -> list[Any]:
    return [r.a, r.b, r.module, r.what, r.status, json_number(r.max_abs), json_number(r.max_rel), r.note]


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
            "origin": None if o is None else {"a": o.a, "b": o.b, "module": o.module, "what": o.what},
            "stack_a": _frames(d.stack_a), "stack_b": _frames(d.stack_b),
            "contaminated": dict(sorted(d.contaminated.items())),
            "rows": [_row(r) for r in d.rows], "graph": _graph(d, a, b)}


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
    }


def script_json(data: Any) -> str:
    """JSON safe inside a <script> element: no '<', '>' or '&' can end or alter it."""
    text = json.dumps(data, sort_keys=True, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def diff_html_text(result: DiffResult, a: Trace, b: Trace) -> str:
    data = script_json(diff_payload(result, a, b))
    title = html.escape(f"gradtrace diff: {result.a_label} vs {result.b_label}")
    return _PAGE.replace("__TITLE__", title).replace("__DATA__", data)


def diff_html(result: DiffResult, a: Trace, b: Trace, path: str | os.PathLike[str]) -> None:
    """Write the self-contained HTML view of ``result`` (the comparison of ``a`` with ``b``)."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(diff_html_text(result, a, b))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
body{font:13px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{padding:10px 16px;background:#fff;border-bottom:1px solid #ddd;position:sticky;top:0;z-index:2}
#verdict{font-weight:600;font-size:14px}
#verdict.eq{color:#17803d}#verdict.ne{color:#b42318}
.files,.note{color:#666;font-size:12px}
section{margin:12px 16px;padding:10px 12px;background:#fff;border:1px solid #ddd;border-radius:6px}
h2{font-size:15px;margin:0 0 6px}
.summary{margin-bottom:8px}
svg{display:block;max-width:100%;background:#fcfcfc;border:1px solid #eee;margin:6px 0}
svg text{font:11px ui-monospace,monospace}
.stacks{display:grid;grid-template-columns:1fr 1fr;gap:8px;margin:6px 0}
.stacks pre{margin:0;padding:6px;background:#f6f6f6;border:1px solid #eee;overflow:auto;font-size:11.5px;white-space:pre-wrap;max-height:260px}
table{border-collapse:collapse;width:100%;font-size:12px}
th,td{padding:2px 6px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{position:sticky;top:0;background:#f3f3f3}
td.n{font-family:ui-monospace,monospace}
tr.origin td{background:#fdd;font-weight:700;outline:2px solid #d33}
tr.origin-module td{background:#fdd}
tr.new td{background:#fee}
tr.contaminated td{background:#fff1e0}
tr.gradient td{background:#f1ebff}
tr.inserted td,tr.removed td{background:#fff8c5}
tr.cast td,tr.unknown td{color:#888;font-style:italic}
.tools{margin:4px 0 6px}
.legend span{display:inline-block;padding:0 6px;margin-right:4px;border-radius:3px}
.scroll{max-height:70vh;overflow:auto}
</style></head>
<body>
<header><div id="verdict"></div><div class="files" id="files"></div><div class="note" id="notes"></div></header>
<main id="main"></main>
<script type="application/json" id="gradtrace-diff">__DATA__</script>
<script>
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("gradtrace-diff").textContent);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  };
  const fmt = x => (x === null || x === undefined) ? "" :
      (typeof x === "number" ? (x === 0 ? "0" : x.toPrecision(3)) : String(x));
  const COLORS = {origin: "#f8b4b4", new: "#fcd0d0", contaminated: "#fed7aa", gradient: "#ddd0ff",
                  inserted: "#fff3a0", removed: "#fff3a0", cast: "#eee", unknown: "#eee",
                  equal: "#c9f0d3", source: "#e6eefc"};
  const v = document.getElementById("verdict");
  v.textContent = data.verdict;
  v.className = data.equal ? "eq" : "ne";
  document.getElementById("files").textContent = "A: " + data.a + "    B: " + data.b +
      (data.tolerance ? "    tolerance: " + data.tolerance : "    bit-exact (checksums)");
  document.getElementById("notes").textContent = data.notes.join("  ·  ");
  const main = document.getElementById("main");

  function graph(g) {
    const NS = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(NS, "svg");
    if (!g.nodes.length) return svg;
    const cols = g.nodes.map(n => n.col), minc = Math.min(...cols), maxc = Math.max(...cols);
    const W = 210, H = 46, BW = 180, BH = 34, per = {};
    const pos = g.nodes.map(n => { const k = per[n.col] = (per[n.col] || 0) + 1;
      return [(n.col - minc) * W + 10, (k - 1) * H + 10]; });
    const rows = Math.max(...Object.values(per));
    svg.setAttribute("width", (maxc - minc + 1) * W + 20);
    svg.setAttribute("height", rows * H + 20);
    const defs = document.createElementNS(NS, "defs"), m = document.createElementNS(NS, "marker");
    m.setAttribute("id", "arrow"); m.setAttribute("viewBox", "0 0 10 10"); m.setAttribute("refX", "10");
    m.setAttribute("refY", "5"); m.setAttribute("markerWidth", "6"); m.setAttribute("markerHeight", "6");
    m.setAttribute("orient", "auto");
    const p = document.createElementNS(NS, "path"); p.setAttribute("d", "M0,0 L10,5 L0,10 z");
    p.setAttribute("fill", "#888"); m.appendChild(p); defs.appendChild(m); svg.appendChild(defs);
    for (const [s, t] of g.edges) {
      const l = document.createElementNS(NS, "line");
      l.setAttribute("x1", pos[s][0] + BW); l.setAttribute("y1", pos[s][1] + BH / 2);
      l.setAttribute("x2", pos[t][0]); l.setAttribute("y2", pos[t][1] + BH / 2);
      l.setAttribute("stroke", "#999"); l.setAttribute("marker-end", "url(#arrow)");
      svg.appendChild(l);
    }
    g.nodes.forEach((n, i) => {
      const grp = document.createElementNS(NS, "g");
      grp.setAttribute("class", "gnode " + n.status);
      const r = document.createElementNS(NS, "rect");
      r.setAttribute("x", pos[i][0]); r.setAttribute("y", pos[i][1]); r.setAttribute("width", BW);
      r.setAttribute("height", BH); r.setAttribute("rx", 5);
      r.setAttribute("fill", COLORS[n.status] || "#eee");
      r.setAttribute("stroke", n.status === "origin" ? "#b42318" : "#999");
      r.setAttribute("stroke-width", n.status === "origin" ? 2.5 : 1);
      const t1 = document.createElementNS(NS, "text"), t2 = document.createElementNS(NS, "text");
      t1.setAttribute("x", pos[i][0] + 6); t1.setAttribute("y", pos[i][1] + 14);
      t1.textContent = n.label.length > 28 ? n.label.slice(0, 27) + "…" : n.label;
      t2.setAttribute("x", pos[i][0] + 6); t2.setAttribute("y", pos[i][1] + 28); t2.setAttribute("fill", "#555");
      t2.textContent = (n.sub.length > 30 ? n.sub.slice(0, 29) + "…" : n.sub);
      const tip = document.createElementNS(NS, "title"); tip.textContent = n.name + " — " + n.status;
      grp.append(r, t1, t2, tip); svg.appendChild(grp);
    });
    return svg;
  }

  function stacks(s) {
    const box = el("div", "stacks");
    for (const [side, frames] of [["A", s.stack_a], ["B", s.stack_b]]) {
      const pre = el("pre");
      pre.textContent = side + ": " + (side === "A" ? s.origin.a : s.origin.b) + "\\n" + frames.map(
        f => f.file + ":" + f.line + " in " + f.function + "\\n    " + f.code).join("\\n");
      box.appendChild(pre);
    }
    return box;
  }

  function table(s) {
    const wrap = el("div");
    const tools = el("div", "tools");
    const lab = el("label"), cb = el("input");
    cb.type = "checkbox"; lab.append(cb, " only records that differ, inserted or removed");
    tools.appendChild(lab);
    const legend = el("span", "legend");
    for (const k of ["origin", "contaminated", "gradient", "inserted", "removed"]) {
      const x = el("span", null, k); x.style.background = COLORS[k]; legend.appendChild(x);
    }
    tools.appendChild(legend);
    const box = el("div", "scroll"), t = el("table"), head = el("tr");
    for (const h of ["#", "A", "module", "op", "status", "B", "max abs", "max rel", "note"]) head.appendChild(el("th", null, h));
    const thead = el("thead"); thead.appendChild(head); t.appendChild(thead);
    const body = el("tbody");
    s.rows.forEach((r, i) => {
      const [a, b, module, what, status, ab, rel, note] = r;
      const tr = el("tr", status);
      tr.dataset.a = a || ""; tr.dataset.b = b || "";
      for (const [txt, cls] of [[i, "n"], [a || "—", "n"], [module || "<root>"], [what], [status], [b || "—", "n"],
                                [fmt(ab), "n"], [fmt(rel), "n"], [note]]) tr.appendChild(el("td", cls, txt));
      body.appendChild(tr);
    });
    t.appendChild(body); box.appendChild(t);
    cb.addEventListener("change", () => {
      for (const tr of body.children) tr.hidden = cb.checked && tr.className === "equal";
    });
    wrap.append(tools, box);
    return wrap;
  }

  for (const s of data.sections) {
    const sec = el("section"); sec.id = "section-" + s.name;
    sec.appendChild(el("h2", null, s.name === "forward" ? "Forward API calls" : "Backward grad-node steps"));
    sec.appendChild(el("div", "summary", s.summary));
    if (s.graph.nodes.length) {
      sec.appendChild(el("div", "note", "Around the first divergence (trace " + s.graph.side +
          "): inputs on the left, what consumed the outputs to the right."));
      sec.appendChild(graph(s.graph));
    }
    if (s.origin) sec.appendChild(stacks(s));
    sec.appendChild(table(s));
    main.appendChild(sec);
    // stacks are outermost first: start scrolled to the innermost frames, the user's line
    for (const pre of sec.querySelectorAll(".stacks pre")) pre.scrollTop = pre.scrollHeight;
  }
  if (data.modules.length) {
    const sec = el("section"); sec.appendChild(el("h2", null, "Per module"));
    const t = el("table"), head = el("tr");
    for (const h of ["module", "forward differing", "backward differing", "after backward", "max abs", "max rel"]) head.appendChild(el("th", null, h));
    t.appendChild(head);
    for (const m of data.modules) {
      const tr = el("tr", m.origin ? "origin-module" : "");
      for (const x of [m.module || "<root>", m.forward, m.backward, m.after_backward, fmt(m.max_abs), fmt(m.max_rel)]) tr.appendChild(el("td", null, x));
      t.appendChild(tr);
    }
    sec.appendChild(t); main.appendChild(sec);
  }
  if (data.params.length) {
    const sec = el("section"); sec.appendChild(el("h2", null, "Parameters that differ"));
    const t = el("table"), head = el("tr");
    for (const h of ["parameter", "value", "gradient", "after step"]) head.appendChild(el("th", null, h));
    t.appendChild(head);
    const cell = c => c === null ? "-" : c.status + (c.max_rel !== null && c.status !== "equal" ? " (rel " + fmt(c.max_rel) + ")" : "");
    for (const p of data.params) {
      const tr = el("tr");
      for (const x of [p.name, p.only_in ? "only in " + p.only_in : cell(p.value), cell(p.grad), cell(p.updated)]) tr.appendChild(el("td", null, x));
      t.appendChild(tr);
    }
    sec.appendChild(t); main.appendChild(sec);
  }
  const first = document.querySelector("tr.origin");
  if (first) first.scrollIntoView({block: "center"});
})();
</script>
</body></html>
"""
