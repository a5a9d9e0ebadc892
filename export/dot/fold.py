"""What the DOT picture of a trace shows: nodes, edges and clusters, after folding.

``build(trace, ...)`` turns a ``Trace`` into a plain ``Graph``; ``export.dot.write`` writes it out.
Everything is keyed by the trace's own names, never by ``id()``, and visited in recording order,
so the same program always gives the same graph.

Folding works on one mapping: every call, grad node and outside tensor is drawn as some node.
``depth=N`` sends every call made inside a depth-N module (by it or by its submodules) to one
node for that module, and its grad nodes to a matching backward node; calls at the top level
(the loss, the optimizer) stay as they are. ``fold_repeats`` sends the calls of structurally
identical sibling modules (``h.0`` .. ``h.11``) to the corresponding call of the first one, which is
then drawn once and marked ``×12``. Edges are then drawn between the nodes their ends map to,
once per (source, target, tensor) triple; edges inside one node disappear.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from export.views import module_with_class, parent_path
from tracer.model import BackwardRun, Call, GradNode, TensorRecord, Trace
from tracer.model.display import clip, module_depth, param_module, plural, shape_spaced, short_api, within


@dataclass
class GNode:
    """A drawn node. ``kind`` picks its style in ``export.dot.write`` (see ``NODE_STYLES`` there)."""

    id: str
    kind: str
    lines: list[str]
    alert: bool = False


@dataclass
class GEdge:
    """A drawn edge: ``tensor`` (forward data), ``grad`` (gradient), ``link`` (call ↔ grad node)
    or ``nested`` (a grad node that ran a call during backward)."""

    src: str
    dst: str
    kind: str
    lines: list[str] = field(default_factory=list)
    alert: bool = False
    merged: list[str] = field(default_factory=list)  # original names this edge stands for


@dataclass
class Cluster:
    id: str
    lines: list[str]
    kind: str  # section | module | nest | legend
    items: list[tuple[str, str]] = field(default_factory=list)  # ("node"|"cluster", id) in order


@dataclass
class Graph:
    title: list[str] = field(default_factory=list)
    nodes: dict[str, GNode] = field(default_factory=dict)
    clusters: dict[str, Cluster] = field(default_factory=dict)
    items: list[tuple[str, str]] = field(default_factory=list)  # top level, in order
    edges: list[GEdge] = field(default_factory=list)
    where: dict[str, str | None] = field(default_factory=dict)  # item id -> its cluster

    def place(self, kind: str, item_id: str, cluster: str | None) -> None:
        (self.items if cluster is None else self.clusters[cluster].items).append((kind, item_id))
        self.where[item_id] = cluster


# ---- labels -------------------------------------------------------------------------------------
def tensor_lines(rec: TensorRecord | None, name: str, checksums: bool) -> tuple[list[str], bool]:
    """Label lines for a tensor (name / shape dtype [device] / #md5 / NaN counts) and whether
    it holds NaN or Inf values."""
    if rec is None:
        return [name], False
    kind = f"{shape_spaced(rec.shape)} {rec.dtype}"
    if rec.device and rec.device != "cpu":
        kind += f" {rec.device}"
    lines = [name, kind]
    if checksums:
        if rec.md5:
            lines.append("#" + rec.md5[:8])
        elif rec.fingerprint:
            lines.append("~" + rec.fingerprint[:8])
        elif rec.hash_note:
            lines.append(clip(rec.hash_note, 32))
    alert = False
    if rec.stats is not None and not rec.stats.finite:
        alert = True
        lines.append(f"NaN {rec.stats.nan} Inf {rec.stats.inf}")
    return lines, alert


# ---- repeated blocks ----------------------------------------------------------------------------
@dataclass
class RepeatGroup:
    members: list[str]  # sibling module paths in numeric order; members[0] is drawn

    @property
    def rep(self) -> str:
        return self.members[0]

    def note(self) -> str:
        return f"×{len(self.members)}: {self.members[0]} … {self.members[-1]}"


class Repeats:
    """Finds runs of structurally identical sibling modules and maps their elements onto the
    first one: calls by position, grad nodes by position within their call, parameters by the
    path below the module."""

    def __init__(self, trace: Trace, calls: list[Call], known: set[str], depth: int | None) -> None:
        self.groups: list[RepeatGroup] = []
        self.call_map: dict[str, str] = {}
        self.node_map: dict[str, str] = {}
        self.tensor_map: dict[str, str] = {}
        self.member: dict[str, tuple[int, int]] = {}  # element name -> (group, member index)
        self._trace = trace
        self._calls = [c for c in calls if c.phase != "backward"]
        self._node_kind = {n.name: n.kind for n in trace.grad_nodes}
        if not self._calls:
            return
        for parent in sorted({parent_path(p) for p in known if p}, key=lambda p: (module_depth(p), p)):
            if any(within(parent, m) for g in self.groups for m in g.members):
                continue  # already inside a folded repeat
            kids = sorted((p for p in known if p and parent_path(p) == parent
                           and p.rpartition(".")[2].isdigit()
                           and (depth is None or module_depth(p) <= depth)),
                          key=lambda p: int(p.rpartition(".")[2]))
            sigs = [self._signature(kid) for kid in kids]
            i = 0
            while i < len(kids):  # runs of equal, non-empty signatures
                j = i + 1
                while sigs[i] is not None and j < len(kids) and sigs[j] == sigs[i]:
                    j += 1
                if j - i >= 2:
                    self._add_group(kids[i:j])
                i = j

    def _subtree(self, path: str) -> list[Call]:
        return [c for c in self._calls if within(c.module, path)]

    def _signature(self, path: str) -> tuple[object, ...] | None:
        calls = self._subtree(path)
        if not calls:
            return None
        pos = {c.name: i for i, c in enumerate(calls)}
        tensors = self._trace.tensors
        kinds = self._node_kind

        def meta(names: list[str]) -> tuple[object, ...]:
            return tuple((tensors[n].shape, tensors[n].dtype) if n in tensors else None for n in names)

        def rel(module: str) -> str:
            return module[len(path):]

        return (self._trace.modules.get(path), tuple(
            (rel(c.module), c.api, c.args, c.kind, meta(c.inputs), meta(c.outputs),
             tuple(kinds.get(g, g) for g in c.grad_nodes), pos.get(c.parent or ""))
            for c in calls))

    def _add_group(self, members: list[str]) -> None:
        gi = len(self.groups)
        self.groups.append(RepeatGroup(list(members)))
        rep_calls = self._subtree(members[0])
        params = [t for t in self._trace.tensors_in_order() if t.role in ("param", "buffer")]
        node_names = {n.name for n in self._trace.grad_nodes}
        for mi, path in enumerate(members):
            for c, r in zip(self._subtree(path), rep_calls):
                self.member[c.name] = (gi, mi)
                self.call_map[c.name] = r.name
                for out, rout in zip(c.outputs, r.outputs):
                    self.tensor_map.setdefault(out, rout)
                for g, rg in zip(c.grad_nodes, r.grad_nodes):
                    self.member[g] = (gi, mi)
                    self.node_map[g] = rg
            for t in params:
                if t.name.startswith(path + "."):
                    rep_name = members[0] + t.name[len(path):]
                    self.member[t.name] = (gi, mi)
                    if rep_name in self._trace.tensors:
                        self.tensor_map[t.name] = rep_name
                    leaf, rep_leaf = f"{t.name}/AccumulateGrad", f"{rep_name}/AccumulateGrad"
                    if leaf in node_names:
                        self.member[leaf] = (gi, mi)
                        if rep_leaf in node_names:
                            self.node_map[leaf] = rep_leaf

    def call(self, name: str) -> str:
        return self.call_map.get(name, name)

    def node(self, name: str) -> str:
        return self.node_map.get(name, name)

    def tensor(self, name: str) -> str:
        return self.tensor_map.get(name, name)

    def crosses(self, a: str, b: str) -> bool:
        """True for an edge between two different copies of one repeated block (h.3 -> h.4):
        drawn once, it would loop from the block back into itself."""
        ma, mb = self.member.get(a), self.member.get(b)
        return ma is not None and mb is not None and ma[0] == mb[0] and ma[1] != mb[1]

    def group_of(self, path: str) -> RepeatGroup | None:
        for g in self.groups:
            if g.rep == path:
                return g
        return None


# ---- the builder --------------------------------------------------------------------------------
class _Builder:
    def __init__(self, trace: Trace, depth: int | None, fold_repeats: bool, forward: bool,
                 backward: bool, checksums: bool, optimizer_detail: bool = False) -> None:
        self.t = trace
        self.depth = depth
        self.optimizer_detail = optimizer_detail
        self.optimizer_nodes: list[tuple[str, Call]] = []  # collapsed optimizer steps, for their edge
        self.forward = forward
        self.backward = backward
        self.checksums = checksums
        self.g = Graph()
        self.calls = {c.name: c for c in trace.calls}
        self.call_index = {c.name: i for i, c in enumerate(trace.calls)}
        self.gnodes = {n.name: n for n in trace.grad_nodes}
        self.gnode_index = {n.name: i for i, n in enumerate(trace.grad_nodes)}
        self.fwd_calls = [c for c in trace.calls if c.phase != "backward"] if forward else []
        self.bwd_calls = [c for c in trace.calls if c.phase == "backward"] if backward else []
        self.known = self._known_modules()
        self.rep = Repeats(trace, trace.calls if fold_repeats else [], self.known, depth)
        self.ids: dict[tuple[str, str], str] = {}
        self.counters: dict[str, int] = {}
        self.fold_calls: dict[str, set[str]] = {}  # fold node id -> rep call names inside
        self.fold_params: dict[str, set[str]] = {}
        self.fold_module: dict[str, str] = {}
        self.mod_clusters: dict[tuple[str, str], str] = {}
        self.nest_clusters: dict[str, str] = {}
        self.edge_keys: dict[tuple[str, str, str], GEdge] = {}
        self.call_key: dict[str, tuple[str, str]] = {}
        for c in [*self.fwd_calls, *self.bwd_calls]:
            self.call_key[c.name] = self._call_key(c)
        # Custom Function calls drawn with the calls made inside them, in a cluster of their own.
        self.has_children = {p for c in [*self.fwd_calls, *self.bwd_calls]
                             if (p := self._nest_parent(c)) is not None}

    # ---- modules and folding ----------------------------------------------------------------
    def _known_modules(self) -> set[str]:
        known = set(self.t.modules)
        for c in self.t.calls:
            p = c.module
            while p:
                known.add(p)
                p = parent_path(p)
        return known

    def known_parent(self, path: str) -> str:
        p = parent_path(path)
        while p and p not in self.known:
            p = parent_path(p)
        return p

    def fold_key(self, module: str) -> str | None:
        """The depth-N module a call in ``module`` folds into, or None when it is drawn unfolded.

        Calls below depth N fold into their depth-N ancestor, and so do the calls a depth-N
        module makes itself, so that each depth-N module is one node rather than a node for its
        children beside a cluster for its own calls. Calls at the top level ('' = the root module
        or code outside any module: the loss, the optimizer) are never folded."""
        if self.depth is None or module == "":
            return None
        if self.depth == 0:
            return ""
        if module_depth(module) < self.depth:
            return None
        return ".".join(module.split(".")[: self.depth])

    def _call_key(self, c: Call) -> tuple[str, str]:
        rc = self.calls[self.rep.call(c.name)]
        if rc.phase == "backward":
            return ("call", rc.name)
        chain = [rc]
        while chain[-1].parent in self.calls:
            chain.append(self.calls[chain[-1].parent])
        for a in reversed(chain):  # the outermost folded ancestor takes the whole nest
            k = self.fold_key(a.module)
            if k is not None:
                return ("fold", k)
        return ("call", rc.name)

    def _nest_parent(self, c: Call) -> str | None:
        """The custom Function call this call is drawn inside, if both are drawn as calls."""
        if c.parent in self.calls and c.parent in self.call_key and self.call_key[c.name][0] == "call" \
                and self.call_key[c.parent] == ("call", self.rep.call(c.parent)):
            return self.rep.call(c.parent)
        return None

    def module_label(self, path: str) -> list[str]:
        lines = [module_with_class(self.t, path)]
        grp = self.rep.group_of(path)
        if grp is not None:
            lines.append(grp.note())
        return lines

    # ---- clusters -----------------------------------------------------------------------------
    def section(self, name: str) -> str:
        cid = f"cluster_{name}"
        if cid not in self.g.clusters:
            self.g.clusters[cid] = Cluster(cid, [name], "section")
            self.g.place("cluster", cid, None)
        return cid

    def module_cluster(self, sec: str, path: str) -> str:
        if path == "":
            return self.section(sec)
        key = (sec, path)
        if key not in self.mod_clusters:
            parent = self.module_cluster(sec, self.known_parent(path))
            cid = f"cluster_{sec[0]}{self._count('cluster_' + sec)}"
            self.g.clusters[cid] = Cluster(cid, self.module_label(path), "module")
            self.g.place("cluster", cid, parent)
            self.mod_clusters[key] = cid
        return self.mod_clusters[key]

    def call_cluster(self, sec: str, c: Call) -> str:
        parent = self._nest_parent(c)
        if parent is not None:
            return self.nest_cluster(sec, self.calls[parent])
        if c.phase == "backward":
            return self.section(sec)
        return self.module_cluster(sec, c.module)

    def nest_cluster(self, sec: str, c: Call) -> str:
        if c.name not in self.nest_clusters:
            outer = self.call_cluster(sec, c)
            cid = f"cluster_n{self.call_index[c.name]}"
            self.g.clusters[cid] = Cluster(cid, [f"inside {c.name}"], "nest")
            self.g.place("cluster", cid, outer)
            self.nest_clusters[c.name] = cid
        return self.nest_clusters[c.name]

    # ---- nodes ---------------------------------------------------------------------------------
    def _count(self, what: str) -> int:
        n = self.counters.get(what, 0)
        self.counters[what] = n + 1
        return n

    def node_for_call(self, c: Call) -> str:
        sec = "backward" if c.phase == "backward" else "forward"
        key = self.call_key[c.name]
        if key in self.ids:
            return self.ids[key]
        if key[0] == "fold":
            nid = f"m{self._count('m')}"
            self.g.nodes[nid] = GNode(nid, "fold", [])
            self.fold_module[nid] = key[1]
            self.g.place("node", nid, self.module_cluster(sec, self.known_parent(key[1])))
        else:
            rc = self.calls[key[1]]
            nid = f"c{self.call_index[rc.name]}"
            lines = [rc.name, short_api(rc.api)]
            if rc.args:
                lines.append(clip(rc.args))
            if rc.error:
                lines.append("raised: " + clip(rc.error, 36))
            kind = "function" if rc.kind in ("function", "custom_op") else "compiled" if rc.kind == "compiled" \
                else "bcall" if rc.phase == "backward" else "call"
            if self._collapsed(rc):
                lines, kind = self._optimizer_lines(rc), "optimizer"
            self.g.nodes[nid] = GNode(nid, kind, lines, alert=bool(rc.error))
            cluster = self.nest_cluster(sec, rc) if rc.name in self.has_children else self.call_cluster(sec, rc)
            self.g.place("node", nid, cluster)
        self.ids[key] = nid
        return nid

    def _collapsed(self, c: Call) -> bool:
        """An optimizer step drawn as one node: its inputs are every parameter, gradient and
        state tensor, and drawn one by one they would make the picture as wide as the model."""
        return c.kind == "optimizer" and not self.optimizer_detail

    def _optimizer_lines(self, c: Call) -> list[str]:
        roles: dict[str, int] = {}
        for name in dict.fromkeys(c.inputs):
            rec = self.t.tensors.get(name)
            role = rec.role if rec is not None else "other"
            roles[role] = roles.get(role, 0) + 1
        lines = [f"{c.name}: {plural(roles.get('param', 0), 'param')}", short_api(c.api)]
        extra = [plural(roles[r], w) for r, w in (("grad", "grad"), ("state", "state tensor")) if roles.get(r)]
        if extra:
            lines.append("reads " + ", ".join(extra))
        if c.error:
            lines.append("raised: " + clip(c.error, 36))
        return lines

    def target(self, call_name: str) -> str:
        """The drawn node of a call, made now if its section comes later: a backward call's
        output read by a forward call (a gradient a backward hook kept, a parameter an
        optimizer stepped inside a post-accumulate-grad hook)."""
        nid = self.ids.get(self.call_key[call_name])
        return nid if nid is not None else self.node_for_call(self.calls[call_name])

    def node_for_source(self, sec: str, name: str) -> str:
        rname = self.rep.tensor(name)
        key = ("source" + sec, rname)
        if key not in self.ids:
            nid = f"s{self._count('s')}"
            rec = self.t.tensors.get(rname)
            lines, alert = tensor_lines(rec, rname, self.checksums)
            lines.append(f"source: {rec.role}" if rec is not None else "source: not recorded")
            self.g.nodes[nid] = GNode(nid, "source", lines, alert)
            cluster = self.section(sec)
            if rec is not None and rec.role in ("param", "buffer"):
                mod = param_module(rname)
                if mod in self.known and self.fold_key(mod) is None:
                    cluster = self.module_cluster(sec, mod)
                elif mod in self.known:
                    cluster = self.module_cluster(sec, self.known_parent(self.fold_key(mod) or ""))
            self.g.place("node", nid, cluster)
            self.ids[key] = nid
        return self.ids[key]

    def node_for_sink(self, name: str, cluster: str | None) -> str:
        rname = self.rep.tensor(name)
        key = ("sink", rname)
        if key not in self.ids:
            nid = f"o{self._count('o')}"
            lines, alert = tensor_lines(self.t.tensors.get(rname), rname, self.checksums)
            self.g.nodes[nid] = GNode(nid, "sink", lines, alert)
            self.g.place("node", nid, cluster)
            self.ids[key] = nid
        return self.ids[key]

    def grad_key(self, n: GradNode) -> tuple[str, str]:
        rn = self.gnodes[self.rep.node(n.name)]
        if rn.call in self.calls:
            ck = self._call_key(self.calls[rn.call])
            if ck[0] == "fold":
                return ("gfold", ck[1])
        elif rn.param is not None and param_module(rn.param) in self.known:
            k = self.fold_key(param_module(rn.param))
            if k is not None:
                return ("gfold", k)
        return ("grad", rn.name)

    def node_for_grad(self, n: GradNode) -> str:
        key = self.grad_key(n)
        if key in self.ids:
            return self.ids[key]
        if key[0] == "gfold":
            nid = f"mb{self._count('mb')}"
            self.g.nodes[nid] = GNode(nid, "gfold", [])
            self.fold_module[nid] = key[1]
            self.fold_calls[nid] = set()
            self.g.place("node", nid, self.module_cluster("backward", self.known_parent(key[1])))
        else:
            rn = self.gnodes[key[1]]
            nid = f"g{self.gnode_index[rn.name]}"
            cluster = self.section("backward")
            if rn.param is not None:
                rec = self.t.tensors.get(rn.param)
                lines = [rn.param, rn.kind]
                if rec is not None:
                    lines.append(f"{shape_spaced(rec.shape)} {rec.dtype}")
                kind = "leaf"
                if param_module(rn.param) in self.known:
                    cluster = self.module_cluster("backward", param_module(rn.param))
            elif rn.external or rn.call is None:
                lines, kind = [rn.name, "made before the traced block"], "external"
            else:
                lines, kind = [rn.name], "grad"
                rc = self.calls.get(rn.call)
                if rc is not None and rc.phase != "backward":
                    cluster = self.module_cluster("backward", rc.module)
            self.g.nodes[nid] = GNode(nid, kind, lines)
            self.g.place("node", nid, cluster)
        self.ids[key] = nid
        return nid

    # ---- edges ---------------------------------------------------------------------------------
    def add_edge(self, src: str, dst: str, kind: str, key: str, original: str = "",
                 lines: list[str] | None = None, alert: bool = False) -> None:
        if src == dst:
            return  # inside one folded node
        k = (src, dst, kind + ":" + key)
        edge = self.edge_keys.get(k)
        if edge is None:
            edge = GEdge(src, dst, kind, list(lines or []), alert)
            self.edge_keys[k] = edge
            self.g.edges.append(edge)
        if original and original not in edge.merged:
            edge.merged.append(original)

    def producer_call(self, name: str, consumer: Call) -> str | None:
        """The drawn call an input comes from: its producer, or the outermost enclosing custom
        Function that returns it to a consumer outside that Function."""
        rec = self.t.tensors.get(name)
        p = rec.producer if rec is not None else None
        if p is None or p not in self.call_key:
            return None
        best, a = p, self.calls[p].parent
        while a in self.calls:
            if name in self.calls[a].outputs and not self._inside(consumer, a) and a in self.call_key:
                best = a
            a = self.calls[a].parent
        return best

    def _inside(self, c: Call, ancestor: str) -> bool:
        p = c.parent
        while p in self.calls:
            if p == ancestor:
                return True
            p = self.calls[p].parent
        return False

    def tensor_edge(self, src: str, dst: str, name: str) -> None:
        lines, alert = tensor_lines(self.t.tensors.get(name), name, self.checksums)
        self.add_edge(src, dst, "tensor", self.rep.tensor(name), name, lines, alert)

    # ---- the passes ----------------------------------------------------------------------------
    def build(self) -> Graph:
        runs: list[BackwardRun] = self.t.backward_runs if self.backward else []
        consumed: set[str] = {n for c in [*self.fwd_calls, *self.bwd_calls] for n in c.inputs}
        if self.forward and self.backward:
            consumed.update(r for b in runs for r in b.roots)
        if self.backward:
            for n in self.t.grad_nodes:
                consumed.update(x for x in [*n.grads_in, *n.grads_out] if x)

        # Which outside tensors fold away into the module that owns them (parameters of a
        # folded block used only inside it): counted in the fold node's label instead.
        source_targets: dict[str, set[tuple[str, str]]] = {}
        for c in self.fwd_calls:
            if self._collapsed(c):
                continue
            for name in c.inputs:
                if self.producer_call(name, c) is None:
                    source_targets.setdefault(self.rep.tensor(name), set()).add(self.call_key[c.name])
        absorbed: dict[str, tuple[str, str]] = {}
        for rname, targets in source_targets.items():
            rec = self.t.tensors.get(rname)
            if rec is None or rec.role not in ("param", "buffer") or len(targets) != 1:
                continue
            key = next(iter(targets))
            if key[0] == "fold" and within(param_module(rname), key[1]):
                absorbed[rname] = key

        if self.forward:
            self.section("forward")
            self._calls_pass("forward", self.fwd_calls, consumed, absorbed)
        if self.backward:
            self.section("backward")
            for i, b in enumerate(runs):
                nid = f"b{i}"
                lines = [b.name, short_api(b.api)]
                if not self.forward or not b.steps:
                    lines.append("roots: " + clip(", ".join(b.roots), 36))
                if b.status != "ok":
                    lines.append(b.status + (": " + clip(b.error, 30) if b.error else ""))
                self.g.nodes[nid] = GNode(nid, "run", lines, alert=b.status != "ok")
                self.g.place("node", nid, self.section("backward"))
            for n in self.t.grad_nodes:
                nid = self.node_for_grad(n)
                if nid in self.fold_calls and not n.param:
                    self.fold_calls[nid].add(self.rep.node(n.name))
                elif nid in self.fold_calls:
                    self.fold_params.setdefault(nid, set()).add(self.rep.node(n.name))
            self._calls_pass("backward", self.bwd_calls, consumed, absorbed)
            self._grad_edges(runs)
        if self.forward and self.backward:
            self._links()
        self._fold_labels()
        return self.g

    def _calls_pass(self, sec: str, calls: list[Call], consumed: set[str],
                    absorbed: dict[str, tuple[str, str]]) -> None:
        for c in calls:
            if self._collapsed(c):
                self.optimizer_nodes.append((self.node_for_call(c), c))
                continue
            # Sources first so that they sit above their first consumer.
            for name in c.inputs:
                if self.producer_call(name, c) is None and self.rep.tensor(name) not in absorbed:
                    self.node_for_source(sec, name)
            nid = self.node_for_call(c)
            if nid in self.fold_module:
                self.fold_calls.setdefault(nid, set()).add(self.rep.call(c.name))
            for name in c.inputs:
                src_call = self.producer_call(name, c)
                rname = self.rep.tensor(name)
                if src_call is None and rname in absorbed:
                    self.fold_params.setdefault(self.ids[absorbed[rname]], set()).add(rname)
                    continue
                if src_call is None:
                    src = self.node_for_source(sec, name)
                    if self.rep.crosses(name, c.name):
                        continue
                elif self.rep.crosses(src_call, c.name):
                    continue
                else:
                    src = self.target(src_call)
                self.tensor_edge(src, nid, name)
            parent = self.calls.get(c.parent or "")
            for name in c.outputs:
                if name in consumed or (parent is not None and name in parent.outputs):
                    continue
                self.tensor_edge(nid, self.node_for_sink(name, self.g.where[nid]), name)

    def _grad_edges(self, runs: list[BackwardRun]) -> None:
        for n in self.t.grad_nodes:
            src = self.node_for_grad(n)
            for i, dest in enumerate(n.next):
                if dest is None or dest not in self.gnodes or self.rep.crosses(n.name, dest):
                    continue
                dst = self.node_for_grad(self.gnodes[dest])
                grad = n.grads_out[i] if i < len(n.grads_out) else None
                if grad:
                    lines, alert = tensor_lines(self.t.tensors.get(grad), grad, self.checksums)
                else:
                    lines, alert = [], False
                self.add_edge(src, dst, "grad", f"{self.rep.node(n.name)}:{i}", grad or "", lines, alert)
        for i, b in enumerate(runs):
            if self.forward:
                for root in b.roots:
                    rec = self.t.tensors.get(root)
                    if rec is not None and rec.producer in self.call_key:
                        self.tensor_edge(self.target(rec.producer), f"b{i}", root)
            targets = {d for s in b.steps if s.node in self.gnodes for d in self.gnodes[s.node].next if d}
            for s in b.steps:
                if s.node in self.gnodes and s.node not in targets:  # a node the run itself fed
                    grad = s.grads_in[0] if s.grads_in else None
                    lines, alert = tensor_lines(self.t.tensors.get(grad), grad, self.checksums) if grad \
                        else ([], False)
                    self.add_edge(f"b{i}", self.node_for_grad(self.gnodes[s.node]), "grad",
                                  f"{b.name}:{s.node}", grad or "", lines, alert)
        for nid, c in self.optimizer_nodes:  # the gradients of the backward run just before the step
            before = [i for i, b in enumerate(runs) if b.seq < c.seq]
            if before:
                grads = sum(1 for n in dict.fromkeys(c.inputs)
                            if (rec := self.t.tensors.get(n)) is not None and rec.role == "grad")
                self.add_edge(f"b{before[-1]}", nid, "grad_flow", "step:" + c.name, "",
                              [plural(grads, "gradient")] if grads else [])
        for c in self.bwd_calls:  # calls a grad node made while it ran (custom Function backward)
            if c.parent in self.gnodes:
                self.add_edge(self.node_for_grad(self.gnodes[c.parent]), self.target(c.name), "nested", c.name)

    def _links(self) -> None:
        for c in self.fwd_calls:
            for g in c.grad_nodes:
                if g in self.gnodes:
                    self.add_edge(self.target(c.name), self.node_for_grad(self.gnodes[g]), "link", "")
        for n in self.t.grad_nodes:  # a parameter (and its .grad read later) <-> its accumulator
            if n.param is not None:
                for name in (n.param, n.param + "@grad", n.param + ".grad"):  # (.grad: format version 1)
                    src = self.ids.get(("sourceforward", self.rep.tensor(name)))
                    if src is not None:
                        self.add_edge(src, self.node_for_grad(n), "link", "")

    def _is_param(self, name: str) -> bool:
        rec = self.t.tensors.get(name)
        return rec is not None and rec.role in ("param", "buffer")

    def _fold_labels(self) -> None:
        for nid, module in self.fold_module.items():
            node = self.g.nodes[nid]
            head = self.module_label(module)
            ncalls = len(self.fold_calls.get(nid, ()))
            nparams = len(self.fold_params.get(nid, ()))
            if node.kind == "fold":
                # Parameters entering the block have their own edges and are not data flow.
                ins = _shapes(self.t, (e.merged[0] for e in self.g.edges
                                       if e.dst == nid and e.kind == "tensor" and e.merged
                                       and not self._is_param(e.merged[0])))
                outs = _shapes(self.t, (e.merged[0] for e in self.g.edges
                                        if e.src == nid and e.kind == "tensor" and e.merged))
                lines = [head[0], "×" + plural(ncalls, "call")]
                if ins:
                    lines.append("in: " + ins)
                if outs:
                    lines.append("out: " + outs)
                if nparams:
                    lines.append(plural(nparams, "param"))
            else:
                lines = [head[0], "backward: ×" + plural(ncalls, "grad node")]
                if nparams:
                    lines.append(plural(nparams, "param leaf", "param leaves"))
            node.lines = lines + head[1:]


def _shapes(trace: Trace, names: Iterable[str], limit: int = 3) -> str:
    seen: list[str] = []
    for n in names:
        rec = trace.tensors.get(n)
        s = f"{shape_spaced(rec.shape)} {rec.dtype}" if rec is not None else n
        if s not in seen:
            seen.append(s)
    more = len(seen) - limit
    return ", ".join(seen[:limit]) + (f", +{more} more" if more > 0 else "")


AUTO_NODES = 80  # the most nodes an automatic fold leaves: about what a screen shows readably


def _drawn(g: Graph) -> int:
    return len(g.nodes)


def _fitting(trace: Trace, fold_repeats: bool, forward: bool, backward: bool, checksums: bool,
             optimizer_detail: bool) -> tuple[_Builder, Graph, int | None]:
    """The least folded graph with at most ``AUTO_NODES`` nodes: everything, then repeated blocks
    drawn once, then modules folded from the deepest level up; the most folded one if none fits."""
    known = {p for c in trace.calls for p in _ancestors(c.module)} | set(trace.modules)
    deepest = max((module_depth(p) for p in known if p), default=0)
    candidates: list[tuple[int | None, bool]] = [(None, fold_repeats), (None, True)]
    candidates += [(d, True) for d in range(deepest - 1, -1, -1)]
    best: tuple[_Builder, Graph, int | None] | None = None
    for depth, repeats in dict.fromkeys(candidates):
        b = _Builder(trace, depth, repeats, forward, backward, checksums, optimizer_detail)
        best = (b, b.build(), depth)
        if _drawn(best[1]) <= AUTO_NODES:
            break
    assert best is not None
    return best


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def build(trace: Trace, *, depth: int | Literal["auto"] | None = None, fold_repeats: bool = False,
          forward: bool = True, backward: bool = True, checksums: bool = True,
          optimizer_detail: bool = False) -> Graph:
    """The graph to draw for ``trace`` (see the module docstring for what folding does).

    ``depth="auto"`` picks the least folding that leaves at most ``AUTO_NODES`` nodes (and draws
    repeated blocks once if that is needed); ``None`` draws every call. ``optimizer_detail`` draws
    an optimizer step's parameters, gradients and state one by one instead of one node."""
    if isinstance(depth, int) and depth < 0:
        raise ValueError(f"depth must be 0 or more, got {depth}")
    if not forward and not backward:
        raise ValueError("nothing to draw: forward and backward are both off")
    if depth == "auto":
        b, g, chosen = _fitting(trace, fold_repeats, forward, backward, checksums, optimizer_detail)
    else:
        chosen = depth
        b = _Builder(trace, depth, fold_repeats, forward, backward, checksums, optimizer_detail)
        g = b.build()
    parts = [plural(len(trace.calls), "call"), plural(len(trace.grad_nodes), "grad node"),
             plural(len(trace.backward_runs), "backward run")]
    opts = []
    if chosen is not None:
        opts.append(f"each module at depth {chosen} folded into one node")
    if b.rep.groups:
        opts.append("repeated blocks drawn once")
    if depth == "auto" and (chosen is not None or (b.rep.groups and not fold_repeats)):
        opts[-1] += " (chosen to fit; --depth full draws every call)"
    if depth == "auto" and _drawn(g) > AUTO_NODES:
        # Folding works on modules: calls made outside any module (data loading, a loss computed
        # by hand, an optimizer's ops) stay one node each.
        loose = sum(1 for c in trace.calls if not c.module and c.phase == "forward")
        opts.append(f"still {_drawn(g)} nodes, folded as far as modules go: {plural(loose, 'call')} at the top "
                    "level (in no module below the root) cannot be folded (gradtrace report groups them)")
    if not forward:
        opts.append("backward only")
    if not backward:
        opts.append("forward only")
    g.title = ["gradtrace: " + ", ".join(parts)]
    if opts:
        g.title.append("; ".join(opts))
    if trace.status != "ok":
        err = trace.error or {}
        detail = ": " + clip(f"{err.get('type', 'error')}: {err.get('message', '')}", 60) if err else ""
        g.title.append(f"trace {trace.status}{detail}")
    return g
