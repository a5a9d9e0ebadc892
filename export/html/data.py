"""The data behind the HTML report: a ``Trace`` turned into one JSON-ready dict.

Everything the page shows comes from here; the JavaScript only draws it. The dict is embedded in
the page as ``<script type="application/json" id="gt-data">`` and tests read it back, so its shape
is part of the report's contract (``PAYLOAD_VERSION``):

``summary``   model class, devices, counts, parameter count, settings, status, notes, and
              ``numerics``: the NaN/Inf story (``tracer.analysis.numerics``, what every surface
              says): ``headline_text``, ``headline`` (what "first NaN" selects, or null),
              ``skipped`` (a step GradScaler skipped), ``spread``, ``notes`` (intended Infs,
              dropped values), ``scaler`` and ``values`` (the values drawn red)
``frames``    ``[file, line, function, code, class]`` rows (class: ``tracer.model.frames.frame_class``); ``stacks`` lists frame indices, outermost first
``tensors``/``calls``/``nodes``/``groups``   ``{"fields": [...], "rows": [[...], ...]}`` tables
``runs``      backward runs: name, api, roots, stack, order (node names), outputs, status, error
``fwd_edges`` ``[producer call index, consumer call index, [tensor names]]``
``bwd_edges`` ``[grad node index, next node index, [output slots]]``
``open``      group indices expanded when the page opens; ``omitted`` says what a byte budget cut
``unsafe``    the characters the page shows escaped in every string of the trace (a regular
              expression's class: ``tracer.model.display.UNSAFE_JS``, what ``inert`` escapes)

Groups are what the page folds. They follow module paths, one group per *invocation* (a module
called twice in separate places gets ``#1``), with a custom ``autograd.Function`` grouping the
calls made inside it. A group with very many direct children is split so no level is a wall of
boxes: long runs of calls from one source line become a ``line`` group (an optimizer step is one
``opt.step()`` box), those split further into connected ``part`` groups (one per parameter), and
anything still too wide into ``chunk`` groups of consecutive items.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from export.views import first_params, module_label, nonfinite, parent_path, prefixes
from tracer.analysis.numerics import Anomaly, NumericsReport
from tracer.model import Call, GradNode, Stats, TensorRecord, Trace
from tracer.model.display import UNSAFE_JS, clip, inert, json_number, param_module
from tracer.model.frames import frame_class
from tracer.model.names import base_name, gradient_of

PAYLOAD_VERSION = 2

# Folding: the page opens with every module group above this depth expanded, as deep as keeps
# the number of drawn boxes (forward + backward) within this many.
INITIAL_VISIBLE_BUDGET = 320
LINE_RUN_MIN = 12          # a run this long from one source line becomes a ``line`` group...
LINE_SPLIT_MIN_ITEMS = 40  # ...when the group it sits in has at least this many direct items
PART_SPLIT_MIN_ITEMS = 24  # a line group with this many calls is split into connected parts
MAX_CHILDREN = 80          # wider than this: consecutive items are cut into chunks of CHUNK
CHUNK = 64

TENSOR_FIELDS = ["name", "shape", "dtype", "device", "role", "producer", "md5", "hash_note",
                 "stats", "requires_grad", "previous", "seq", "fingerprint"]
CALL_FIELDS = ["name", "api", "module", "kind", "phase", "inputs", "outputs", "args",
               "grad_nodes", "stack", "parent", "mutated", "error", "group"]
NODE_FIELDS = ["name", "kind", "call", "param", "next", "stack", "external", "grads_in",
               "grads_out", "group", "run", "step"]
GROUP_FIELDS = ["id", "kind", "label", "path", "cls", "parent", "depth", "call", "ncalls",
                "nnodes", "where"]

@dataclass
class _Group:
    id: str
    kind: str            # root | module | function | line | part | chunk
    label: str
    path: str = ""       # module path (module groups, and the module a pseudo-group sits in)
    cls: str = ""        # module class, or the custom Function's class
    parent: int | None = None
    call: int | None = None  # function groups: the Function call they stand for when folded
    where: str = ""      # line groups: "file:line"
    items: list[tuple[str, int]] = field(default_factory=list)  # ("g"|"c", index), in order


def _stats(s: Stats | None) -> list[Any] | None:
    if s is None:
        return None
    return [json_number(s.min), json_number(s.max), json_number(s.mean), json_number(s.absmax), s.nan, s.inf]


def _tensor_row(t: TensorRecord) -> list[Any]:
    return [t.name, list(t.shape), t.dtype, t.device, t.role, t.producer, t.md5, t.hash_note,
            _stats(t.stats), t.requires_grad, t.previous, t.seq, t.fingerprint]


class _Builder:
    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.calls = trace.calls
        self.call_index = {c.name: i for i, c in enumerate(self.calls)}
        self.nodes = trace.grad_nodes
        self.node_index = {n.name: i for i, n in enumerate(self.nodes)}
        self.groups: list[_Group] = [_Group(id="root", kind="root", label=trace.modules.get("", "") or "step",
                                            cls=trace.modules.get("", ""))]
        self.call_group: list[int] = [0] * len(self.calls)
        self.node_group: list[int] = [0] * len(self.nodes)
        self.fwd_edges = self._forward_edges()

    # ---- edges ---------------------------------------------------------------------------
    def _forward_edges(self) -> list[list[Any]]:
        """Producer call -> consumer call, one edge per pair with the tensors it carries."""
        made_by: dict[str, int] = {}
        pairs: dict[tuple[int, int], list[str]] = {}
        for i, c in enumerate(self.calls):
            for t in c.inputs:
                src = self._producer(t, made_by)
                if src is not None and src != i:
                    pairs.setdefault((src, i), []).append(t)
            for t in c.outputs:
                made_by.setdefault(t, i)  # a call that returns its input (x.to(same)) did not make it
        return [[s, d, ts] for (s, d), ts in pairs.items()]

    def _producer(self, tensor: str, made_by: dict[str, int]) -> int | None:
        rec = self.trace.tensors.get(tensor)
        if rec is not None and rec.producer in self.call_index:
            return self.call_index[rec.producer]
        return made_by.get(tensor)

    def bwd_edges(self) -> list[list[Any]]:
        pairs: dict[tuple[int, int], list[int]] = {}
        for i, n in enumerate(self.nodes):
            for slot, dst in enumerate(n.next):
                if dst is not None and dst in self.node_index:
                    pairs.setdefault((i, self.node_index[dst]), []).append(slot)
        return [[s, d, slots] for (s, d), slots in pairs.items()]

    # ---- groups --------------------------------------------------------------------------
    def _new_group(self, parent: int, **kw: Any) -> int:
        g = _Group(parent=parent, **kw)
        self.groups.append(g)
        gi = len(self.groups) - 1
        self.groups[parent].items.append(("g", gi))
        return gi

    def build_groups(self) -> None:
        module_invocations: dict[str, int] = defaultdict(int)
        heads = {c.parent for c in self.calls if c.parent in self.call_index}
        function_group: dict[int, int] = {}
        chain: list[int] = [0]   # open module groups, root first

        for i, c in enumerate(self.calls):
            if c.parent is not None:
                host = self._host_group(c, function_group)
                if host is not None:
                    self._place_call(i, host, heads, function_group)
                    continue
            paths = prefixes(c.module)
            keep = 0
            while (keep < len(paths) and keep + 1 < len(chain)
                   and self.groups[chain[keep + 1]].path == paths[keep]):
                keep += 1
            del chain[keep + 1:]
            for path in paths[keep:]:
                n = module_invocations[path]
                module_invocations[path] += 1
                gi = self._new_group(chain[-1], id=f"m:{path}" + (f"#{n}" if n else ""), kind="module",
                                     label=module_label(path) + (f" #{n}" if n else ""), path=path,
                                     cls=self.trace.modules.get(path, ""))
                chain.append(gi)
            self._place_call(i, chain[-1], heads, function_group)

        gi = 0
        while gi < len(self.groups):  # groups made by a split are split in turn
            self._split(gi)
            gi += 1
        self._place_nodes()

    def _host_group(self, c: Call, function_group: dict[int, int]) -> int | None:
        """Where a nested call goes: inside its custom Function, or (backward phase) beside the
        call whose grad node was running."""
        if c.parent in self.call_index:
            return function_group.get(self.call_index[c.parent])
        node = self.node_index.get(c.parent or "")
        if node is not None:
            owner = self.nodes[node].call
            if owner in self.call_index:
                oi = self.call_index[owner]
                return function_group.get(oi, self.call_group[oi])
        return None

    def _place_call(self, i: int, gi: int, heads: AbstractSet[str | None], function_group: dict[int, int]) -> None:
        c = self.calls[i]
        if c.name in heads:  # a Function with calls inside: the group stands for the call
            fg = self._new_group(gi, id=f"f:{c.name}", kind="function", label=c.name, path=c.module,
                                 cls=c.api.rsplit(".", 2)[-2] if c.api.count(".") >= 1 else c.api, call=i)
            function_group[i] = fg
            self.call_group[i] = fg
        else:
            self.groups[gi].items.append(("c", i))
            self.call_group[i] = gi

    def _split(self, gi: int) -> None:
        g = self.groups[gi]
        if g.kind in ("root", "module", "function") and len(g.items) >= LINE_SPLIT_MIN_ITEMS:
            self._split_line_runs(gi)
        if g.kind == "line" and len(g.items) >= PART_SPLIT_MIN_ITEMS:
            self._split_parts(gi)
        if len(self.groups[gi].items) > MAX_CHILDREN:
            self._split_chunks(gi)

    def _split_line_runs(self, gi: int) -> None:
        g = self.groups[gi]
        items = g.items
        runs: list[tuple[int, int]] = []
        start = 0
        while start < len(items):
            end = start + 1
            key = self._line_of(items[start])
            while key is not None and end < len(items) and self._line_of(items[end]) == key:
                end += 1
            if key is not None and end - start >= LINE_RUN_MIN and end - start < len(items):
                runs.append((start, end))
            start = end
        if not runs:
            return
        new_items: list[tuple[str, int]] = []
        pos = 0
        g.items = []
        for start, end in runs:
            new_items.extend(items[pos:start])
            frame = self.calls[items[start][1]].stack[-1]
            code = frame.code.strip() or f"{frame.function}()"
            lg = _Group(id=f"l:{g.id}:{self.calls[items[start][1]].name}", kind="line", label=clip(code, 48),
                        path=g.path, parent=gi, where=f"{frame.file}:{frame.line}", items=items[start:end])
            self.groups.append(lg)
            lgi = len(self.groups) - 1
            for kind, idx in lg.items:
                if kind == "c":
                    self.call_group[idx] = lgi
            new_items.append(("g", lgi))
            pos = end
        new_items.extend(items[pos:])
        g.items = new_items

    def _line_of(self, item: tuple[str, int]) -> tuple[str, int, bool] | None:
        """Run key: the innermost source line, and whether the call built autograd graph (so a
        loss and the optimizer step written on one line still come apart)."""
        if item[0] != "c":
            return None
        c = self.calls[item[1]]
        return (c.stack[-1].file, c.stack[-1].line, bool(c.grad_nodes)) if c.stack else None

    def _split_parts(self, gi: int) -> None:
        """Cut a line group into connected pieces (an optimizer step: one piece per parameter).

        Calls are joined through every tensor they touch, versions and ``.grad`` folded onto the
        tensor they belong to. A piece that touches no parameter (AdamW's step counter) joins the
        piece of the call right after its last call, which is the parameter it counts for.
        """
        g = self.groups[gi]
        if any(kind != "c" for kind, _ in g.items):
            return
        idxs = [i for _, i in g.items]
        parent = {i: i for i in idxs}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        owner: dict[str, int] = {}
        for i in idxs:
            c = self.calls[i]
            for t in (*c.inputs, *c.outputs):
                base = self._base_tensor(t)
                if base in owner:
                    parent[find(i)] = find(owner[base])
                else:
                    owner[base] = i
        pieces: dict[int, list[int]] = defaultdict(list)
        for i in idxs:
            pieces[find(i)].append(i)
        if len(pieces) < 2:
            return
        params = {root: self._param_of(members) for root, members in pieces.items()}
        pos = {i: k for k, i in enumerate(idxs)}
        for root, members in list(pieces.items()):
            if params[root] is None:
                after = pos[members[-1]] + 1
                if after < len(idxs):
                    target = find(idxs[after])
                    if target != root and params.get(target) is not None:
                        parent[root] = target
        merged: dict[int, list[int]] = defaultdict(list)
        for i in idxs:
            merged[find(i)].append(i)
        if len(merged) < 2:
            return
        g.items = []
        for _, members in sorted(merged.items(), key=lambda kv: kv[1][0]):
            label = self._param_of(members) or f"{self.calls[members[0]].name}…{self.calls[members[-1]].name}"
            pg = _Group(id=f"p:{g.id}:{self.calls[members[0]].name}", kind="part", label=label, path=g.path,
                        parent=gi, items=[("c", i) for i in members])
            self.groups.append(pg)
            pgi = len(self.groups) - 1
            for i in members:
                self.call_group[i] = pgi
            g.items.append(("g", pgi))

    def _base_tensor(self, name: str) -> str:
        base = base_name(name)
        rec = self.trace.tensors.get(name)
        if rec is not None and rec.role == "grad":
            base = gradient_of(name) or base
        return base

    def _param_of(self, members: list[int]) -> str | None:
        for i in members:
            for t in self.calls[i].inputs:
                rec = self.trace.tensors.get(t)
                if rec is not None and rec.role == "param":
                    return base_name(t)
        return None

    def _split_chunks(self, gi: int) -> None:
        g = self.groups[gi]
        items = g.items
        g.items = []
        for start in range(0, len(items), CHUNK):
            part = items[start:start + CHUNK]
            cg = _Group(id=f"k:{g.id}:{start}", kind="chunk", label=f"{g.label} [{start + 1}–{start + len(part)}]",
                        path=g.path, parent=gi, items=part)
            self.groups.append(cg)
            cgi = len(self.groups) - 1
            for kind, idx in part:
                if kind == "c":
                    self.call_group[idx] = cgi
                else:
                    self.groups[idx].parent = cgi
            g.items.append(("g", cgi))

    def _place_nodes(self) -> None:
        """A grad node sits in its call's group; a leaf accumulator in the first group of the
        module that owns its parameter, else beside the first call that read the tensor (a
        plain input), else in the nearest enclosing module; external nodes at the root."""
        first_for_path: dict[str, int] = {}
        for gi, g in enumerate(self.groups):
            if g.kind == "module":
                first_for_path.setdefault(g.path, gi)
        first_reader: dict[str, int] = {}
        for ci, c in enumerate(self.calls):
            for t in c.inputs:
                first_reader.setdefault(t, ci)
        for ni, n in enumerate(self.nodes):
            gi = 0
            if n.call in self.call_index:
                gi = self.call_group[self.call_index[n.call]]
            elif n.param is not None and not n.external:
                path = param_module(n.param)
                if path in first_for_path:
                    gi = first_for_path[path]
                elif n.param in first_reader:
                    gi = self.call_group[first_reader[n.param]]
                else:
                    while path and path not in first_for_path:
                        path = parent_path(path)
                    gi = first_for_path.get(path, 0)
            self.node_group[ni] = gi

    # ---- output --------------------------------------------------------------------------
    def depths(self) -> list[int]:
        out: list[int] = []
        for gi in range(len(self.groups)):
            out.append(sum(1 for _ in self._ancestors(gi)) - 1)
        return out

    def counts(self) -> tuple[list[int], list[int]]:
        ncalls = [0] * len(self.groups)
        nnodes = [0] * len(self.groups)
        for gi in self.call_group:
            for a in self._ancestors(gi):
                ncalls[a] += 1
        for gi in self.node_group:
            for a in self._ancestors(gi):
                nnodes[a] += 1
        return ncalls, nnodes

    def _ancestors(self, gi: int | None) -> Iterable[int]:
        while gi is not None:
            yield gi
            gi = self.groups[gi].parent

    def initial_open(self, ncalls: list[int], nnodes: list[int]) -> list[int]:
        """Expand module groups level by level while the page stays within the budget.

        Only ``root``/``module``/``function`` groups open by depth: line, part and chunk groups
        exist because they are large, so they start folded."""
        depth = self.depths()
        foldable = {"root", "module", "function"}
        children: dict[int, list[int]] = defaultdict(list)
        for gi, g in enumerate(self.groups):
            if g.parent is not None:
                children[g.parent].append(gi)

        own_nodes = [0] * len(self.groups)
        for gi in self.node_group:
            own_nodes[gi] += 1

        def visible(open_set: set[int]) -> int:
            total = 0
            stack = [0]
            while stack:
                gi = stack.pop()
                if gi not in open_set:
                    total += (ncalls[gi] > 0) + (nnodes[gi] > 0)
                    continue
                g = self.groups[gi]
                total += sum(1 for k, _ in g.items if k == "c")
                total += own_nodes[gi]
                stack.extend(children[gi])
            return total

        open_set = {0}
        for level in range(1, max(depth, default=0) + 1):
            candidate = open_set | {gi for gi, g in enumerate(self.groups)
                                    if depth[gi] == level and g.kind in foldable
                                    and g.parent in open_set}
            if candidate == open_set or visible(candidate) > INITIAL_VISIBLE_BUDGET:
                break
            open_set = candidate
        return sorted(open_set)


def _summary(trace: Trace) -> dict[str, Any]:
    params = first_params(trace)
    devices = sorted({t.device for t in trace.tensors.values()})
    nonfinite_names = [t.name for t in nonfinite(trace)]
    report = trace.anomalies
    return {
        "model": trace.modules.get("", ""),
        "devices": devices,
        "calls": len(trace.calls),
        "grad_nodes": len(trace.grad_nodes),
        "tensors": len(trace.tensors),
        "backward_runs": len(trace.backward_runs),
        "modules": len(trace.modules),
        "params": len(params),
        "param_numel": sum(t.numel for t in params),
        "nonfinite": nonfinite_names[:200],
        "nonfinite_count": len(nonfinite_names),
        "header": trace.header,
        "meta": {k: trace.meta[k] for k in ("argv", "started", "host", "seconds") if k in trace.meta},
        "status": trace.status,
        "error": trace.error,
        "notes": list(trace.notes),
        "numerics": _numerics(report),
    }


def _numerics(report: NumericsReport) -> dict[str, Any]:
    """The numerics report's story as the page shows it: the banner (headline, spread, notes),
    the "first NaN" button's target, and which values are red (``values``: the NaN and unintended
    Infs the story counts; every other non-finite value is an intended Inf or dropped: grey)."""
    skipped = report.skipped_step
    # The sentences hold names and source lines of the trace: shown inert (invisible and control
    # characters escaped), as every other string of the page.
    return {"headline_text": inert(report.headline_text()) if report.checked else "",
            "headline": _anomaly(report.headline),
            "skipped": None if skipped is None else inert(skipped.headline()),
            "spread": inert(report.spread.line()) if report.spread.count else "",
            "notes": [inert(n) for n in report.notes()],
            "scaler": [inert(o.describe()) for o in report.scaler_overflows],
            "values": report.nonfinite_values}


def _anomaly(a: Anomaly | None) -> dict[str, Any] | None:
    """What the page's "first NaN" button selects and says."""
    if a is None:
        return None
    return {"kind": a.kind, "tensor": a.tensor, "producer": a.producer, "node": a.node, "origin": a.origin,
            "arrived": a.arrived, "phase": a.phase, "nan": a.nan, "inf": a.inf, "from_forward": a.from_forward,
            "state_unchecked": a.state_unchecked}


def build_payload(trace: Trace) -> dict[str, Any]:
    """The whole report as plain JSON-ready data (see the module docstring for its shape)."""
    b = _Builder(trace)
    b.build_groups()
    depth = b.depths()
    ncalls, nnodes = b.counts()
    run_pos: dict[str, tuple[int, int]] = {}
    for ri, run in enumerate(trace.backward_runs):
        for k, step in enumerate(run.steps):
            run_pos[step.node] = (ri, k)  # the last run that executed a node wins, as in Trace.resolve

    def node_row(ni: int, n: GradNode) -> list[Any]:
        ri, k = run_pos.get(n.name, (None, None))
        return [n.name, n.kind, n.call, n.param, n.next, n.stack_id, n.external, n.grads_in,
                n.grads_out, b.node_group[ni], ri, k]

    return {
        "format": "gradtrace-html",
        "version": PAYLOAD_VERSION,
        "summary": _summary(trace),
        "frames": [[f.file, f.line, f.function, f.code, frame_class(f.file)] for f in trace.frames],
        "stacks": [list(s) for s in trace.stacks],
        "modules": dict(trace.modules),
        "tensors": {"fields": TENSOR_FIELDS, "rows": [_tensor_row(t) for t in trace.tensors_in_order()]},
        "calls": {"fields": CALL_FIELDS, "rows": [
            [c.name, c.api, c.module, c.kind, c.phase, c.inputs, c.outputs, c.args, c.grad_nodes,
             c.stack_id, c.parent, c.mutated, c.error, b.call_group[i]] for i, c in enumerate(trace.calls)]},
        "nodes": {"fields": NODE_FIELDS, "rows": [node_row(i, n) for i, n in enumerate(trace.grad_nodes)]},
        "groups": {"fields": GROUP_FIELDS, "rows": [
            [g.id, g.kind, g.label, g.path, g.cls, g.parent, depth[gi], g.call, ncalls[gi], nnodes[gi], g.where]
            for gi, g in enumerate(b.groups)]},
        "runs": [{"name": r.name, "api": r.api, "roots": r.roots, "stack": r.stack_id, "order": r.order,
                  "outputs": r.outputs, "status": r.status, "error": r.error} for r in trace.backward_runs],
        "fwd_edges": b.fwd_edges,
        "bwd_edges": b.bwd_edges(),
        "open": b.initial_open(ncalls, nnodes),
        "omitted": None,
        "unsafe": UNSAFE_JS,
    }


def rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``{"fields", "rows"}`` table as dicts (for tests and tools reading the payload)."""
    fields = table["fields"]
    return [dict(zip(fields, r)) for r in table["rows"]]


__all__ = ["PAYLOAD_VERSION", "build_payload", "rows"]
