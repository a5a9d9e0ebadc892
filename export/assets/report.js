/* gradtrace HTML report: draws the payload embedded in #gt-data (see export/html/data.py).
 *
 * Two graphs side by side on one canvas: forward calls (left, flowing down) and backward grad
 * nodes (right, flowing up, so a layer's gradients sit level with its forward calls). Both fold
 * by the same group tree (module invocations, custom Functions, long runs from one source line),
 * laid out group by group with dagre and cached, so expanding a box re-lays out only the boxes
 * around it. Every string from the trace reaches the page through textContent or setAttribute,
 * never through HTML parsing, and is shown with its control, format and invisible characters
 * escaped (shown()).
 */
(function () {
  'use strict';
  const T0 = performance.now();
  const SVGNS = 'http://www.w3.org/2000/svg';
  const D = JSON.parse(document.getElementById('gt-data').textContent);

  // ---- strings of the trace --------------------------------------------------------------
  // Shown as the terminal shows them (tracer.model.display.inert; D.unsafe is the same set):
  // control, format (Unicode Cf) and invisible characters as escapes, so that "lin\u200bear0"
  // never reads as "linear0" and a bidi override never reorders a line. Keys stay raw.
  const UNSAFE = new RegExp(D.unsafe, 'gu');
  const NAMED = { '\n': '\\n', '\r': '\\r', '\t': '\\t' };
  function hex(c, n) { return c.toString(16).padStart(n, '0'); }
  function shown(s) {
    return String(s).replace(UNSAFE, function (ch) {
      if (NAMED[ch]) return NAMED[ch];
      const c = ch.codePointAt(0);
      return c < 0x100 ? '\\x' + hex(c, 2) : c < 0x10000 ? '\\u' + hex(c, 4) : '\\U' + hex(c, 8);
    });
  }
  // a tooltip of several lines: the page's own newlines stay, every line's text is shown()
  function shownLines(s) { return String(s).split('\n').map(shown).join('\n'); }

  // ---- data ------------------------------------------------------------------------------
  function table(t) {
    return t.rows.map(function (r) {
      const o = {};
      for (let i = 0; i < t.fields.length; i++) o[t.fields[i]] = r[i];
      return o;
    });
  }
  const calls = table(D.calls), nodes = table(D.nodes), groups = table(D.groups), tensorRows = table(D.tensors);
  const S = D.summary;
  const tensors = new Map(), callByName = new Map(), nodeByName = new Map();
  tensorRows.forEach(function (t) { tensors.set(t.name, t); });
  calls.forEach(function (c, i) { c.idx = i; callByName.set(c.name, c); });
  nodes.forEach(function (n, i) { n.idx = i; nodeByName.set(n.name, n); });
  const runByName = new Map();
  D.runs.forEach(function (r) { runByName.set(r.name, r); });
  const consumers = new Map();   // tensor name -> calls that read it
  calls.forEach(function (c) {
    c.inputs.forEach(function (t) {
      if (!consumers.has(t)) consumers.set(t, []);
      consumers.get(t).push(c.idx);
    });
  });

  // The numerics report's story (tracer.analysis.numerics, in the payload) decides what is red:
  // the values holding a NaN or an unintended Inf it counts. An intended Inf (a -inf mask) and a
  // value no later value keeps are marked too, in grey, never as a fault.
  const NUM = S.numerics || {};
  const counted = new Set(NUM.values || []);
  function isBadTensor(name) { return !!name && counted.has(name); }
  // 'nan', 'inf' (counted: red), 'mask' (an Inf that is not a fault), or '' (finite, or no stats)
  function tensorMark(name) {
    const t = name && tensors.get(name);
    if (!t || !t.stats || !(t.stats[4] > 0 || t.stats[5] > 0)) return '';
    if (counted.has(name)) return t.stats[4] > 0 ? 'nan' : 'inf';
    return 'mask';
  }
  const MARK_RANK = { '': 0, mask: 1, inf: 2, nan: 3 };
  function worstMark(names) {
    let m = '';
    names.forEach(function (x) { const k = tensorMark(x); if (MARK_RANK[k] > MARK_RANK[m]) m = k; });
    return m;
  }
  // A badge goes on the side where the value was non-finite: on a call when one of its outputs
  // was, on a grad node when a gradient it received or produced was.
  calls.forEach(function (c) { c.mark = worstMark(c.outputs); c.bad = c.mark === 'nan' || c.mark === 'inf'; });
  nodes.forEach(function (n) { n.mark = worstMark(n.grads_out.concat(n.grads_in)); n.bad = n.mark === 'nan' || n.mark === 'inf'; });

  // group tree: children, ancestor chains, first item (for ordering), bad counts per side
  groups.forEach(function (g, i) { g.idx = i; g.kids = []; g.calls = []; g.nodes = []; g.first = Infinity; g.badF = 0; g.badB = 0; g.nanF = false; g.nanB = false; });
  groups.forEach(function (g) { if (g.parent !== null) groups[g.parent].kids.push(g.idx); });
  const anc = groups.map(function (g) {
    const chain = [];
    for (let x = g.idx; x !== null; x = groups[x].parent) chain.push(x);
    return chain.reverse();
  });
  calls.forEach(function (c) {
    const g = groups[c.group];
    if (g.call === c.idx) c.head = g.idx; else g.calls.push(c.idx);
    anc[c.group].forEach(function (a) {
      if (groups[a].first > c.idx) groups[a].first = c.idx;
      // a call made while backward ran (a custom Function's backward) computed a backward value
      if (c.bad) {
        if (c.phase === 'backward') { groups[a].badB++; groups[a].nanB = groups[a].nanB || c.mark === 'nan'; }
        else { groups[a].badF++; groups[a].nanF = groups[a].nanF || c.mark === 'nan'; }
      }
    });
  });
  nodes.forEach(function (n) {
    groups[n.group].nodes.push(n.idx);
    anc[n.group].forEach(function (a) {
      if (groups[a].first === Infinity) groups[a].first = calls.length + n.idx;
      if (n.bad) { groups[a].badB++; groups[a].nanB = groups[a].nanB || n.mark === 'nan'; }
    });
  });
  groups.forEach(function (g) { g.kids.sort(function (a, b) { return groups[a].first - groups[b].first; }); });

  // ---- state -----------------------------------------------------------------------------
  const st = {
    open: new Set(D.open), side: 'both', root: 0, sel: null, hits: new Set(),
    view: { x: 20, y: 10, k: 1 }, tab: 'graph',
  };
  const cache = { f: new Map(), b: new Map() };
  function isOpen(gi) { return gi === st.root || st.open.has(gi); }
  function inView(gi) { return anc[gi].indexOf(st.root) >= 0; }

  // ---- labels and sizes ------------------------------------------------------------------
  const CH = 6.65, PADX = 10, NODE_H = 34, BOX_PAD = 10, BOX_HEAD = 20;
  function clip(s, n) { s = String(s); return s.length <= n ? s : s.slice(0, n - 1) + '…'; }
  function shapeText(shape) { return shape && shape.length ? shape.join('×') : 'scalar'; }
  function shortApi(api) {
    return api.replace(/^torch\.nn\.functional\./, 'F.').replace(/^torch\./, 'torch.');
  }
  function outText(c) {
    if (c.outputs.length === 0) return shortApi(c.api);
    const t = tensors.get(c.outputs[0]);
    let s = t ? shapeText(t.shape) + (t.dtype !== 'float32' ? ' ' + t.dtype : '') : '';
    if (c.outputs.length > 1) s += ' (+' + (c.outputs.length - 1) + ')';
    return s;
  }
  function plural(n, w) { return n + ' ' + w + (n === 1 ? '' : 's'); }
  function groupTitle(g) { return g.label + (g.cls && g.label.indexOf(g.cls) !== 0 ? ' · ' + g.cls : ''); }
  function itemLabel(key, side) {
    const kind = key[0], i = +key.slice(1);
    if (kind === 'c') { const c = calls[i]; return [c.name, outText(c)]; }
    if (kind === 'n') {
      const n = nodes[i];
      return [n.kind, n.param ? '→ ' + n.param : (n.external ? 'external' : '← ' + (n.call || ''))];
    }
    const g = groups[i];
    const count = side === 'f' ? plural(g.ncalls, 'call') : plural(g.nnodes, 'grad node');
    return ['▸ ' + groupTitle(g), g.kind === 'function' ? count + ' inside' : count];
  }
  function groupBad(g, side) { return side === 'f' ? g.badF : g.badB; }
  // The badge of a box: NaN / Inf (red, counted by the story), mask (grey: not a fault)
  function itemMark(key, side) {
    const i = +key.slice(1);
    if (key[0] === 'c') return calls[i].mark;
    if (key[0] === 'n') return nodes[i].mark;
    const g = groups[i];
    return groupBad(g, side) > 0 ? ((side === 'f' ? g.nanF : g.nanB) ? 'nan' : 'inf') : '';
  }
  const MARK_TEXT = { nan: 'NaN', inf: 'Inf', mask: 'mask' };
  function isBadKey(key, side) {
    const i = +key.slice(1);
    return key[0] === 'c' ? calls[i].bad : key[0] === 'n' ? nodes[i].bad : groupBad(groups[i], side) > 0;
  }
  function itemSize(key, side) {
    const l = itemLabel(key, side);
    const n = Math.max(clip(l[0], 40).length + (itemMark(key, side) ? 5 : 0), clip(l[1], 40).length);
    return { w: Math.max(64, Math.ceil(n * CH) + 2 * PADX), h: key[0] === 'g' ? NODE_H + 4 : NODE_H };
  }

  // ---- edges, lifted once to the level where they are laid out ----------------------------
  // An edge between two items is laid out in their lowest common group, between the children
  // of that group that contain them. Heads (a Function call that has a group) live as that group.
  function leafOf(key) {
    const kind = key[0], i = +key.slice(1);
    if (kind === 'c') {
      const c = calls[i];
      if (c.head !== undefined) return { chain: anc[groups[c.head].parent], key: 'g' + c.head, g: c.head };
      return { chain: anc[c.group], key: key, g: c.group };
    }
    return { chain: anc[nodes[i].group], key: key, g: nodes[i].group };
  }
  // An edge is laid out piecewise: inside each group around its source it runs from the child
  // holding the source to that group's exit '$'; in the lowest common group from child to child;
  // inside each group around its target from the entry '^' to the child holding the target.
  // So a residual connection is routed around the boxes it skips, not drawn through them.
  function prepEdges(list, prefix) {
    const out = [];
    list.forEach(function (e) {
      const a = prefix + e[0], b = prefix + e[1];
      const A = leafOf(a), B = leafOf(b);
      let k = 0;
      while (k + 1 < A.chain.length && k + 1 < B.chain.length && A.chain[k + 1] === B.chain[k + 1]) k++;
      const ca = A.chain.length > k + 1 ? 'g' + A.chain[k + 1] : A.key;
      const cb = B.chain.length > k + 1 ? 'g' + B.chain[k + 1] : B.key;
      if (ca === cb) return;
      out.push({ a: a, b: b, A: A, B: B, k: k, lca: A.chain[k], ca: ca, cb: cb, what: e[2] });
    });
    return out;
  }
  function childAt(L, j) { return j === L.chain.length - 1 ? L.key : 'g' + L.chain[j + 1]; }
  const edges = { f: prepEdges(D.fwd_edges, 'c'), b: prepEdges(D.bwd_edges, 'n') };
  const edgesAt = { f: new Map(), b: new Map() };   // group -> Map('x|y' -> count)
  function addPair(s, g, id) {
    if (!edgesAt[s].has(g)) edgesAt[s].set(g, new Map());
    const m = edgesAt[s].get(g);
    m.set(id, (m.get(id) || 0) + 1);
  }
  ['f', 'b'].forEach(function (s) {
    edges[s].forEach(function (e) {
      for (let j = e.A.chain.length - 1; j > e.k; j--) addPair(s, e.A.chain[j], childAt(e.A, j) + '|$');
      addPair(s, e.lca, e.ca + '|' + e.cb);
      for (let j = e.k + 1; j < e.B.chain.length; j++) addPair(s, e.B.chain[j], '^|' + childAt(e.B, j));
    });
  });

  // ---- layout ------------------------------------------------------------------------------
  function childrenOf(gi, side) {
    const g = groups[gi], out = [];
    g.kids.forEach(function (k) {
      if ((side === 'f' ? groups[k].ncalls : groups[k].nnodes) > 0) out.push('g' + k);
    });
    if (side === 'f') g.calls.forEach(function (c) { out.push('c' + c); });
    else g.nodes.forEach(function (n) { out.push('n' + n); });
    return out;
  }
  function firstOf(key) {
    const i = +key.slice(1);
    return key[0] === 'g' ? groups[i].first : key[0] === 'c' ? i : calls.length + i;
  }

  function layoutGroup(gi, side) {
    const hit = cache[side].get(gi);
    if (hit) return hit;
    const kids = childrenOf(gi, side).sort(function (a, b) { return firstOf(a) - firstOf(b); });
    const size = new Map();
    kids.forEach(function (k) {
      const i = +k.slice(1);
      if (k[0] === 'g' && isOpen(i)) {
        const sub = layoutGroup(i, side);
        size.set(k, { w: Math.max(sub.w + 2 * BOX_PAD, groupTitle(groups[i]).length * CH + 30),
                      h: sub.h + BOX_HEAD + BOX_PAD, open: true });
      } else {
        size.set(k, itemSize(k, side));
      }
    });
    // only pairs between children drawn on this side (a folded child hides its own pairs)
    const present = new Set(kids);
    present.add('^'); present.add('$');
    const pairs = new Map();
    (edgesAt[side].get(gi) || new Map()).forEach(function (n, id) {
      const ab = id.split('|');
      if (present.has(ab[0]) && present.has(ab[1])) pairs.set(id, n);
    });
    pairs.forEach(function (n, id) {
      id.split('|').forEach(function (v) {
        // in the middle of the order: dagre breaks ties by it, so the entry/exit sits central
        if ((v === '^' || v === '$') && !size.has(v)) { size.set(v, { w: 2, h: 2 }); kids.splice(kids.length >> 1, 0, v); }
      });
    });
    const out = { w: 0, h: 0, pos: new Map(), routes: new Map() };
    if (kids.length === 0) { cache[side].set(gi, out); return out; }
    const comps = componentsOf(kids, pairs);
    if (comps.length === 1) dagreLayout(kids, size, pairs, side, out);
    else stackLayout(comps, size, pairs, side, out);
    cache[side].set(gi, out);
    return out;
  }

  // Unconnected pieces of one group (a loss and the optimizer step after it) are stacked in
  // execution order instead of side by side; runs of lone items are packed into a grid.
  function componentsOf(kids, pairs) {
    const up = new Map();
    kids.forEach(function (k) { up.set(k, k); });
    function find(x) { while (up.get(x) !== x) { up.set(x, up.get(up.get(x))); x = up.get(x); } return x; }
    pairs.forEach(function (n, id) { const ab = id.split('|'); up.set(find(ab[0]), find(ab[1])); });
    const by = new Map();
    kids.forEach(function (k) { const r = find(k); if (!by.has(r)) by.set(r, []); by.get(r).push(k); });
    return Array.from(by.values());   // kids are in execution order, so are the components
  }
  function stackLayout(comps, size, pairs, side, out) {
    const blocks = [];
    let run = [];
    comps.forEach(function (c) {
      if (c.length === 1) { run.push(c[0]); return; }
      if (run.length) blocks.push({ grid: run });
      run = [];
      blocks.push({ dag: c });
    });
    if (run.length) blocks.push({ grid: run });
    const parts = blocks.map(function (b) {
      const o = { w: 0, h: 0, pos: new Map(), routes: new Map() };
      if (b.grid) gridLayout(b.grid, size, o);
      else {
        const mine = new Map();
        const set = new Set(b.dag);
        pairs.forEach(function (n, id) { if (set.has(id.split('|')[0])) mine.set(id, n); });
        dagreLayout(b.dag, size, mine, side, o);
      }
      return o;
    });
    const W = Math.max.apply(null, parts.map(function (p) { return p.w; }));
    let y = 0;
    parts.forEach(function (p) {
      const dx = (W - p.w) / 2, dy = y;
      p.pos.forEach(function (v, k) { out.pos.set(k, { x: v.x + dx, y: v.y + dy, w: v.w, h: v.h }); });
      p.routes.forEach(function (pts, id) { out.routes.set(id, pts.map(function (q) { return { x: q.x + dx, y: q.y + dy }; })); });
      y += p.h + 30;
    });
    out.w = W; out.h = y - 30;
  }

  function gridLayout(kids, size, out) {
    const colW = Math.max.apply(null, kids.map(function (k) { return size.get(k).w; }));
    const cols = Math.max(1, Math.min(kids.length, Math.ceil(Math.sqrt(kids.length * 0.6)), Math.floor(900 / (colW + 14)) || 1));
    let y = 0, rowH = 0;
    kids.forEach(function (k, j) {
      const s = size.get(k), col = j % cols;
      if (col === 0 && j) { y += rowH + 14; rowH = 0; }
      out.pos.set(k, { x: col * (colW + 14) + colW / 2, y: y + s.h / 2, w: s.w, h: s.h });
      rowH = Math.max(rowH, s.h);
    });
    out.w = cols * (colW + 14) - 14;
    out.h = y + rowH;
  }

  function dagreLayout(kids, size, pairs, side, out) {
    const g = new dagre.graphlib.Graph();
    g.setGraph({ rankdir: side === 'f' ? 'TB' : 'BT', nodesep: 16, ranksep: 26, edgesep: 8, marginx: 0, marginy: 0 });
    g.setDefaultEdgeLabel(function () { return {}; });
    kids.forEach(function (k) { const s = size.get(k); g.setNode(k, { width: s.w, height: s.h }); });
    pairs.forEach(function (n, id) {
      const ab = id.split('|');
      // the exit '$' goes a rank past its sources so the line leaves above/below the row of
      // leaves (AccumulateGrad) instead of running under them
      g.setEdge(ab[0], ab[1], { weight: Math.min(n, 5), minlen: ab[1] === '$' ? 2 : 1 });
    });
    dagre.layout(g);
    kids.forEach(function (k) {
      const n = g.node(k);
      out.pos.set(k, { x: n.x, y: n.y, w: n.width, h: n.height });
    });
    g.edges().forEach(function (e) { out.routes.set(e.v + '|' + e.w, g.edge(e).points || []); });
    const gr = g.graph();
    out.w = gr.width || 0; out.h = gr.height || 0;
  }

  // Absolute placement of one side: rectangles for visible items and open boxes.
  function placeSide(side, ox, oy) {
    const P = { rects: new Map(), boxes: [], origin: new Map(), side: side, w: 0, h: 0 };
    const top = layoutGroup(st.root, side);
    P.w = top.w; P.h = top.h;
    (function place(gi, x0, y0) {
      const L = layoutGroup(gi, side);
      P.origin.set(gi, { x: x0, y: y0 });
      L.pos.forEach(function (p, k) {
        if (k === '^' || k === '$') return;
        const x = x0 + p.x - p.w / 2, y = y0 + p.y - p.h / 2;
        const i = +k.slice(1);
        if (k[0] === 'g' && isOpen(i)) {
          P.boxes.push({ g: i, x: x, y: y, w: p.w, h: p.h });
          P.rects.set(k, { x: x, y: y, w: p.w, h: p.h, box: true });
          place(i, x + BOX_PAD + (p.w - 2 * BOX_PAD - layoutGroup(i, side).w) / 2, y + BOX_HEAD);
        } else {
          P.rects.set(k, { x: x, y: y, w: p.w, h: p.h });
        }
      });
    })(st.root, ox, oy);
    return P;
  }

  // The visible item standing for a leaf: itself, or the outermost folded group around it.
  function repOf(key) {
    const L = leafOf(key);
    const chain = L.chain;
    const start = chain.indexOf(st.root);
    if (start < 0) return null;
    for (let j = start + 1; j < chain.length; j++) if (!isOpen(chain[j])) return 'g' + chain[j];
    return L.key;
  }

  // ---- drawing ------------------------------------------------------------------------------
  const svg = document.getElementById('gt-svg');
  const vp = document.getElementById('gt-vp');
  let layoutState = null;

  function S_(tag, attrs, parent) {
    const e = document.createElementNS(SVGNS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function text(parent, x, y, s, cls) {
    const t = S_('text', { x: x, y: y, class: cls || '' }, parent);
    t.textContent = shown(s);
    return t;
  }
  function pathD(pts) {
    if (pts.length < 2) return '';
    let d = 'M' + pts[0].x.toFixed(1) + ',' + pts[0].y.toFixed(1);
    if (pts.length === 2) return d + 'L' + pts[1].x.toFixed(1) + ',' + pts[1].y.toFixed(1);
    // uniform B-spline through the bend points (what dagre-d3 draws): smooth, stays near them
    for (let i = 1; i < pts.length - 1; i++) {
      const p = pts[i], q = pts[i + 1];
      const mx = i === pts.length - 2 ? q.x : (p.x + q.x) / 2, my = i === pts.length - 2 ? q.y : (p.y + q.y) / 2;
      d += 'Q' + p.x.toFixed(1) + ',' + p.y.toFixed(1) + ' ' + mx.toFixed(1) + ',' + my.toFixed(1);
    }
    return d;
  }

  function render() {
    const t0 = performance.now();
    while (vp.firstChild) vp.removeChild(vp.firstChild);
    const sides = st.side === 'both' ? ['f', 'b'] : [st.side === 'fwd' ? 'f' : 'b'];
    const placed = {};
    let x = 0;
    sides.forEach(function (s) {
      placed[s] = placeSide(s, x, 44);
      placed[s].x0 = x;
      x += Math.max(placed[s].w, 260) + 140;
    });
    layoutState = placed;
    const gEdges = S_('g', {}, null), gBoxes = S_('g', {}, null), gNodes = S_('g', {}, null);
    const gLinks = S_('g', { id: 'gt-links' }, null), gTitles = S_('g', {}, null);
    vp.appendChild(gBoxes); vp.appendChild(gEdges); vp.appendChild(gTitles); vp.appendChild(gNodes); vp.appendChild(gLinks);
    let count = 0;
    sides.forEach(function (s) {
      const P = placed[s];
      text(vp, P.x0, 14, s === 'f' ? 'Forward · calls' : 'Backward · grad nodes', 'side-title');
      text(vp, P.x0, 30, s === 'f' ? 'data flows down; click a box to unfold it'
        : 'gradients flow up from the loss; each node links to its call', 'side-sub');
      P.boxes.forEach(function (b) { drawBox(gBoxes, b, s, gTitles); });
      P.rects.forEach(function (r, k) { if (!r.box) { drawItem(gNodes, k, r, s); count++; } });
      drawEdges(gEdges, P, s);
    });
    drawLinks();
    applyTransform();
    st.lastRenderMs = performance.now() - t0;
    st.visibleCount = count;
    document.getElementById('gt-count').textContent = count + ' boxes shown';
    updateLevelButton();
  }

  function keyAttrs(k, s) {
    const i = +k.slice(1);
    if (k[0] === 'c') return { 'data-key': s + k, 'data-name': calls[i].name };
    if (k[0] === 'n') return { 'data-key': s + k, 'data-name': nodes[i].name };
    return { 'data-key': s + k, 'data-group': groups[i].id };
  }

  function drawItem(parent, k, r, s) {
    const i = +k.slice(1);
    let cls = 'n';
    let bad = false;
    if (k[0] === 'c') { cls += ' call'; bad = calls[i].bad; if (calls[i].phase === 'backward') cls += ' bwdphase'; }
    else if (k[0] === 'n') {
      cls += ' node'; bad = nodes[i].bad;
      if (nodes[i].kind === 'AccumulateGrad') cls += ' acc';
      if (nodes[i].external) cls += ' ext';
    } else {
      cls += ' fold'; bad = groupBad(groups[i], s) > 0;
      if (groups[i].kind === 'function') cls += ' fn';
    }
    if (bad) cls += ' bad';
    const a = keyAttrs(k, s);
    a.class = cls; a.transform = 'translate(' + r.x.toFixed(1) + ',' + r.y.toFixed(1) + ')';
    const g = S_('g', a, parent);
    if (k[0] === 'g') S_('rect', { class: 'under', x: 3, y: 3, width: r.w, height: r.h, rx: 5 }, g);
    S_('rect', { class: 'body', width: r.w, height: r.h, rx: 5 }, g);
    const l = itemLabel(k, s);
    text(g, PADX, 14, clip(l[0], 40), 'l1');
    text(g, PADX, 27, clip(l[1], 40), 'l2');
    const mark = itemMark(k, s);
    if (mark) text(g, r.w - 30, 13, MARK_TEXT[mark], mark === 'mask' ? 'masktag' : 'badtag').setAttribute('data-mark', mark);
    const tip = S_('title', {}, g);
    tip.textContent = shownLines(tooltip(k));
  }

  function tooltip(k) {
    const i = +k.slice(1);
    if (k[0] === 'c') { const c = calls[i]; return c.name + '  ' + c.api + (c.module ? '\nmodule ' + c.module : ''); }
    if (k[0] === 'n') { const n = nodes[i]; return n.name + (n.call ? '\ncall ' + n.call : ''); }
    const g = groups[i];
    return (g.path || g.label) + (g.cls ? ' (' + g.cls + ')' : '') + '\n' + plural(g.ncalls, 'call') + ', ' +
      plural(g.nnodes, 'grad node') + (g.where ? '\n' + g.where : '') + '\nclick to unfold';
  }

  function drawBox(parent, b, s, titles) {
    const g = groups[b.g];
    let cls = 'box' + (g.kind === 'function' ? ' fn' : '') + (groupBad(g, s) ? ' bad' : '');
    if (st.sel && st.sel.type === 'group' && st.sel.idx === b.g) cls += ' sel';
    const a = keyAttrs('g' + b.g, s);
    a.class = cls;
    const e = S_('g', a, parent);
    S_('rect', { x: b.x, y: b.y, width: b.w, height: b.h, rx: 8 }, e);
    // the title sits in a layer above the edges (with a halo), so lines never hide it
    const tg = S_('g', { class: 'box-head', 'data-key': s + 'g' + b.g, 'data-group': g.id }, titles);
    const t = text(tg, b.x + 8, b.y + 14, '▾ ' + clip(groupTitle(g), Math.max(8, Math.floor((b.w - 24) / 6.6))), 'box-title');
    t.setAttribute('data-fold', '1');
    const tip = S_('title', {}, t);
    tip.textContent = shown(g.path || g.label) + '\nclick to fold';
  }

  function anchor(r, out, s) {
    // forward flows down (out at the bottom), backward up (out at the top)
    const down = s === 'f';
    return { x: r.x + r.w / 2, y: (out === down) ? r.y + r.h : r.y };
  }

  function drawEdges(parent, P, s) {
    const seen = new Set();
    const selKey = selectedKey(s);
    edges[s].forEach(function (e) {
      const ra = repOf(e.a), rb = repOf(e.b);
      if (!ra || !rb || ra === rb) return;
      const id = ra + '|' + rb;
      if (seen.has(id)) return;
      seen.add(id);
      const A = P.rects.get(ra), B = P.rects.get(rb);
      if (!A || !B) return;
      const pts = [anchor(A, true, s)];
      function leg(g, pair, dropFirst, dropLast) {
        const L = layoutGroup(g, s), o = P.origin.get(g);
        let r = (L && o && L.routes.get(pair)) || [];
        // between adjacent ranks dagre's only bend is its label slot, near the source's centre:
        // meaningless once the edge starts elsewhere, so such a leg is drawn straight
        if (r.length === 3) r = [r[0], r[2]];
        for (let j = dropFirst ? 1 : 0; j < r.length - (dropLast ? 1 : 0); j++) pts.push({ x: r[j].x + o.x, y: r[j].y + o.y });
      }
      // open groups around the source, innermost first (stop at the first folded one)
      let ja = e.k + 1;
      while (ja < e.A.chain.length && isOpen(e.A.chain[ja])) ja++;
      // Each leg's end points lie on box borders; where legs meet, the exit '$' / entry '^' of the
      // inner box already marks the spot, so those border points are dropped (no kinks or loops).
      let jb = e.k + 1;
      while (jb < e.B.chain.length && isOpen(e.B.chain[jb])) jb++;
      for (let j = ja - 1; j > e.k; j--) leg(e.A.chain[j], childAt(e.A, j) + '|$', true, false);
      leg(e.lca, e.ca + '|' + e.cb, true, true);
      for (let j = e.k + 1; j < jb; j++) leg(e.B.chain[j], '^|' + childAt(e.B, j), true, true);
      pts.push(anchor(B, false, s));
      let cls = 'e' + (s === 'b' ? ' b' : '');
      if (selKey && (ra === selKey || rb === selKey)) cls += ' hl';
      const p = S_('path', { d: pathD(pts), class: cls, 'marker-end': 'url(#gt-arrow-' + (cls.indexOf('hl') >= 0 ? 'h' : s) + ')' }, parent);
      if (s === 'f' && e.what) {
        const tip = S_('title', {}, p);
        tip.textContent = e.what.map(function (n) {
          const t = tensors.get(n);
          return shown(n) + (t ? '  ' + shapeText(t.shape) + ' ' + shown(t.dtype) : '');
        }).join('\n');
      }
    });
  }

  // The key (on side s) of what stands for the selection there, if anything.
  function selectedKey(s) {
    const x = st.sel;
    if (!x) return null;
    if (x.type === 'call' && s === 'f') return repOf('c' + x.idx);
    if (x.type === 'node' && s === 'b') return repOf('n' + x.idx);
    if (x.type === 'group') return 'g' + x.idx;
    return null;
  }
  function mates() {
    // what the selection links to on the other side: a call's grad nodes, a node's call
    const x = st.sel;
    if (!x) return [];
    if (x.type === 'call') {
      return calls[x.idx].grad_nodes.filter(function (n) { return nodeByName.has(n); })
        .map(function (n) { return { s: 'b', key: repOf('n' + nodeByName.get(n).idx) }; });
    }
    if (x.type === 'node') {
      const c = callByName.get(nodes[x.idx].call);
      return c ? [{ s: 'f', key: repOf('c' + c.idx) }] : [];
    }
    return [];
  }

  function drawLinks() {
    const gl = document.getElementById('gt-links');
    while (gl.firstChild) gl.removeChild(gl.firstChild);
    document.querySelectorAll('.n.sel, .n.mate').forEach(function (e) { e.classList.remove('sel', 'mate'); });
    document.querySelectorAll('.n.hit').forEach(function (e) { e.classList.remove('hit'); });
    st.hits.forEach(function (k) {
      document.querySelectorAll('[data-key="' + k + '"]').forEach(function (e) { e.classList.add('hit'); });
    });
    const x = st.sel;
    if (!x || !layoutState) return;
    if (x.type === 'group') {   // a folded group: both of its boxes
      vp.querySelectorAll('.n[data-key="fg' + x.idx + '"], .n[data-key="bg' + x.idx + '"]').forEach(function (e) { e.classList.add('sel'); });
      return;
    }
    const own = x.type === 'call' ? 'f' : x.type === 'node' ? 'b' : null;
    const key = own ? selectedKey(own) : null;
    if (key) {
      const e = vp.querySelector('[data-key="' + own + key + '"]');
      if (e) e.classList.add('sel');
    }
    mates().forEach(function (m) {
      if (!m.key) return;
      const e = vp.querySelector('[data-key="' + m.s + m.key + '"]');
      if (e) e.classList.add('mate');
      const P = layoutState[own], Q = layoutState[m.s];
      if (!P || !Q || !key) return;
      const A = P.rects.get(key), B = Q.rects.get(m.key);
      if (!A || !B) return;
      const ax = own === 'f' ? A.x + A.w : A.x, bx = m.s === 'f' ? B.x + B.w : B.x;
      const ay = A.y + A.h / 2, by = B.y + B.h / 2, mx = (ax + bx) / 2;
      S_('path', { class: 'lk', d: 'M' + ax + ',' + ay + 'C' + mx + ',' + ay + ' ' + mx + ',' + by + ' ' + bx + ',' + by }, gl);
    });
  }

  // ---- pan and zoom ---------------------------------------------------------------------------
  function applyTransform() {
    vp.setAttribute('transform', 'translate(' + st.view.x.toFixed(1) + ',' + st.view.y.toFixed(1) + ') scale(' + st.view.k.toFixed(4) + ')');
    updateScrollbar();
  }
  // A vertical scrollbar for a graph taller than the view (after "fit", which fits the width):
  // the thumb shows which part is on screen; dragging it, or the wheel, scrolls.
  const vbar = document.getElementById('gt-vscroll'), vthumb = document.getElementById('gt-vthumb');
  const TOP = 10;   // the margin above the graph at the top of the scroll range
  const TRACK_INSET = 48;   // #gt-vscroll's top + bottom in report.css
  // The view's height, measured on fit and on resize only: reading layout while drawing would
  // force the browser to lay out a thousand fresh boxes twice.
  let viewH = 0;
  function measureView() { viewH = svg.getBoundingClientRect().height; }
  function scrollRange() {
    // the view.y values that keep the graph in view: from its top (TOP) to its bottom at the view's bottom
    const h = contentBox().h * st.view.k;
    return { min: Math.min(TOP, viewH - h - TOP), max: TOP, H: viewH, h: h };
  }
  function updateScrollbar() {
    const r = scrollRange();
    const show = st.tab === 'graph' && r.H > 0 && r.h + 2 * TOP > r.H + 1;
    vbar.classList.toggle('on', show);
    if (!show) return;
    const track = r.H - TRACK_INSET;
    const size = Math.max(24, track * r.H / (r.h + 2 * TOP));
    const at = r.max === r.min ? 0 : (r.max - Math.min(r.max, Math.max(r.min, st.view.y))) / (r.max - r.min);
    vthumb.style.height = size.toFixed(0) + 'px';
    vthumb.style.top = ((track - size) * at).toFixed(0) + 'px';
  }
  function scrollTo(y) {
    const r = scrollRange();
    st.view.y = Math.min(r.max, Math.max(r.min, y));
    applyTransform();
  }
  (function dragThumb() {
    let grab = null;
    vthumb.addEventListener('pointerdown', function (ev) {
      ev.preventDefault(); ev.stopPropagation();
      grab = { y: ev.clientY, vy: st.view.y };
      vthumb.setPointerCapture(ev.pointerId);
    });
    vthumb.addEventListener('pointermove', function (ev) {
      if (!grab) return;
      const r = scrollRange(), track = r.H - TRACK_INSET;
      const size = vthumb.getBoundingClientRect().height;
      scrollTo(grab.vy - (ev.clientY - grab.y) * (r.max - r.min) / Math.max(1, track - size));
    });
    vthumb.addEventListener('pointerup', function () { grab = null; });
    vbar.addEventListener('pointerdown', function (ev) {   // a click on the track pages up or down
      if (ev.target !== vbar) return;
      const t = vthumb.getBoundingClientRect();
      scrollTo(st.view.y + (ev.clientY < t.top ? 1 : -1) * (scrollRange().H - 40));
    });
  })();
  function contentBox() {
    let w = 0, h = 0;
    if (!layoutState) return { w: 1, h: 1 };
    Object.keys(layoutState).forEach(function (s) {
      const P = layoutState[s];
      w = Math.max(w, P.x0 + Math.max(P.w, 260));
      h = Math.max(h, P.h + 44);
    });
    return { w: w, h: h };
  }
  function fit() {
    // Fit the width, not the whole graph: a 12-layer model shrunk to the view's height is an
    // unreadable ribbon. The top of the graph shows; the wheel or the scrollbar scrolls down.
    const r = svg.getBoundingClientRect(), c = contentBox();
    viewH = r.height;
    if (r.width < 50 || r.height < 50) { st.fitLater = true; return; }  // hidden (a closed <details>)
    const k = Math.max(0.05, Math.min(1.1, (r.width - 40) / c.w));
    st.view = { k: k, x: Math.max(20, (r.width - c.w * k) / 2), y: TOP };
    applyTransform();
  }
  function zoomAt(px, py, f) {
    const k = Math.max(0.03, Math.min(4, st.view.k * f));
    st.view.x = px - (px - st.view.x) * (k / st.view.k);
    st.view.y = py - (py - st.view.y) * (k / st.view.k);
    st.view.k = k;
    applyTransform();
  }
  function centerOn(s, key, also) {
    // bring the item into the middle; with its counterparts too when they fit on screen together
    if (!layoutState || !layoutState[s]) return;
    const r = layoutState[s].rects.get(key);
    if (!r) return;
    const box = svg.getBoundingClientRect();
    if (st.view.k < 0.6) st.view.k = 0.9;
    let x0 = r.x, y0 = r.y, x1 = r.x + r.w, y1 = r.y + r.h;
    (also || []).forEach(function (m) {
      const q = m.key && layoutState[m.s] && layoutState[m.s].rects.get(m.key);
      if (!q) return;
      const nx0 = Math.min(x0, q.x), ny0 = Math.min(y0, q.y), nx1 = Math.max(x1, q.x + q.w), ny1 = Math.max(y1, q.y + q.h);
      if ((nx1 - nx0) * st.view.k < box.width - 60 && (ny1 - ny0) * st.view.k < box.height - 60) { x0 = nx0; y0 = ny0; x1 = nx1; y1 = ny1; }
    });
    st.view.x = box.width / 2 - (x0 + x1) / 2 * st.view.k;
    st.view.y = box.height / 2 - (y0 + y1) / 2 * st.view.k;
    applyTransform();
  }
  (function panZoom() {
    const host = document.getElementById('gt-graph');
    let drag = null;
    svg.addEventListener('wheel', function (ev) {
      // the wheel scrolls (shift: sideways); ctrl/cmd + wheel, and a trackpad pinch, zoom
      ev.preventDefault();
      const r = svg.getBoundingClientRect();
      const dy = ev.deltaMode === 1 ? ev.deltaY * 16 : ev.deltaY;
      if (ev.ctrlKey || ev.metaKey) zoomAt(ev.clientX - r.left, ev.clientY - r.top, Math.exp(-dy * 0.0015));
      else if (ev.shiftKey || (ev.deltaX && !dy)) { st.view.x -= ev.shiftKey ? dy : ev.deltaX; applyTransform(); }
      else scrollTo(st.view.y - dy);
    }, { passive: false });
    svg.addEventListener('pointerdown', function (ev) {
      if (ev.button !== 0) return;
      drag = { x: ev.clientX, y: ev.clientY, vx: st.view.x, vy: st.view.y, moved: false };
    });
    window.addEventListener('pointermove', function (ev) {
      if (!drag) return;
      const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
      if (!drag.moved && Math.abs(dx) + Math.abs(dy) < 4) return;
      drag.moved = true;
      host.classList.add('panning');
      st.view.x = drag.vx + dx; st.view.y = drag.vy + dy;
      applyTransform();
    });
    window.addEventListener('pointerup', function () {
      if (drag && drag.moved) { st.justPanned = true; setTimeout(function () { st.justPanned = false; }, 0); }
      drag = null; host.classList.remove('panning');
    });
  })();

  // ---- folding ------------------------------------------------------------------------------
  function invalidate(gi) {
    // a group's own layout depends only on its subtree; its ancestors' depend on its size
    anc[gi].forEach(function (a) { if (a !== gi) { cache.f.delete(a); cache.b.delete(a); } });
  }
  function setOpen(gi, open) {
    if (gi === st.root || isOpen(gi) === open) return;
    if (open) st.open.add(gi); else st.open.delete(gi);
    invalidate(gi);
  }
  function openTo(gi) {   // unfold every group around gi (not gi itself)
    anc[gi].forEach(function (a) { if (a !== gi) setOpen(a, true); });
  }
  function resetOpen(set) {
    st.open = new Set(set);
    cache.f.clear(); cache.b.clear();
  }
  function visibleCount(open) {
    // the boxes render() would draw with these groups open, on the sides shown
    const f = st.side !== 'bwd', b = st.side !== 'fwd';
    let n = 0;
    (function walk(gi) {
      const g = groups[gi];
      if (gi !== st.root && !open.has(gi)) { n += (f && g.ncalls > 0) + (b && g.nnodes > 0); return; }
      n += (f ? g.calls.length : 0) + (b ? g.nodes.length : 0);
      g.kids.forEach(walk);
    })(st.root);
    return n;
  }
  const INITIAL_BUDGET = 320;  // as INITIAL_VISIBLE_BUDGET in export/html/data.py: what a fresh view may draw
  const MAX_VISIBLE = 1000;   // "+ level" stops before the page would draw more than this
  const BY_DEPTH = { root: 1, module: 1, function: 1 };   // line/part/chunk groups open only on click
  function openToDepth(depth) {
    const set = new Set();
    const base = groups[st.root].depth;
    groups.forEach(function (g) {
      if (g.depth - base < depth && inView(g.idx) && BY_DEPTH[g.kind]) set.add(g.idx);
    });
    return set;
  }
  function shownGroups(pred) {
    // groups drawn right now (folded boxes or open boxes) that satisfy pred
    const out = [];
    (function walk(gi) {
      groups[gi].kids.forEach(function (k) {
        if (pred(k)) out.push(k);
        if (isOpen(k)) walk(k);
      });
    })(st.root);
    return out;
  }
  // The next level "+ level" would unfold: the shallowest folded module/Function groups shown,
  // and the number of boxes the page would then draw (null: nothing left to unfold).
  function nextLevel() {
    const folded = shownGroups(function (k) { return !isOpen(k) && BY_DEPTH[groups[k].kind]; });
    if (!folded.length) return null;
    const d = Math.min.apply(null, folded.map(function (k) { return groups[k].depth; }));
    const open = new Set(st.open);
    let added = 0;
    folded.forEach(function (k) { if (groups[k].depth === d) { open.add(k); added++; } });
    return { open: open, groups: added, boxes: visibleCount(open) };
  }
  function updateLevelButton() {
    // disabled, saying why, when unfolding one more level would pass MAX_VISIBLE boxes
    const btn = document.getElementById('gt-expand');
    const next = nextLevel();
    let why = null;
    if (!next) why = 'Every module level is unfolded.';
    else if (next.boxes > MAX_VISIBLE) {
      why = 'One more level would draw ' + next.boxes.toLocaleString('en-US') + ' boxes, more than ' +
        MAX_VISIBLE.toLocaleString('en-US') + ' (the page would get slow): click the boxes you want to unfold, or pick a module.';
    }
    btn.disabled = why !== null;
    btn.title = why || ('unfold the next module level (' + plural(next.groups, 'group') + ', ' +
      next.boxes.toLocaleString('en-US') + ' boxes shown after; stops before ' + MAX_VISIBLE.toLocaleString('en-US') + ')');
  }
  function unfoldLevel() {
    const next = nextLevel();
    if (!next) { toast('Every module level is unfolded.'); return; }
    if (next.boxes > MAX_VISIBLE) { toast('One more level would draw ' + next.boxes + ' boxes (limit ' + MAX_VISIBLE + '): click the boxes you want to unfold.'); return; }
    resetOpen(next.open);
    render();
  }
  function foldLevel() {
    const open = shownGroups(function (k) { return isOpen(k); });
    if (!open.length) return;
    const d = Math.max.apply(null, open.map(function (k) { return groups[k].depth; }));
    const cand = new Set(st.open);
    open.forEach(function (k) { if (groups[k].depth === d) cand.delete(k); });
    resetOpen(cand);
    render();
  }

  // ---- selection and details ------------------------------------------------------------------
  function el(tag, attrs) {
    const e = document.createElement(tag);
    if (attrs) for (const k in attrs) {
      if (k === 'text') e.textContent = shown(attrs[k]);
      else if (k === 'class') e.className = attrs[k];
      else if (k === 'onclick') e.addEventListener('click', attrs[k]);
      else if (k === 'title') e.setAttribute(k, shownLines(attrs[k]));   // shown; other attributes are keys
      else e.setAttribute(k, attrs[k]);
    }
    for (let i = 2; i < arguments.length; i++) {
      const c = arguments[i];
      if (c === null || c === undefined) continue;
      e.append(typeof c === 'string' ? shown(c) : c);   // strings become text nodes
    }
    return e;
  }
  function linkTo(name, label, kind) {
    // kind: what the link names when that is known (a tensor beside a call of the same name)
    return el('a', { class: 'link mono', 'data-goto': kind ? kind + ':' + name : name, text: label || name,
      onclick: function (ev) { ev.preventDefault(); goTo(name, kind); } });
  }
  function kv(rows) {
    const d = el('div', { class: 'kv' });
    rows.forEach(function (r) {
      if (r[1] === null || r[1] === undefined || r[1] === '') return;
      d.append(el('div', { class: 'k', text: r[0] }), el('div', { class: 'v' }, r[1]));
    });
    return d;
  }
  function fmt(x) {
    if (x === null || x === undefined) return '–';
    if (typeof x === 'string') return x;
    if (x === 0) return '0';
    const a = Math.abs(x);
    return (a >= 1e4 || a < 1e-3) ? x.toExponential(3) : String(+x.toPrecision(5));
  }
  function tensorTable(names, what) {
    // one card per tensor: name and shape on a line, then checksum, then value stats
    const box = el('div', { class: 'tensors' });
    if (!names.length) box.append(el('div', { class: 'tcard none', text: 'none' }));
    names.forEach(function (name, slot) {
      if (name === null) { box.append(el('div', { class: 'tcard none', text: what + ' [' + slot + ']: none' })); return; }
      const t = tensors.get(name);
      const card = el('div', { class: 'tcard' + (isBadTensor(name) ? ' bad' : tensorMark(name) === 'mask' ? ' mask' : ''), 'data-tensor': name });
      const top = el('div', { class: 'trow' }, names.length > 1 ? el('span', { class: 'slot', text: '[' + slot + ']' }) : null, linkTo(name, null, 'tensor'));
      if (!t) { top.append(el('span', { class: 'meta', text: 'not recorded' })); card.append(top); box.append(card); return; }
      top.append(el('span', { class: 'meta', text: shapeText(t.shape) + ' · ' + t.dtype + ' · ' + t.device + (t.role !== 'output' ? ' · ' + t.role : '') }));
      card.append(top);
      card.append(el('div', { class: 'md5', title: t.md5 || '', text: t.md5 ? 'md5 ' + t.md5 : (t.hash_note || (t.fingerprint ? 'fingerprint ' + t.fingerprint : 'no checksum')) }));
      if (t.stats) {
        const s = t.stats;
        const line = el('div', { class: 'stats', text: 'min ' + fmt(s[0]) + '   max ' + fmt(s[1]) + '   mean ' + fmt(s[2]) + '   |max| ' + fmt(s[3]) });
        if (s[4] || s[5]) line.append(' ', el('span', { class: 'badge ' + (isBadTensor(name) ? 'bad' : 'mask'), text: (s[4] ? s[4] + ' NaN' : '') + (s[4] && s[5] ? ', ' : '') + (s[5] ? s[5] + ' Inf' : '') + (isBadTensor(name) ? '' : ' (not a fault)') }));
        card.append(line);
      }
      box.append(card);
    });
    return box;
  }
  function stackView(stackId, title) {
    const wrap = el('div', { class: 'stack' });
    const ids = stackId === null || stackId === undefined ? [] : (D.stacks[stackId] || []);
    if (!ids.length) { wrap.append(el('div', { class: 'empty', text: 'no stack recorded' })); return wrap; }
    // The user's frames and the innermost one are shown; each run of other frames (libraries,
    // torch, the notebook kernel) is folded behind a toggle. Classes: tracer/model/frames.py.
    let run = null;
    ids.forEach(function (fi, j) {
      const f = D.frames[fi];
      const cls = f[4] || 'user';
      const last = j === ids.length - 1;
      const fr = el('div', { class: 'frame ' + (cls === 'user' ? 'user' : 'lib') + ' fc-' + cls + (last ? ' last' : '') });
      fr.append(el('div', { class: 'where', text: f[0] + ':' + f[1] + ' in ' + f[2] }), el('div', { class: 'code', text: f[3] }));
      if (cls === 'user' || last) { run = null; wrap.append(fr); return; }
      if (!run) {
        const box = el('div', { class: 'folded', hidden: '' });
        const toggle = el('button', { class: 'fold-toggle', 'data-folded': '0' });
        toggle.onclick = function () {
          box.hidden = !box.hidden;
          toggle.textContent = (box.hidden ? '▸ ' : '▾ ') + toggle.dataset.label;
        };
        run = { box: box, toggle: toggle, counts: {} , n: 0 };
        wrap.append(toggle, box);
      }
      run.box.append(fr);
      run.n += 1;
      run.counts[cls] = (run.counts[cls] || 0) + 1;
      const labels = { library: 'library', framework: 'framework', kernel: 'notebook kernel' };
      const parts = ['library', 'framework', 'kernel'].filter(function (c) { return run.counts[c]; })
        .map(function (c) { return run.counts[c] + ' ' + labels[c]; });
      run.toggle.dataset.folded = String(run.n);
      run.toggle.dataset.label = run.n + (run.n === 1 ? ' frame' : ' frames') + ' folded (' + parts.join(', ') + ')';
      run.toggle.textContent = '▸ ' + run.toggle.dataset.label;
    });
    if (title) wrap.prepend(el('div', { class: 'k', text: title }));
    return wrap;
  }
  function moduleLink(path) {
    const gi = groups.findIndex(function (g) { return g.kind === 'module' && g.path === path; });
    const cls = D.modules[path];
    const label = (path === '' ? '(root)' : path) + (cls ? ' (' + cls + ')' : '');
    if (gi < 0) return label;
    return el('a', { class: 'link mono', text: label, onclick: function () { selectGroup(gi, true); } });
  }
  function runPosition(n) {
    if (n.run === null || n.run === undefined) {
      // header node_runs false: built-in nodes' runs were recorded only where a backward needed them
      const lean = (S.header || {}).node_runs === false && n.kind !== 'AccumulateGrad';
      return el('span', { text: lean ? 'no recorded run (this trace records built-in nodes\u2019 runs only with checksums or stats: node_runs)'
        : 'did not run in a recorded backward' });
    }
    const run = D.runs[n.run];
    const box = el('span');
    box.append(shown('step ' + (n.step + 1) + ' of ' + run.order.length + ' in ' + run.name + ' (' + run.api + ')'));
    const nav = el('div', { class: 'steps' });
    if (n.step > 0) nav.append(el('button', { text: '◀ ran before', 'data-step': 'prev', onclick: function () { goTo(run.order[n.step - 1]); } }));
    if (n.step + 1 < run.order.length) nav.append(el('button', { text: 'ran next ▶', 'data-step': 'next', onclick: function () { goTo(run.order[n.step + 1]); } }));
    box.append(nav);
    return box;
  }

  function showDetails() {
    const P = document.getElementById('gt-details');
    while (P.firstChild) P.removeChild(P.firstChild);
    const x = st.sel;
    if (!x) {
      P.append(el('div', { class: 'empty', text: 'Click a call, a grad node or a box to see its details. Search with / .' }));
      return;
    }
    if (x.type === 'call') {
      const c = calls[x.idx];
      P.append(el('div', null, el('span', { class: 'badge call', text: 'call' }), el('span', { class: 'badge', text: c.kind }),
        c.phase !== 'forward' ? el('span', { class: 'badge', text: c.phase === 'backward' ? 'during backward' : c.phase + ' phase' }) : null,
        c.bad ? el('span', { class: 'badge bad', text: MARK_TEXT[c.mark] }) : c.mark ? el('span', { class: 'badge mask', text: 'intended Inf' }) : null));
      P.append(el('h2', { text: c.name }));
      const gl = el('div', { class: 'links' });
      c.grad_nodes.forEach(function (n) {
        const short = n.indexOf(c.name + '/') === 0 ? n.slice(c.name.length + 1) : n;
        const a = linkTo(n, short); a.title = shown(n); gl.append(a);
      });
      P.append(kv([['API', el('code', { text: c.api })], ['module', moduleLink(c.module)], ['args', c.args ? el('code', { text: c.args }) : null],
        ['inside', c.parent ? linkTo(c.parent) : null], ['grad nodes', c.grad_nodes.length ? gl : 'none (no autograd graph)'],
        ['changed in place', c.mutated.length ? c.mutated.join(', ') : null], ['error', c.error]]));
      P.append(el('h3', { text: 'Inputs' }), tensorTable(c.inputs, 'input'));
      P.append(el('h3', { text: 'Outputs' }), tensorTable(c.outputs, 'output'));
      P.append(el('h3', { text: 'Call stack (outermost first)' }), stackView(c.stack));
    } else if (x.type === 'node') {
      const n = nodes[x.idx];
      const c = n.call ? callByName.get(n.call) : null;
      P.append(el('div', null, el('span', { class: 'badge node', text: 'grad node' }), n.external ? el('span', { class: 'badge', text: 'external' }) : null,
        n.bad ? el('span', { class: 'badge bad', text: MARK_TEXT[n.mark] }) : null));
      P.append(el('h2', { text: n.name }));
      const nx = el('div');
      n.next.forEach(function (m, j) { nx.append(el('div', null, '[' + j + '] ', m ? linkTo(m) : 'no edge')); });
      P.append(kv([['node class', el('code', { text: n.kind })], ['forward call', c ? linkTo(c.name) : (n.call || null)],
        ['API', c ? el('code', { text: c.api }) : null], ['module', c ? moduleLink(c.module) : null],
        ['accumulates', n.param ? linkTo(n.param, null, 'tensor') : null], ['backward', runPosition(n)],
        ['next nodes', n.next.length ? nx : 'none (a leaf)']]));
      P.append(el('h3', { text: 'Gradients received' }), tensorTable(n.grads_in, 'grad in'));
      P.append(el('h3', { text: 'Gradients produced' }), tensorTable(n.grads_out, 'grad out'));
      P.append(el('h3', { text: c ? 'Forward call stack' : 'Stack' }), stackView(c ? c.stack : n.stack));
    } else if (x.type === 'group') {
      const g = groups[x.idx];
      P.append(el('div', null, el('span', { class: 'badge grp', text: g.kind === 'module' ? 'module' : g.kind }),
        g.badF ? el('span', { class: 'badge bad', text: plural(g.badF, 'call') + ' with NaN/Inf' }) : null,
        g.badB ? el('span', { class: 'badge bad', text: plural(g.badB, 'grad node') + ' with NaN/Inf' }) : null));
      P.append(el('h2', { text: g.path || g.label }));
      const params = tensorRows.filter(function (t) { return t.role === 'param' && t.previous === null && t.name.indexOf('@') < 0 && (g.path === '' || t.name.indexOf(g.path + '.') === 0); });
      const fold = el('button', { text: isOpen(x.idx) ? 'Fold' : 'Unfold', onclick: function () { toggle(x.idx); } });
      const only = el('button', { text: 'Show only this', onclick: function () { setRoot(x.idx); } });
      P.append(kv([['kind', g.kind], ['class', g.cls || null], ['label', g.label], ['source', g.where || null],
        ['contains', plural(g.ncalls, 'call') + ', ' + plural(g.nnodes, 'grad node')],
        ['head call', g.call !== null ? linkTo(calls[g.call].name) : null], ['', el('span', null, fold, ' ', only)]]));
      if (params.length) {
        P.append(el('h3', { text: 'Parameters (' + params.length + ')' }));
        P.append(tensorTable(params.slice(0, 60).map(function (t) { return t.name; }), 'parameter'));
      }
      const firstCall = g.call !== null ? calls[g.call] : calls[g.first];
      if (firstCall && firstCall.stack !== null) P.append(el('h3', { text: 'Stack of its first call' }), stackView(firstCall.stack));
    } else if (x.type === 'trace') {
      P.append(el('div', null, el('span', { class: 'badge', text: 'trace' })));
      P.append(el('h2', { text: S.model || 'trace' }));
      const hd = S.header || {};
      P.append(el('h3', { text: 'Settings' }), kv(Object.keys(hd).sort().map(function (k) {
        return [k, typeof hd[k] === 'object' ? JSON.stringify(hd[k]) : String(hd[k])];
      })));
      const meta = S.meta || {};
      P.append(el('h3', { text: 'Recorded' }), kv([['command', meta.argv ? meta.argv.join(' ') : null], ['started', meta.started || null],
        ['host', meta.host || null], ['seconds', meta.seconds !== undefined ? String(meta.seconds) : null],
        ['modules', String(S.modules)], ['status', S.status]]));
      D.runs.forEach(function (r) {
        P.append(el('h3', { text: 'Backward run ' + r.name }), kv([['API', el('code', { text: r.api })],
          ['roots', r.roots.join(', ')], ['grad nodes run', String(r.order.length)],
          ['first', r.order.length ? linkTo(r.order[0]) : null], ['last', r.order.length ? linkTo(r.order[r.order.length - 1]) : null],
          ['status', r.status + (r.error ? ': ' + r.error : '')]]), stackView(r.stack));
      });
      if ((S.notes || []).length) { P.append(el('h3', { text: 'Notes' })); S.notes.forEach(function (n) { P.append(el('div', { text: n })); }); }
    } else if (x.type === 'tensor') {
      const t = tensors.get(x.name);
      P.append(el('div', null, el('span', { class: 'badge', text: 'tensor · ' + t.role })));
      P.append(el('h2', { text: t.name }));
      const readers = el('div');
      (consumers.get(t.name) || []).slice(0, 40).forEach(function (ci, j) { if (j) readers.append(' '); readers.append(linkTo(calls[ci].name, null, 'call')); });
      const acc = t.name.endsWith('.grad') ? t.name.slice(0, -5) + '/AccumulateGrad' : null;
      P.append(kv([['made by', t.producer ? linkTo(t.producer) : null], ['read by', readers.childNodes.length ? readers : null],
        ['accumulated by', acc && nodeByName.has(acc) ? linkTo(acc) : null], ['replaces', t.previous ? linkTo(t.previous, null, 'tensor') : null],
        ['requires grad', String(t.requires_grad)]]));
      P.append(el('h3', { text: 'Value' }), tensorTable([t.name], 'tensor'));
    }
  }

  function select(sel, opts) {
    st.sel = sel;
    opts = opts || {};
    if (opts.reveal && sel) {
      if (sel.type === 'call') { const c = calls[sel.idx]; openTo(c.head !== undefined ? c.head : c.group); if (c.head === undefined) setOpen(c.group, true); }
      if (sel.type === 'node') { const n = nodes[sel.idx]; openTo(n.group); setOpen(n.group, true); }
      if (sel.type === 'group') openTo(sel.idx);
      if (!inView(sel.type === 'call' ? calls[sel.idx].group : sel.type === 'node' ? nodes[sel.idx].group : (sel.idx || 0))) setRoot(0, true);
      render();
      const s = sel.type === 'node' ? 'b' : 'f';
      if (st.side !== 'both' && ((s === 'f') !== (st.side === 'fwd'))) setSide('both');
      const key = sel.type === 'group' ? 'g' + sel.idx : selectedKey(s);
      const groupMates = sel.type === 'group' && groups[sel.idx].ncalls > 0 && groups[sel.idx].nnodes > 0 ? [{ s: 'b', key: key }] : [];
      if (key) centerOn(sel.type === 'group' && groups[sel.idx].ncalls === 0 ? 'b' : s, key, sel.type === 'group' ? groupMates : mates());
    } else if (opts.rerender) {
      render();
    } else {
      drawLinks();
      document.querySelectorAll('.box.sel').forEach(function (e) { e.classList.remove('sel'); });
      if (sel && sel.type === 'group') document.querySelectorAll('[data-key="fg' + sel.idx + '"].box, [data-key="bg' + sel.idx + '"].box').forEach(function (e) { e.classList.add('sel'); });
    }
    showDetails();
    markTableSelection();
  }
  function selectGroup(gi, reveal) { select({ type: 'group', idx: gi }, { reveal: reveal }); }
  // Names are unique within a kind, not across kinds (a parameter held as `linear0` beside the
  // call linear0): `kind:name` names one (call:, tensor:, node:, backward:), as t[...] and
  // `gradtrace show` take it; a bare name goes to the call, else the grad node, the tensor, the
  // backward run, the module or group (the search says when a name has several kinds).
  const KINDS = { call: 'call', tensor: 'tensor', node: 'grad node', backward: 'backward run' };
  function splitQualified(name) {
    const at = name.indexOf(':');
    const kind = at > 0 ? name.slice(0, at) : '';
    return Object.prototype.hasOwnProperty.call(KINDS, kind) && at < name.length - 1 ? [kind, name.slice(at + 1)] : [null, name];
  }
  function kindsOf(name) {
    return Object.keys(KINDS).filter(function (k) { return has(k, name); });
  }
  function has(kind, name) {
    return kind === 'call' ? callByName.has(name) : kind === 'node' ? nodeByName.has(name)
      : kind === 'tensor' ? tensors.has(name) : runByName.has(name);
  }
  function goTo(name, kind) {
    if (!kind) {
      const q = splitQualified(name);
      if (q[0] && has(q[0], q[1])) { kind = q[0]; name = q[1]; }
    }
    if ((!kind || kind === 'call') && callByName.has(name)) return select({ type: 'call', idx: callByName.get(name).idx }, { reveal: true });
    if ((!kind || kind === 'node') && nodeByName.has(name)) return select({ type: 'node', idx: nodeByName.get(name).idx }, { reveal: true });
    if ((!kind || kind === 'tensor') && tensors.has(name)) return select({ type: 'tensor', name: name });
    if ((!kind || kind === 'backward') && runByName.has(name)) return select({ type: 'trace' });   // the runs are listed there
    if (kind) return;
    const gi = groups.findIndex(function (g) { return g.id === name || (g.kind === 'module' && g.path === name); });
    if (gi >= 0) return selectGroup(gi, true);
  }
  function toggle(gi) {
    setOpen(gi, !isOpen(gi));
    st.sel = { type: 'group', idx: gi };
    render();
    showDetails();
  }
  function setRoot(gi, quiet) {
    st.root = gi;
    cache.f.clear(); cache.b.clear();
    document.getElementById('gt-module').value = String(gi);
    if (quiet) return;
    // showing one module: unfold inside it level by level while it stays small
    for (let d = 1; d < 12; d++) {
      const cand = new Set(st.open);
      openToDepth(d + 1).forEach(function (g) { cand.add(g); });
      if (visibleCount(cand) > INITIAL_BUDGET) break;
      st.open = cand;
    }
    cache.f.clear(); cache.b.clear();
    render(); fit();
  }
  function setSide(side) {
    st.side = side;
    document.querySelectorAll('[data-side]').forEach(function (b) { b.classList.toggle('on', b.getAttribute('data-side') === side); });
    if (st.tab === 'table') renderTable(); else { render(); fit(); }
  }

  svg.addEventListener('click', function (ev) {
    if (st.justPanned) return;
    const t = ev.target;
    const host = t.closest('[data-key]');
    if (!host) { select(null); return; }
    const key = host.getAttribute('data-key');   // side + item key
    const k = key.slice(1), i = +k.slice(1);
    if (k[0] === 'c') select({ type: 'call', idx: i });
    else if (k[0] === 'n') select({ type: 'node', idx: i });
    else if (host.classList.contains('box-head')) toggle(i);
    else if (host.classList.contains('box')) selectGroup(i, false); else {
      // a folded group: unfold it (a folded Function is also its call: select that)
      setOpen(i, true);
      const g = groups[i];
      st.sel = g.call !== null ? { type: 'call', idx: g.call } : { type: 'group', idx: i };
      render(); showDetails(); markTableSelection();
    }
  });

  // ---- search ---------------------------------------------------------------------------------
  const index = [];
  calls.forEach(function (c) { index.push({ name: c.name, kind: 'call', what: 'call', extra: c.api, lc: c.name.toLowerCase(), lx: c.api.toLowerCase() + ' ' + c.module.toLowerCase() }); });
  nodes.forEach(function (n) { index.push({ name: n.name, kind: 'node', what: 'grad node', extra: n.kind, lc: n.name.toLowerCase(), lx: '' }); });
  D.runs.forEach(function (r) { index.push({ name: r.name, kind: 'backward', what: 'backward run', extra: r.api, lc: r.name.toLowerCase(), lx: r.api.toLowerCase() }); });
  groups.forEach(function (g) {
    if (g.kind === 'root') return;
    const label = g.kind === 'module' ? g.id.slice(2) : g.id;
    index.push({ name: g.id, shown: g.kind === 'module' ? label : g.label, what: g.kind, extra: g.cls || g.where, lc: label.toLowerCase(), lx: g.label.toLowerCase() });
  });
  tensorRows.forEach(function (t) { index.push({ name: t.name, kind: 'tensor', what: 'tensor', extra: shapeText(t.shape) + ' ' + t.dtype, lc: t.name.toLowerCase(), lx: '' }); });
  index.forEach(function (e) { if (e.kind && kindsOf(e.name).length > 1) e.shown = e.kind + ':' + e.name; });   // say which one
  function search(q) {
    // Calls whose name matches come first, so Enter selects the call and not the module it sits
    // in (a module named like its op: self.gelu holds gelu0); the rest ranked as: exact name,
    // then prefix, then a match that starts at a name component ("h.3.mlp" in
    // "transformer.h.3.mlp"), then any substring, then API/module text; shorter names first
    // "tensor:linear0": that kind's records only (a name several kinds share)
    const qk = splitQualified(q.trim());
    q = qk[1].toLowerCase();
    if (!q) return [];
    const hits = [];
    for (let i = 0; i < index.length && hits.length < 3000; i++) {
      const e = index[i];
      if (qk[0] && e.kind !== qk[0]) continue;
      const at = e.lc.indexOf(q);
      let rank;
      if (at === 0) rank = e.lc.length === q.length ? 0 : 1;
      else if (at > 0) rank = /[.:/_@#]/.test(e.lc[at - 1]) ? 2 : 3;
      else if (e.lx.indexOf(q) >= 0) rank = 4;
      else continue;
      hits.push({ e: e, rank: rank, i: i, call: e.what === 'call' && rank <= 3 ? 0 : 1 });
    }
    hits.sort(function (a, b) { return a.call - b.call || a.rank - b.rank || a.e.lc.length - b.e.lc.length || a.i - b.i; });
    return hits.map(function (h) { return h.e; });
  }
  const sInput = document.getElementById('gt-search'), sBox = document.getElementById('gt-results');
  let results = [], active = 0;
  function showResults() {
    while (sBox.firstChild) sBox.removeChild(sBox.firstChild);
    results = search(sInput.value);
    active = 0;
    st.hits = new Set();
    results.slice(0, 300).forEach(function (r) {
      const c = r.kind === 'call' && callByName.get(r.name), n = r.kind === 'node' && nodeByName.get(r.name);
      if (c) st.hits.add('f' + repOf('c' + c.idx));
      if (n) st.hits.add('b' + repOf('n' + n.idx));
    });
    drawLinks();
    if (st.tab === 'table') renderTable();
    if (!results.length) { sBox.classList.toggle('open', !!sInput.value.trim()); if (sInput.value.trim()) sBox.append(el('div', { class: 'result', text: 'no match' })); return; }
    const typed = splitQualified(sInput.value.trim()), shared = typed[0] ? [] : kindsOf(typed[1]);
    if (shared.length > 1) {   // a bare name of several kinds: which, how to spell each, what Enter opens
      sBox.append(el('div', { class: 'result note', text: '\u201c' + typed[1] + '\u201d names ' + shared.map(function (k) { return 'a ' + KINDS[k]; }).join(' and ')
        + ': type ' + shared.map(function (k) { return k + ':' + typed[1]; }).join(' or ') + ' (Enter opens the first below)' }));
    }
    results.slice(0, 40).forEach(function (r, j) {
      const row = el('div', { class: 'result' + (j === 0 ? ' active' : ''), 'data-name': r.name, 'data-kind': r.kind || '' },
        el('span', { class: 'what', text: r.what }), el('span', { class: 'name', text: r.shown || r.name }), el('span', { class: 'extra', text: r.extra || '' }));
      row.addEventListener('mousedown', function (ev) { ev.preventDefault(); pick(r); });
      sBox.append(row);
    });
    if (results.length > 40) sBox.append(el('div', { class: 'result', text: '… ' + (results.length - 40) + ' more' }));
    sBox.classList.add('open');
  }
  function pick(r) { sBox.classList.remove('open'); st.hits = new Set(); goTo(r.name, r.kind); }
  sInput.addEventListener('input', showResults);
  sInput.addEventListener('focus', function () { if (sInput.value) showResults(); });
  sInput.addEventListener('blur', function () { setTimeout(function () { sBox.classList.remove('open'); }, 100); });
  sInput.addEventListener('keydown', function (ev) {
    const rows = sBox.querySelectorAll('.result[data-name]');
    if (ev.key === 'ArrowDown' || ev.key === 'ArrowUp') {
      ev.preventDefault();
      if (!rows.length) return;
      rows[active].classList.remove('active');
      active = (active + (ev.key === 'ArrowDown' ? 1 : rows.length - 1)) % rows.length;
      rows[active].classList.add('active');
      rows[active].scrollIntoView({ block: 'nearest' });
    } else if (ev.key === 'Enter') {
      if (results[active]) pick(results[active]);
    } else if (ev.key === 'Escape') {
      sInput.value = ''; showResults(); sInput.blur();
    }
  });
  document.addEventListener('keydown', function (ev) {
    if (ev.target.tagName === 'INPUT' || ev.target.tagName === 'SELECT') return;
    if (ev.key === '/') { ev.preventDefault(); sInput.focus(); }
    else if (ev.key === 'f') fit();
    else if (ev.key === 'Escape') select(null);
  });

  // ---- table view ---------------------------------------------------------------------------
  const COLS = [
    { id: 'seq', title: '#', num: true }, { id: 'name', title: 'name', mono: true }, { id: 'type', title: 'type' },
    { id: 'api', title: 'API / node class', mono: true }, { id: 'module', title: 'module', mono: true },
    { id: 'shape', title: 'output / grad shape', mono: true }, { id: 'dtype', title: 'dtype' },
    { id: 'md5', title: 'md5', mono: true }, { id: 'bad', title: 'NaN/Inf', num: true }, { id: 'step', title: 'bwd step', num: true },
  ];
  let tableRows = null;
  const sortBy = { col: 'seq', desc: false };
  function buildTableRows() {
    tableRows = [];
    calls.forEach(function (c) {
      const t = tensors.get(c.outputs[0]);
      tableRows.push({ key: 'c' + c.idx, seq: c.idx, name: c.name, type: 'call', api: c.api, module: c.module, group: c.group,
        shape: t ? shapeText(t.shape) : '', dtype: t ? t.dtype : '', md5: t && t.md5 ? t.md5.slice(0, 12) : '',
        bad: c.outputs.filter(isBadTensor).length, step: null });
    });
    nodes.forEach(function (n) {
      const g = n.grads_out.find(function (x) { return x; }) || n.grads_in.find(function (x) { return x; });
      const t = g ? tensors.get(g) : null;
      const c = n.call ? callByName.get(n.call) : null;
      tableRows.push({ key: 'n' + n.idx, seq: calls.length + n.idx, name: n.name, type: 'grad node', api: n.kind, module: c ? c.module : (n.param || ''),
        group: n.group, shape: t ? shapeText(t.shape) : '', dtype: t ? t.dtype : '', md5: t && t.md5 ? t.md5.slice(0, 12) : '',
        bad: n.grads_out.concat(n.grads_in).filter(isBadTensor).length, step: n.step === null ? null : n.step + 1 });
    });
  }
  function renderTable() {
    if (!tableRows) buildTableRows();
    const wrap = document.getElementById('gt-table-wrap');
    while (wrap.firstChild) wrap.removeChild(wrap.firstChild);
    const q = sInput.value.trim().toLowerCase();
    let rows = tableRows.filter(function (r) {
      if (st.side === 'fwd' && r.type !== 'call') return false;
      if (st.side === 'bwd' && r.type === 'call') return false;
      if (st.root !== 0 && !inView(r.group)) return false;
      return !q || r.name.toLowerCase().indexOf(q) >= 0 || r.api.toLowerCase().indexOf(q) >= 0 || r.module.toLowerCase().indexOf(q) >= 0;
    });
    const col = COLS.find(function (c) { return c.id === sortBy.col; });
    rows = rows.slice().sort(function (a, b) {
      let x = a[col.id], y = b[col.id];
      if (x === null || x === undefined) x = col.num ? Infinity : '';
      if (y === null || y === undefined) y = col.num ? Infinity : '';
      const r = col.num ? x - y : String(x).localeCompare(String(y), undefined, { numeric: true });
      return sortBy.desc ? -r : r;
    });
    wrap.append(el('div', { id: 'gt-table-note', text: rows.length + ' of ' + tableRows.length + ' rows' + (q ? ' matching “' + q + '”' : '') + ' · click a header to sort, a row to see it, double-click to show it in the graph' }));
    const tb = el('table', { id: 'gt-table' });
    const head = el('tr');
    COLS.forEach(function (c) {
      const th = el('th', { text: c.title, 'data-col': c.id, class: sortBy.col === c.id ? 'sorted' + (sortBy.desc ? ' desc' : '') : '' });
      th.addEventListener('click', function () {
        if (sortBy.col === c.id) sortBy.desc = !sortBy.desc; else { sortBy.col = c.id; sortBy.desc = false; }
        renderTable();
      });
      head.append(th);
    });
    tb.append(el('thead', null, head));
    const body = el('tbody');
    const frag = document.createDocumentFragment();
    const LIMIT = 5000;
    rows.slice(0, LIMIT).forEach(function (r) {
      const tr = document.createElement('tr');
      tr.setAttribute('data-key', r.key);
      if (r.bad) tr.className = 'bad';
      COLS.forEach(function (c) {
        const td = document.createElement('td');
        const v = r[c.id];
        td.textContent = c.id === 'seq' ? (r.type === 'call' ? String(v) : '') : (v === null || v === undefined ? '' : shown(v));
        if (c.mono) td.className = 'mono';
        tr.appendChild(td);
      });
      frag.appendChild(tr);
    });
    body.appendChild(frag);
    body.addEventListener('click', function (ev) {
      const tr = ev.target.closest('tr[data-key]');
      if (!tr) return;
      const k = tr.getAttribute('data-key');
      st.sel = k[0] === 'c' ? { type: 'call', idx: +k.slice(1) } : { type: 'node', idx: +k.slice(1) };
      showDetails(); markTableSelection();
    });
    body.addEventListener('dblclick', function (ev) {
      const tr = ev.target.closest('tr[data-key]');
      if (!tr) return;
      setTab('graph');
      const k = tr.getAttribute('data-key');
      select(k[0] === 'c' ? { type: 'call', idx: +k.slice(1) } : { type: 'node', idx: +k.slice(1) }, { reveal: true });
    });
    tb.append(body);
    wrap.append(tb);
    markTableSelection();
  }
  function markTableSelection() {
    if (st.tab !== 'table') return;
    document.querySelectorAll('#gt-table tr.sel').forEach(function (e) { e.classList.remove('sel'); });
    const x = st.sel;
    if (!x || (x.type !== 'call' && x.type !== 'node')) return;
    const tr = document.querySelector('#gt-table tr[data-key="' + (x.type === 'call' ? 'c' : 'n') + x.idx + '"]');
    if (tr) tr.classList.add('sel');
  }
  function setTab(tab) {
    st.tab = tab;
    document.getElementById('gt-view').classList.toggle('table', tab === 'table');
    document.getElementById('gt-view').classList.toggle('memory', tab === 'memory');
    document.querySelectorAll('[data-tab]').forEach(function (b) { b.classList.toggle('on', b.getAttribute('data-tab') === tab); });
    if (tab === 'table') renderTable(); else if (tab !== 'memory') render();
  }

  // ---- header, toolbar ------------------------------------------------------------------------
  let toastTimer = null;
  function toast(msg) {
    const t = document.getElementById('gt-toast');
    t.textContent = shownLines(msg); t.classList.add('open');
    clearTimeout(toastTimer);
    toastTimer = setTimeout(function () { t.classList.remove('open'); }, 5000);
  }
  function header() {
    const h = document.getElementById('gt-summary');
    const hd = S.header || {};
    function chip(label, value, cls) { return el('span', { class: 'chip' + (cls ? ' ' + cls : '') }, label ? label + ' ' : '', el('b', { text: String(value) })); }
    h.append(chip('status', S.status, 'status-' + S.status), chip('device', S.devices.join(', ') || '–'), chip('calls', S.calls), chip('grad nodes', S.grad_nodes),
      chip('tensors', S.tensors), chip('backward runs', S.backward_runs),
      chip('parameters', S.params + ' (' + S.param_numel.toLocaleString('en-US') + ' values)'),
      chip('hash', hd.hash || 'none'), chip('stacks', hd.stacks === false ? 'off' : 'on'), chip('torch', hd.torch || '?'));
    const banners = document.getElementById('gt-banners');
    if (S.status !== 'ok') {
      const err = S.error ? (S.error.type || '') + ': ' + (S.error.message || JSON.stringify(S.error)) : '';
      const b = el('div', { class: 'banner bad', text: 'Trace ' + S.status + (err ? ' — ' + err : '') });
      if (S.error && S.error.last_call && callByName.has(S.error.last_call)) b.append(' · last call recorded: ', linkTo(S.error.last_call));
      banners.append(b);
    }
    // The NaN/Inf story in the words of every other surface: its headline (red for a fault, amber
    // for a step GradScaler skipped), what it reached, and what is not a fault (grey).
    if (NUM.headline_text) {
      const fault = !!NUM.headline && !NUM.skipped;
      const b = el('div', { class: 'banner ' + (fault ? 'bad' : NUM.headline ? 'warn' : 'info'), id: 'gt-story' }, el('span', { class: 'story-head', text: NUM.headline_text }));
      const target = anomalyTarget(NUM.headline);
      if (target) b.append(' · ', linkTo(target.name, 'show ' + target.name, target.type));
      if (NUM.spread) b.append(el('div', { class: 'story-spread', text: NUM.spread }));
      banners.append(b);
    }
    (NUM.notes || []).forEach(function (n) { banners.append(el('div', { class: 'banner info', text: n })); });
    (NUM.scaler || []).forEach(function (n) { banners.append(el('div', { class: 'banner info', text: n })); });
    if (D.omitted) banners.append(el('div', { class: 'banner warn', text: D.omitted.message }));
    (S.notes || []).forEach(function (n) { banners.append(el('div', { class: 'banner info', text: n })); });
    const sel = document.getElementById('gt-module');
    sel.append(el('option', { value: '0', text: 'all modules' }));
    groups.forEach(function (g) {
      if (g.kind !== 'module') return;
      sel.append(el('option', { value: String(g.idx), text: '  '.repeat(Math.max(0, g.depth - 1)) + g.id.slice(2) + (g.cls ? ' (' + g.cls + ')' : '') }));
    });
    sel.addEventListener('change', function () { setRoot(+sel.value); });
  }
  // The story's headline (tracer.analysis.numerics, in the payload): the first value made NaN or
  // unintendedly Inf (or that arrived so) in execution order across forward, backward and the
  // optimizer phase; an intended -inf (an attention mask) never is.
  function anomalyTarget(a) {
    if (!a) return null;
    if (callByName.has(a.producer)) return { type: 'call', idx: callByName.get(a.producer).idx, name: a.producer };
    if (nodeByName.has(a.producer)) return { type: 'node', idx: nodeByName.get(a.producer).idx, name: a.producer };
    return null;   // cut from this page by its size budget
  }
  function nanButton(id) {
    const a = NUM.headline || null, target = anomalyTarget(a);
    const b = document.getElementById(id);
    b.textContent = a ? 'first ' + (a.kind === 'nan' ? 'NaN' : 'Inf') : 'no NaN';
    b.disabled = !target;
    if (!target) {
      b.title = a ? NUM.headline_text + ' (' + shown(a.producer) + ' is not on this page)' : 'No NaN or unintended Inf in this step.';
      return;
    }
    b.title = 'Select ' + shown(target.name) + ': ' + NUM.headline_text;
    b.setAttribute('data-target', target.name);
    b.addEventListener('click', function () {
      if (st.tab !== 'graph') setTab('graph');
      select({ type: target.type, idx: target.idx }, { reveal: true });
    });
  }
  function toolbar() {
    const title = document.getElementById('gt-title');
    title.classList.add('link');
    title.title = 'trace settings, command, backward runs';
    title.addEventListener('click', function () { select({ type: 'trace' }); });
    document.querySelectorAll('[data-side]').forEach(function (b) { b.addEventListener('click', function () { setSide(b.getAttribute('data-side')); }); });
    document.querySelectorAll('[data-tab]').forEach(function (b) { b.addEventListener('click', function () { setTab(b.getAttribute('data-tab')); }); });
    document.getElementById('gt-expand').addEventListener('click', unfoldLevel);
    document.getElementById('gt-collapse').addEventListener('click', foldLevel);
    document.getElementById('gt-foldall').addEventListener('click', function () { resetOpen(openToDepth(1)); render(); fit(); });
    document.getElementById('gt-initial').addEventListener('click', function () { resetOpen(D.open); render(); fit(); });
    document.getElementById('gt-fit').addEventListener('click', function () { fit(); });
    nanButton('gt-nan-first');
    document.getElementById('gt-zin').addEventListener('click', function () { const r = svg.getBoundingClientRect(); zoomAt(r.width / 2, r.height / 2, 1.25); });
    document.getElementById('gt-zout').addEventListener('click', function () { const r = svg.getBoundingClientRect(); zoomAt(r.width / 2, r.height / 2, 0.8); });
  }

  if (window.ResizeObserver) {
    // a page that opened hidden (notebook iframe in a closed <details>) fits once it has a size
    new ResizeObserver(function () {
      measureView();
      if (!st.fitLater) { updateScrollbar(); return; }
      st.fitLater = null;
      fit();
    }).observe(document.getElementById('gt-graph'));
  }
  function linkMemoryTables() {
    // names in the Memory tab's tables (owners, producers, live tensors) lead to the graph
    document.querySelectorAll('#gt-memory-tables td.name').forEach(function (td) {
      const name = td.dataset.name;   // the name itself; the cell shows it escaped (export/html/memory.py)
      if (!callByName.has(name) && !nodeByName.has(name) && !tensors.has(name)) return;
      td.textContent = '';
      td.append(el('a', { class: 'link mono', 'data-goto': name, text: name, onclick: function (ev) {
        ev.preventDefault();
        if (callByName.has(name) || nodeByName.has(name)) setTab('graph');   // a tensor shows in the side panel
        goTo(name);
      } }));
    });
  }
  header();
  toolbar();
  linkMemoryTables();
  render();
  fit();
  showDetails();
  // what tests and the benchmark read: time to the first interactive frame, and a few handles
  window.gradtrace = {
    // readyAt counts from navigation start (HTML and JSON parsing included); readyMs from our script
    readyAt: performance.now(), readyMs: performance.now() - T0, state: st, goTo: goTo, search: search,
    visible: function () { return st.visibleCount; }, lastRenderMs: function () { return st.lastRenderMs; },
  };
  document.body.setAttribute('data-ready', '1');
})();
