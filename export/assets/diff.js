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
  const BASIS = {stats: "stats", values: "values", mixed: "stats+values"};
  // checksums differ while every recorded stat is equal: there is no number to show
  const CHECKSUM_ONLY = "checksum only";
  // outputs whose shapes differ: no number measures that (it is never an infinite difference)
  const SHAPES_DIFFER = "shapes differ";
  // the phases of a step in the order it runs them; one this page does not know comes last
  const PHASES = ["forward", "backward", "optimizer"];
  const phaseRank = p => { const k = PHASES.indexOf(p); return k < 0 ? PHASES.length : k; };
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

  // A stack folded as `gradtrace show` folds it: the user's frames and the innermost one; each
  // run of other frames is one line that opens to show them.
  function stacks(s) {
    const box = el("div", "stacks");
    const frame = f => el("div", "frame", f.file + ":" + f.line + " in " + f.function + "\n    " + f.code);
    for (const [side, frames] of [["A", s.stack_a], ["B", s.stack_b]]) {
      const pre = el("div", "stack");
      pre.appendChild(el("div", "frame", side + ": " + (side === "A" ? s.origin.a : s.origin.b) +
          (s.origin_phase ? " (" + s.origin_phase + ")" : "")));
      let run = null;
      for (const f of frames) {
        if (!f.folded) { run = null; pre.appendChild(frame(f)); continue; }
        if (f.fold) {
          run = el("details", "fold");
          run.appendChild(el("summary", null, "... " + f.fold));
          pre.appendChild(run);
        }
        run.appendChild(frame(f));
      }
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
    const box = el("div", "scroll"), t = el("table", "records"), head = el("tr");
    // "of": what max abs / max rel are differences of; "stats" means of min/max/mean/absmax, not of elements
    for (const h of ["#", "A", "module", "op", "status", "B", "max abs", "max rel", "of", "note"]) head.appendChild(el("th", null, h));
    const thead = el("thead"); thead.appendChild(head); t.appendChild(thead);
    const body = el("tbody");
    s.rows.forEach((r, i) => {
      const [a, b, module, what, status, ab, rel, note, basis, phase, checksumOnly, line, , shapes] = r;
      const tr = el("tr", status);
      tr.dataset.a = a || ""; tr.dataset.b = b || "";
      // the phase beside the op where it is not the section's own (an optimizer step among the calls)
      const op = what + (phase && phase !== "forward" && phase !== "backward" ? " · " + phase : "");
      const size = checksumOnly ? [CHECKSUM_ONLY, ""] : shapes && !ab ? [shapes, ""] : [fmt(ab), fmt(rel)];
      const words = [note, line ? "at " + line : ""].filter(Boolean).join("; ");
      for (const [txt, cls] of [[i, "n"], [a || "—", "n name"], [module || "<root>", "name"], [op, "name"], [status],
                                [b || "—", "n name"], [size[0], "n"], [size[1], "n"], [BASIS[basis] || ""],
                                [words, "note"]]) tr.appendChild(el("td", cls, txt));
      if (phase) tr.title = "phase: " + phase;
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
    // the calls of every phase but backward (forward, the optimizer's...), in the order a step runs them
    const phases = [...new Set(s.rows.map(r => r[9]).filter(Boolean))].sort((x, y) => phaseRank(x) - phaseRank(y) || (x < y ? -1 : 1));
    sec.appendChild(el("h2", null, s.name === "forward" ? "API calls" + (phases.length ? " (" + phases.join(", ") + ")" : "")
                                                        : "Backward grad-node steps"));
    sec.appendChild(el("div", "summary", s.summary));
    if (s.origin && s.origin.difference) sec.appendChild(el("div", "note", "At the origin: " + s.origin.difference));
    if (s.graph.nodes.length) {
      sec.appendChild(el("div", "note", "Around the first divergence (trace " + s.graph.side +
          "): inputs on the left, what consumed the outputs to the right."));
      sec.appendChild(graph(s.graph));
    }
    if (s.origin) sec.appendChild(stacks(s));
    sec.appendChild(table(s));
    main.appendChild(sec);
    // stacks are outermost first: start scrolled to the innermost frames, the user's line
    for (const pre of sec.querySelectorAll(".stacks .stack")) pre.scrollTop = pre.scrollHeight;
  }
  if (data.modules.length) {
    const sec = el("section"); sec.appendChild(el("h2", null, "Per module"));
    const t = el("table"), head = el("tr");
    for (const h of ["module", "forward differing", "backward differing", "after backward", "max abs", "max rel", "of"]) head.appendChild(el("th", null, h));
    t.appendChild(head);
    for (const m of data.modules) {
      const tr = el("tr", m.origin ? "origin-module" : "");
      // as the console's module_size: shapes that differ have no number, so they never are the largest
      const shapesOnly = m.shapes_differ && !m.max_abs && !m.max_rel;
      const size = shapesOnly ? [SHAPES_DIFFER, ""] : m.checksum_only ? [CHECKSUM_ONLY, ""]
          : [fmt(m.max_abs) + (m.shapes_differ ? ", " + SHAPES_DIFFER : ""), fmt(m.max_rel)];
      for (const x of [m.module || "<root>", m.forward, m.backward, m.after_backward, size[0], size[1],
                       shapesOnly ? "" : BASIS[m.basis] || ""]) tr.appendChild(el("td", null, x));
      t.appendChild(tr);
    }
    sec.appendChild(t); main.appendChild(sec);
  }
  if (data.params.length) {
    // parameters and buffers named apart: a buffer (running statistics, a rotary table) is no parameter
    const buffers = data.params.filter(p => p.buffer).length;
    const noun = buffers === 0 ? "Parameters" : buffers === data.params.length ? "Buffers" : "Parameters and buffers";
    const sec = el("section"); sec.appendChild(el("h2", null, noun + " that differ"));
    // of those both traces have; those one trace alone has counted apart (never compared)
    if (data.params_of) sec.appendChild(el("div", "note", data.params_of));
    const t = el("table"), head = el("tr");
    for (const h of ["parameter", "value", "gradient", "after step"]) head.appendChild(el("th", null, h));
    t.appendChild(head);
    const cell = c => c === null ? "-" : c.checksum_only ? CHECKSUM_ONLY :
        c.status + (c.difference && c.status === "differ" ? " (" + c.difference + ")" : "");
    for (const p of data.params) {
      const tr = el("tr");
      for (const x of [p.name + (p.buffer ? " (buffer)" : ""), p.only_in ? "only in " + p.only_in : cell(p.value), cell(p.grad), cell(p.updated)]) tr.appendChild(el("td", null, x));
      t.appendChild(tr);
    }
    sec.appendChild(t); main.appendChild(sec);
  }
  const first = document.querySelector("tr.origin");
  if (first) first.scrollIntoView({block: "center"});
})();
