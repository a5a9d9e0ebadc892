"""The graph (a part of the recorder): naming the grad nodes each call creates and linking them
(``Graph.link_call_nodes``; the edges of one node: ``Graph._link_edges``), hooking them, and
recording every backward run: the order nodes ran in, the gradients each received and
produced (a leaf's ``.grad`` included), the calls a node's own code made, the nodes a
``create_graph`` backward made, and the node a failed backward was running."""

from __future__ import annotations

import functools
import re
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from tracer.analysis.explain import add_note, explain_backward_error
from tracer.model import BackwardRun, GradNode, NodeRun, TensorRecord, names
from tracer.model.names import base_name
from tracer.options import RaisedOnPurpose
from tracer.record.engine import expect_backward
from tracer.record.identity import identity
from tracer.record.leaf_grads import LeafGrads
from tracer.record.listeners import Listener, needs_node_runs
from tracer.record.mode import current_autograd_node, on_traced_thread
from tracer.record.part import Part, remove_all
from tracer.record.stacks import raised_in_backward_python
from tracer.record.tensors import (
    ACCUMULATE,
    NODE_KINDS,
    VIEW_NODES,
    BackwardCFunction,
    creates_graph,
    first,
    flat_tensors,
    get_seq,
    grad_fn_of,
    has_backward_hooks,
    node_kind,
    runs_user_code,
    saved_tensor_hooks_active,
    unique,
    version_of,
)
from tracer.record.transforms import transforms_active
from tracer.record.weakmap import IdWeakMap

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder

_UINT64_MAX = 2**64 - 1
# The node a leaf's gradient goes to (its accumulator): public since torch 2.2.
get_gradient_edge: Any = getattr(torch.autograd.graph, "get_gradient_edge", None)
# Accumulator nodes are marked in their ``metadata`` dict (which lives as long as the C++ node,
# unlike its Python wrapper, and cannot be weakly referenced) with (trace id, node name): a new
# accumulator object for a parameter already named (its first graph died: gradient accumulation,
# a discarded forward) is then told apart from one already hooked.
_NODE_TAG = "gradtrace"


class Graph(Part):
    """Grad nodes and backward runs (a part of ``Recorder``): the nodes each call made, named and
    linked, their hooks, and every backward run. Owns the node tables; a leaf's ``.grad`` is
    named by ``LeafGrads`` (leaf_grads.py), which asks it for a leaf's accumulator."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        self._trace = rec.trace
        self._rec_ref = weakref.ref(rec)  # what the nodes' hooks hold: never the recorder itself
        self._leaves = LeafGrads(rec)
        # Built-in grad nodes get their hook (their runs recorded) at once when this is set,
        # else only when a backward run starts that needs them (see _hook_waiting_nodes):
        # names of the nodes waiting for it.
        self._every_node_run = rec.options.every_node_run
        self._unhooked: set[str] = set()
        self._in_backward = 0
        self._running: list[str] = []  # grad nodes running now (nesting in backward)
        self._node_by_seq: dict[tuple[int, str], str] = {}
        self._acc_by_var: IdWeakMap[str] = IdWeakMap()  # leaf tensor -> its accumulator's name
        self._acc_vars: dict[str, weakref.ref[torch.Tensor]] = {}  # accumulator name -> its leaf
        self._tensor_hooks = False  # Tensor.register_hook was called in the block
        # Non-leaf tensors whose gradient is retained (Tensor.retain_grad in the block): the
        # tensor (weakly) and the name its .grad gets, ``<name then>.grad`` (see grad_retained).
        self._retained: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        # Accumulators hooked without a pre-hook (see _acc_hook_alone): what their leaf's .grad was
        # is noted when a backward starts (LeafGrads.note_grads_before).
        self._acc_post_only: set[str] = set()
        # Nodes whose runs are not recorded and whose hooks read tensors without a name
        # (note_unnamed_hook_input).
        self._hook_inputs_noted: set[str] = set()
        self._node_modules: dict[str, str] = {}  # nodes that run user code -> their call's module
        self._call_modules: dict[str, str] = {}  # call -> its module (see _module_of_call)
        self._calls_indexed = 0
        # A backward run with create_graph=True makes grad nodes while it runs; those are
        # adopted by the node that made them (see _adopt_nodes).
        self._create_graph = False
        # Per adopting node, how many nodes of each class it adopted: a node that runs in
        # several backward runs (autograd.functional.hvp) continues its numbering (#1, #2...).
        self._adopted_kinds: dict[str, dict[str, int]] = {}
        self._bwd_seq0: tuple[int, int] | None = None  # (thread, sequence number) at its start
        self._reads_queued: object = None  # the backward run whose final reading is queued
        self._edges: dict[str, tuple[tuple[str | None, int], ...]] = {}  # node -> (dest node, slot) per output
        self._node_recs: dict[str, GradNode] = {}
        self._external_pending: list[tuple[Any, str]] = []  # external nodes to link (_dest_name)
        self._slot_tensor: dict[tuple[str, int], str] = {}
        # Edges into each (node, input slot) in the graph the running backward walks: a gradient
        # that alone flows into a tensor's slot is that tensor's gradient (see _grad_names).
        self._indegree: dict[tuple[str, int], int] | None = {}
        # The node names the running backward started from (None: every recorded node), for
        # counting _indegree when it is first needed.
        self._indegree_roots: list[str] | None = []
        # A gradient passed on unchanged, by the slot it was sent to: (its name on that edge, a weak
        # reference to the tensor, its version). Where several edges meet in that slot the node
        # takes their sum, a new tensor: the passed-on one may die first, and its id be reused.
        self._passed_on: dict[tuple[str, int], tuple[str, weakref.ref[torch.Tensor], int]] = {}
        # Hooks on nodes that outlive the trace (accumulators, nodes made before the block).
        self._handles: list[Any] = []
        # Grad nodes that run user Python (custom Function backwards, accumulators with
        # post-accumulate hooks such as an optimizer step in backward): flush checksums first.
        self._flush_before: set[str] = set()
        # Saved-tensor hooks were active while the call being finished ran (see _register_node).
        self._saved_hooks = True
        self._run: BackwardRun | None = None
        # The seq of every backward run still being filled: from its start to its end (its
        # outputs named), an enclosing run under the nested runs it started (reentrant
        # checkpointing), and a run the trace did not see start till the end of the block.
        self._open_runs: list[int] = []
        self._run_index = -1
        # slot_grad's suffix (names.grad_suffix), made again only when the run index changes.
        self._suffix_of: tuple[int, str] = (0, names.grad_suffix(0))
        self._open_steps: dict[str, NodeRun] = {}
        self._node_seq = 0

    def release(self) -> None:
        self._leaves.release()
        super().release()

    # ---- what the other parts ask ------------------------------------------------------------
    @property
    def in_backward(self) -> bool:
        """Whether a backward run of this trace is in progress."""
        return self._in_backward > 0

    @property
    def running_node(self) -> str | None:
        """The grad node running now (innermost), when a backward is in progress."""
        return self._running[-1] if self._running else None

    @property
    def run_index(self) -> int:
        """The index of the backward run in progress or last run (0 before any)."""
        return max(self._run_index, 0)

    @property
    def finished_runs(self) -> int:
        """How many backward runs, from the first, are finished: the records a streamed file may
        hold. A run still open (one whose nested runs are running included) and every run after it
        are still being filled."""
        return min(self._open_runs, default=len(self._trace.backward_runs))

    def remove_hooks(self) -> None:
        """Remove the hooks of the nodes that outlive the trace (the trace is ending)."""
        remove_all(self._handles)

    def leaf_of(self, acc: str) -> torch.Tensor | None:
        """The leaf tensor of the accumulator node ``acc``, if it is alive."""
        ref = self._acc_vars.get(acc)
        return ref() if ref is not None else None

    def leaf_name(self, acc: str) -> str:
        """The name of the leaf whose accumulator is ``acc`` (its slot 0's tensor)."""
        return self._slot_tensor[(acc, 0)]

    def slot_grad(self, node: str, slot: int) -> str | None:
        """``<tensor>@grad`` for the gradient into ``node``'s input ``slot`` when that slot is a
        named tensor's (the suffix says which backward run), else None."""
        base = self._slot_tensor.get((node, slot))
        if base is None:
            return None
        index = max(self._run_index, 0)
        if index != self._suffix_of[0]:
            self._suffix_of = (index, names.grad_suffix(index))
        return base + self._suffix_of[1]

    def name_leaf_grad(self, t: torch.Tensor, version: int) -> str | None:
        """A tensor seen for the first time while an accumulator runs (a post-accumulate-grad hook
        reading .grad): the .grad the accumulator has just made, named as its hook would."""
        acc = self._running[-1] if self._running else None
        if acc is None or acc not in self._acc_vars:
            return None
        return self._leaves.name_leaf_grad(t, acc, self._open_steps.get(acc))

    # ---- grad nodes ---------------------------------------------------------------------------
    def link_call_nodes(self, produced: list[torch.Tensor], grad_fns: list[Any], seq0: int | None,
                        seq1: int | None, call: str, stack_id: int | None, names_of: dict[int, str]) -> list[str]:
        """Name and link the grad nodes the call ``call`` made: those reachable from the grad_fn
        of what it produced, inside its sequence-number bracket [``seq0``, ``seq1``). Each
        output's slot of its node is that output's tensor (``names_of``, by identity). Returns
        the nodes' names."""
        node_names: list[str] = []
        local_kinds: dict[str, int] | None = None
        for t, gf in zip(produced, grad_fns):
            if gf is None:
                continue
            if local_kinds is None:
                local_kinds = {}
                self._saved_hooks = saved_tensor_hooks_active()
            root = self._collect_nodes(gf, seq0, seq1, call, stack_id, node_names, local_kinds)
            if root is not None:
                self._slot_tensor[(root, t.output_nr)] = names_of[identity(t)]
        return node_names

    def note_node_call(self, parent: str, call: str) -> None:
        """The call ``call`` was made by ``parent``: when that is the grad node running now (its
        own code), the node's run lists it."""
        running = self._running
        if running and parent == running[-1]:
            step = self._open_steps.get(parent)
            if step is not None:
                step.calls.append(call)

    def module_of_node(self, node: str) -> str:
        """The module of the forward call that made the grad node ``node`` (``""``: none known,
        or the root): where its backward's hooks and recomputations are said to run."""
        module = self._node_modules.get(node)
        if module is not None:
            return module
        rec = self._node_recs.get(node)
        return self._module_of_call(rec.call) if rec is not None and rec.call is not None else ""

    def _module_of_call(self, call: str) -> str:
        """The module of the recorded call ``call``, from an index of the calls' modules brought
        up to date when asked (only backward-phase calls outside every module ask: nothing is
        kept per call on the hot path)."""
        index = self._call_modules
        if call not in index:
            calls = self._trace.calls
            for c in calls[min(self._calls_indexed, len(calls)):]:
                index[c.name] = c.module
            self._calls_indexed = len(calls)
        return index.get(call, "")

    def _node_key(self, node: Any) -> tuple[int, str]:
        return (node._sequence_nr(), NODE_KINDS.get(type(node)) or node_kind(node))

    def _collect_nodes(self, root: Any, seq0: int | None, seq1: int | None, call: str, stack_id: int | None,
                       out: list[str], local_kinds: dict[str, int]) -> str | None:
        """Name the nodes this call created, reachable from ``root``; returns root's name."""
        node_by_seq = self._node_by_seq
        bracket = seq0 is not None and seq1 is not None
        kind = NODE_KINDS.get(type(root)) or node_kind(root)
        if kind == ACCUMULATE:
            return self._accumulator(root)
        sn = root._sequence_nr()
        root_key = (sn, kind)
        # The cheap bracket test first: an output can carry an earlier call's node.
        if (bracket and not (seq0 <= sn < seq1)) or root_key in node_by_seq:
            return node_by_seq.get(root_key)
        nexts = root.next_functions
        new: list[tuple[int, str, Any, Any]] = [(sn, kind, root, nexts)]
        todo = [nxt for nxt, _ in nexts if nxt is not None]
        # Nodes are told apart by (sequence number, class), as everywhere in the recorder; a
        # node reached twice is skipped the second time, whether new or not.
        new_keys: set[tuple[int, str]] = {root_key}
        while todo:
            node = todo.pop()
            kind = NODE_KINDS.get(type(node)) or node_kind(node)
            if kind == ACCUMULATE:
                continue
            sn = node._sequence_nr()
            if bracket and not (seq0 <= sn < seq1):
                continue  # most edges lead to nodes of earlier calls
            key = (sn, kind)
            if key in node_by_seq or key in new_keys:
                continue
            new_keys.add(key)
            nexts = node.next_functions
            new.append((sn, kind, node, nexts))
            for nxt, _ in nexts:
                if nxt is not None:
                    todo.append(nxt)
        if len(new) > 1:
            new.sort(key=first)
        names = self._register_call_nodes(new, call, stack_id, local_kinds)
        out.extend(names)
        for (_, _, node, nexts), nname in zip(new, names):
            self._link_edges(node, nname, nexts)
        return node_by_seq.get(root_key)  # (root's key, read once above)

    def _register_call_nodes(self, new: list[tuple[int, str, Any, Any]], call: str, stack_id: int | None,
                             local_kinds: dict[str, int]) -> list[str]:
        """Name and register the nodes ``new`` (sequence number, kind, node, edges; in order)
        that the call ``call`` made: ``_register_node`` for each, its usual outcome inlined. A
        built-in node that nothing needs to see run (no checksums or stats, no listener, no
        saved-tensor hooks) gets no hook: its record, and its name among the nodes waiting
        for one (``_unhooked``), is all."""
        names: list[str] = []
        plain = not (self._saved_hooks or self._every_node_run or self.rec.listeners)
        node_by_seq, node_recs, unhooked = self._node_by_seq, self._node_recs, self._unhooked
        grad_nodes = self._trace.grad_nodes
        for sn, kind, node, _ in new:
            k = local_kinds.get(kind, 0)
            local_kinds[kind] = k + 1
            nname = f"{call}/{kind}" if k == 0 else f"{call}/{kind}#{k}"
            if plain and not isinstance(node, BackwardCFunction):  # (runs_user_code, for a node made by a call)
                node_by_seq[(sn, kind)] = nname
                # Positional, in GradNode's field order (a record per node).
                rec = GradNode(nname, kind, call, None, [], stack_id, self._node_seq, False)
                self._node_seq += 1
                grad_nodes.append(rec)
                node_recs[nname] = rec
                unhooked.add(nname)
            else:
                self._register_node(node, nname, kind, call, None, stack_id, False, (sn, kind))
            names.append(nname)
        return names

    def _node_name(self, node: Any) -> str | None:
        kind = NODE_KINDS.get(type(node)) or node_kind(node)
        if kind == ACCUMULATE:
            tag = node.metadata.get(_NODE_TAG)
            return tag[1] if tag is not None and tag[0] == self.rec.trace_id else None
        return self._node_by_seq.get((node._sequence_nr(), kind))

    def _accumulator(self, node: Any) -> str:
        """The name of a leaf's accumulator node, hooking every accumulator object the first time
        it is seen. Autograd makes a new ``AccumulateGrad`` for a parameter whenever the last graph
        holding the old one dies (gradient accumulation, a discarded forward): each new object is
        the same accumulator for the trace (one name, one record) but needs its own hooks."""
        md = node.metadata
        tag = md.get(_NODE_TAG)
        if tag is not None and tag[0] == self.rec.trace_id:
            return str(tag[1])
        var = node.variable
        name = self._acc_by_var.get(var)
        if name is None:
            tname = base_name(self.rec.names.name_of(var))
            name = f"{tname}/AccumulateGrad"
            if name in self._node_recs:  # a new Parameter in a path's place (module_roots.parameter_path)
                k = 1
                while f"{name}#{k}" in self._node_recs:
                    k += 1
                name = f"{name}#{k}"
            self._acc_by_var[var] = name
            self._acc_vars[name] = weakref.ref(var)
            self._slot_tensor[(name, 0)] = tname
            self._register_node(node, name, ACCUMULATE, None, tname, None, external=False)
        else:
            self._hook_node(node, name, ACCUMULATE, external=False)
        md[_NODE_TAG] = (self.rec.trace_id, name)
        return name

    def _register_node(self, node: Any, name: str, kind: str, call: str | None, param: str | None,
                       stack_id: int | None, external: bool, key: tuple[int, str] | None = None) -> None:
        if kind != ACCUMULATE:  # accumulators are known by their leaf (see _accumulator)
            self._node_by_seq[key if key is not None else self._node_key(node)] = name
        # Positional, in GradNode's field order (a record per node).
        rec = GradNode(name, kind, call, param, [], stack_id, self._node_seq, external)
        self._node_seq += 1
        self._trace.grad_nodes.append(rec)
        self._node_recs[name] = rec
        self._hook_node(node, name, kind, external)
        listeners = self.rec.listeners
        if listeners and self._listens("on_grad_node"):
            for li in listeners:
                li.on_grad_node(self._trace, name, node)

    def _hook_node(self, node: Any, name: str, kind: str, external: bool) -> None:
        # Hook handles are not kept for the nodes a call made: the hooks go with their node (the
        # backward frees it), and one that outlives the trace (a graph kept alive past the block)
        # finds the recorder closed and returns at once. Keeping and removing them cost a Python
        # call per hook. Accumulators and nodes made before the block are another matter: they
        # outlive the trace and serve the next one (a training loop that keeps the last loss
        # until the next forward keeps every parameter's accumulator alive for good), so each
        # trace removes its hooks from them when it ends; else every traced step added a pair
        # that every later backward called.
        user_code = runs_user_code(node, kind)
        if user_code:
            module = self.rec.scopes.innermost()
            if module is not None:
                self._node_modules[name] = module
        if kind == ACCUMULATE and not user_code and self._acc_hook_alone():
            # Nothing needs the accumulator's start: its hook alone names what the leaf's .grad
            # became, from what .grad was when the backward started (_note_grads_before).
            self._handles.append(node.register_hook(functools.partial(node_hook, self._rec_ref, name)))
            self._acc_post_only.add(name)
            return
        # Other accumulators get both: the pre-hook notes the leaf's .grad before it runs, the
        # hook names what it became (the gradient itself, or a new version accumulated into it).
        if user_code or external or kind == ACCUMULATE or self._saved_hooks \
                or (self.rec.listeners and self._begin_listeners()):
            # Something needs the node's start: its own Python code (custom backward, post-
            # accumulate hooks) or a saved-tensor unpack hook records calls whose parent is the
            # running node, and listeners such as the memory one attribute work to it. One
            # callable serves as pre-hook and hook (told apart by their arguments).
            hook = functools.partial(node_hook, self._rec_ref, name)
            pre, post = node.register_prehook(hook), node.register_hook(hook)
            if external or kind == ACCUMULATE:
                self._handles += (pre, post)  # removed by remove_hooks (Recorder.uninstall)
            if user_code and self.rec.hasher.active:
                self._flush_before.add(name)
        elif self._every_node_run or (self.rec.listeners and self._listeners_need_runs()):
            # A built-in node runs no Python: its hook alone sees what it received and made
            # (one hook per node instead of two: half the registrations and engine callbacks).
            node.register_hook(functools.partial(node_done_hook, self._rec_ref, name))
        else:
            # Nothing needs its run yet (no checksums or stats): the graph, names, links and
            # stacks are recorded already. A backward that needs it hooks it then.
            self._unhooked.add(name)

    def _acc_hook_alone(self) -> bool:
        """Whether an accumulator can do with its hook alone (no pre-hook): nothing reads values
        (a checksum waiting for .grad's bytes must be read before the accumulator adds into
        them) and no listener acts on a node's start (the memory one attributes the
        accumulator's allocation to it while it runs)."""
        return self.rec.hasher is self.rec.own_hasher and not self.rec.hasher.active \
            and not (self.rec.listeners and self._begin_listeners())

    def _listeners_need_runs(self) -> bool:
        return any(needs_node_runs(li) for li in self.rec.listeners)

    def _node_runs_wanted(self, create_graph: bool) -> bool:
        """Whether the backward run starting now needs every node's run: a listener attached since
        (a log scope around the backward), a ``create_graph`` run (the nodes it makes belong
        to the node whose backward made them: see _adopt_nodes), or backward hooks (a hook's
        calls read the gradient the node before it made: that node's hook names it)."""
        return create_graph or bool(self.rec.listeners and self._listeners_need_runs()) or self._backward_hooks()

    def tensor_hook_registered(self) -> None:
        """A tensor hook was registered during the block (``Tensor.register_hook``)."""
        self._tensor_hooks = True

    def grad_retained(self, t: torch.Tensor) -> None:
        """``t.retain_grad()`` was called in the block: the ``.grad`` a backward gives the
        non-leaf ``t`` (a copy the engine makes of the gradient that reached it, after its
        hooks) is named ``<t>.grad`` when the backward ends (a leaf's ``.grad`` is named by its
        accumulator)."""
        with self.rec.lock, torch._C.DisableTorchFunction():
            if t.grad_fn is None:
                return
            key = identity(t)
            if key not in self._retained:
                self._retained[key] = (weakref.ref(t), f"{self.rec.names.name_of(t)}.grad")

    def _name_retained_grads(self, run: BackwardRun) -> None:
        """After a backward: name each retained ``.grad`` it set or replaced: ``<t>.grad``, then
        ``<t>.grad@v<k>`` for each later value (another run added into it or set it anew, as an
        in-place change does), ``previous`` the latest value of that name."""
        with self.rec.lock, torch._C.DisableTorchFunction():
            for key, (ref, base) in list(self._retained.items()):
                t = ref()
                if t is None:
                    del self._retained[key]
                    continue
                g = t.grad
                if g is None:
                    continue
                hit = self.rec.names.lookup(g)
                if hit is not None and hit[1] == version_of(g):
                    continue  # named already: this run left it as it was
                if base not in self._trace.tensors:
                    self.rec.names.new_tensor(g, base, "grad", run.name)
                    continue
                n = self.rec.names.last_version(base)
                latest = names.version_name(base, n) if n else base
                self.rec.names.new_tensor(g, self.rec.names.bump(base), "grad", run.name, previous=latest)

    def _backward_hooks(self) -> bool:
        """Whether user hooks may run in this backward: a tensor hook registered in the block, one
        on a parameter (from before it: on a leaf whose accumulator the trace knows), or a module
        backward hook."""
        if self._tensor_hooks:
            return True
        for ref in self._acc_vars.values():
            var = ref()
            if var is not None and has_backward_hooks(var):
                return True
        return self.rec.scopes.backward_hooks()

    def _reaches_unhooked(self, roots: list[torch.Tensor]) -> bool:
        """Whether a backward from ``roots`` reaches a recorded node that has no hook."""
        if not self._unhooked:
            return False
        todo = self._root_names(roots)
        seen = set(todo)
        while todo:
            name = todo.pop()
            if name in self._unhooked:
                return True
            for dest, _slot in self._edges.get(name, ()):
                if dest is not None and dest not in seen:
                    seen.add(dest)
                    todo.append(dest)
        return False

    def _hook_waiting_nodes(self, roots: list[torch.Tensor]) -> None:
        """Hook the recorded nodes still without one that a backward from ``roots`` can reach."""
        node_by_seq, unhooked, ref = self._node_by_seq, self._unhooked, self._rec_ref
        todo = [gf for gf in map(grad_fn_of, roots) if gf is not None]
        seen: set[tuple[int, str]] = set()
        while todo:
            node = todo.pop()
            kind = NODE_KINDS.get(type(node)) or node_kind(node)
            if kind == ACCUMULATE:
                continue  # (hooked when named)
            key = (node._sequence_nr(), kind)
            if key in seen:
                continue
            seen.add(key)
            name = node_by_seq.get(key)
            if name is None:
                continue  # made before the block, or by code the trace did not see
            if name in unhooked:
                unhooked.discard(name)
                node.register_hook(functools.partial(node_done_hook, ref, name))
            todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def _link_edges(self, node: Any, name: str | None = None, nexts: Any = None) -> None:
        if name is None:
            name = self._node_name(node)
            assert name is not None
        if nexts is None:
            nexts = node.next_functions
        rec_next: list[str | None] = []
        edges: list[tuple[str | None, int]] = []
        node_by_seq = self._node_by_seq
        for nxt, k in nexts:
            if nxt is None:
                dest = None
            else:
                # _node_name inlined (once per edge); _dest_name names what is not known yet.
                kind = NODE_KINDS.get(type(nxt)) or node_kind(nxt)
                if kind == ACCUMULATE:
                    dest = self._accumulator(nxt)
                else:
                    dest = node_by_seq.get((nxt._sequence_nr(), kind))
                    if dest is None:
                        dest = self._dest_name(nxt)
            rec_next.append(dest)
            edges.append((dest, k))
        # A tuple of (str, int) tuples: the garbage collector stops tracking it after one look.
        self._edges[name] = tuple(edges)
        self._node_recs[name].next = rec_next

    def _dest_name(self, node: Any) -> str:
        known = self._node_name(node)
        if known is not None:
            return known
        kind = NODE_KINDS.get(type(node)) or node_kind(node)
        if kind == ACCUMULATE:
            return self._accumulator(node)
        # Created before the traced block (or by code the trace could not see).
        name = self.rec.counters.next(f"external/{kind}")
        self._register_node(node, name, kind, None, None, None, external=True)
        # Their edges are linked one node after another, not by recursion: a graph made before
        # the block (a hidden state carried over, a GAN's generator output from the step before)
        # may be thousands of nodes deep.
        pending = self._external_pending
        pending.append((node, name))
        if len(pending) == 1:
            try:
                i = 0
                while i < len(pending):
                    self._link_edges(*pending[i])
                    i += 1
            finally:
                pending.clear()
        return name

    # ---- backward -----------------------------------------------------------------------------
    def _begin_run(self, api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BackwardRun:
        """A backward run begins: its record, the state the engine's hooks read, and the
        checksums waiting read first."""
        with self.rec.lock, torch._C.DisableTorchFunction():
            first = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
            roots = [self.rec.names.name_of(t) for t in unique(flat_tensors(first))]
            stack_id = self.rec.stack_table.capture()
            # Started by a running node's own code (autograd.grad in a custom backward): its parent.
            parent = self._running[-1] if self._running else (self.engine_node() if self._in_backward else None)
            run = BackwardRun(name=self.rec.counters.next("grad" if api.endswith(".grad") else "backward"),
                              api=api, roots=roots, stack_id=stack_id, seq=len(self._trace.backward_runs),
                              parent=parent, at=self.rec.call_seq)
            self._run_index = run.seq  # gradients of the k-th run are named ...#k
            self._run = run
            self._trace.backward_runs.append(run)
            # Counted when a gradient's name first needs it (_sole_grad): a run that hooks only
            # accumulators and custom Functions (node_runs) may never need it.
            self._indegree, self._indegree_roots = None, self._root_names(unique(flat_tensors(first)))
            self._passed_on.clear()
            self._create_graph = creates_graph(api, args, kwargs)
            if self._create_graph and get_seq is not None:
                self._bwd_seq0 = (threading.get_ident(), get_seq())
            if self._unhooked and self._node_runs_wanted(self._create_graph):
                self._hook_waiting_nodes(unique(flat_tensors(first)))
            if self._acc_post_only and not api.endswith(".grad"):  # (autograd.grad runs no accumulator)
                self._hook_accumulator_starts(self._leaves.note_grads_before(self._acc_post_only, self._create_graph))
        for li in self.rec.listeners:
            li.on_backward_begin(self._trace, run)
        # Waiting checksums are read before the backward: gradient accumulation and custom
        # backward code may write into tensors already recorded.
        self.rec.hasher.before_write()
        return run

    def record_backward(self, func: Any, api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One backward run, from ``Tensor.backward``, ``autograd.backward`` or ``autograd.grad``.
        A run started inside another one (``autograd.grad`` in a custom Function's backward) is
        recorded as a run of its own; the outer run's state is put back when it ends."""
        outer = (self._run, self._run_index, self._indegree, self._indegree_roots, self._create_graph, self._bwd_seq0)
        try:
            run = self._begin_run(api, args, kwargs)
        except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
            (self._run, self._run_index, self._indegree, self._indegree_roots, self._create_graph,
             self._bwd_seq0) = outer
            self.rec.recorder_failed(exc)
            return func(*args, **kwargs)
        self._open_runs.append(run.seq)
        try:
            out = self._run_backward(run, outer, func, api, args, kwargs)
        finally:
            self._open_runs.remove(run.seq)  # (after its outputs are named: now it may be written)
        if self.rec.on_records is not None:
            self.rec.on_records()
        return out

    def _run_backward(self, run: BackwardRun, outer: tuple[Any, ...], func: Any, api: str,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``record_backward`` once ``run`` has begun: the engine call, what a failure says,
        the state put back, the outputs of ``autograd.grad`` named."""
        first = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        depth = len(self._running)  # the nodes running when this run started (an enclosing run's)
        self._in_backward += 1
        error: BaseException | None = None
        try:
            # The engine starts under a mode of this recorder (tracer.record.engine): the Python
            # code the backward runs (hooks, recomputation, custom backward) is recorded.
            expect_backward(self.rec)
            try:
                out = func(*args, **kwargs)
            finally:
                expect_backward(None)
        except BaseException as exc:
            run.status = "failed"
            run.error = f"{type(exc).__name__}: {exc}"
            error = exc
            # The outermost run explains the error once, with every level still running (a
            # nested run leaves its running nodes in place for it, and the node of its own that
            # failed: an autograd.grad in a custom backward over a graph whose saved tensor
            # changed in place).
            if isinstance(exc, Exception):
                unknown = False
                failing = None
                last = run.steps[-1].node if run.steps else ""
                if len(self._running) <= depth and last.endswith("/BackwardHookFunctionBackward") \
                        and raised_in_backward_python(exc) is not None:
                    # A module's backward hook raised: torch runs it as a hook of that node,
                    # after the node's own (gradtrace's) hook recorded its run.
                    failing = last
                elif len(self._running) <= depth and (nan_node := _returned_nan(exc, run)) is not None:
                    # detect_anomaly checks a node's results after its hooks ran, so the node
                    # counts as finished: torch's message names its class, the run its last one.
                    failing = nan_node
                elif len(self._running) <= depth:
                    # No node of this run is running (a node with no pre-hook failed: it does not
                    # show in _running): find it from the graph, from the runs that finished,
                    # unless some it could reach had no hook: then only a node that runs Python
                    # (hooked) can be named. A node still running (its hooks or its own code
                    # raised: a module's backward hook) is the one.
                    try:
                        with torch._C.DisableTorchFunction():
                            from_tensors = unique(flat_tensors(first))
                            partial = self._reaches_unhooked(from_tensors)
                            unknown = partial
                            failing = None if partial else self._infer_failing_node(from_tensors)
                    except Exception:  # never let the explanation hide the user's error
                        failing = None
                if failing is not None and failing not in self._running:
                    self._running.append(failing)
                if outer[0] is None and not isinstance(exc, RaisedOnPurpose):  # (its message says it all)
                    self._explain(exc, run, list(self._running), unknown and len(self._running) <= depth)
            raise
        finally:
            if self._retained:
                self._name_retained_grads(run)
            for li in self.rec.listeners:
                li.on_backward_end(self._trace, run, error)
            self._in_backward -= 1
            self._run, self._run_index, self._indegree, self._indegree_roots, self._create_graph, self._bwd_seq0 = outer
            if self._run is None:
                self._running.clear()
                self._open_steps.clear()
                self.rec.phases.open_window()
        if api.endswith(".grad"):
            with self.rec.lock, torch._C.DisableTorchFunction():
                # One result per input, None for an input the roots do not reach (allow_unused):
                # each gradient is named by its input's position, so ``<run>:out2`` is the third's.
                results = out if isinstance(out, (tuple, list)) else (out,)
                run.outputs = [self.rec.names.new_tensor(t, names.output_name(run.name, i, len(results)), "grad", run.name)
                               for i, t in enumerate(results) if isinstance(t, torch.Tensor)]
                if transforms_active():  # (torch.func.grad: what it returns is what these wrap)
                    self.rec.names.note_unwrapped([t for t in results if isinstance(t, torch.Tensor)], run.outputs)
        return out

    def _indegree_all(self) -> dict[tuple[str, int], int]:
        indegree: dict[tuple[str, int], int] = {}
        for edges in self._edges.values():
            for dest, k in edges:
                if dest is not None:
                    indegree[(dest, k)] = indegree.get((dest, k), 0) + 1
        return indegree

    def _root_names(self, roots: list[torch.Tensor]) -> list[str]:
        """The recorded nodes a backward from the tensors ``roots`` starts at."""
        return [n for n in (self._node_name(gf) for gf in map(grad_fn_of, roots) if gf is not None) if n is not None]

    def _run_indegree(self) -> dict[tuple[str, int], int]:
        """The running backward's edge counts (``_indegree_from`` its roots, or of the whole
        graph for a run the trace did not see start), counted at the first need."""
        if self._indegree is None:
            roots = self._indegree_roots
            self._indegree = self._indegree_all() if roots is None else self._indegree_from(roots)
        return self._indegree

    def _indegree_from(self, roots: list[str]) -> dict[tuple[str, int], int]:
        """Edges into each (node, slot) of the recorded graph reachable from the nodes ``roots``.
        Counted per backward run: with gradient accumulation each micro-batch's graph has its own
        edges into the same accumulators, and each run's gradient of a parameter is that
        parameter's. (The edges of nodes recorded meanwhile, a create_graph run's, start at
        nodes no root reaches: counting later gives the same.)"""
        todo = list(roots)
        seen = set(todo)
        indegree: dict[tuple[str, int], int] = {}
        edges = self._edges
        while todo:
            for dest, k in edges.get(todo.pop(), ()):
                if dest is None:
                    continue
                indegree[(dest, k)] = indegree.get((dest, k), 0) + 1
                if dest not in seen:
                    seen.add(dest)
                    todo.append(dest)
        return indegree

    def _explain(self, exc: Exception, run: BackwardRun, running: list[str], unknown: bool = False) -> None:
        try:
            with self.rec.lock, torch._C.DisableTorchFunction():
                note = explain_backward_error(self._trace, run, running, exc, self.rec.stack_table.frames_of,
                                              unknown_node=unknown, raised_at=raised_in_backward_python(exc))
        except Exception as inner:  # never let the explanation hide the user's error
            note = f"gradtrace: could not explain this error ({type(inner).__name__}: {inner})"
        add_note(exc, note)
        run.error = f"{run.error}\n{note}"

    def _sole_grad(self, dest: str | None, k: int) -> str | None:
        """The gradient into ``dest``'s slot ``k`` is that tensor's gradient (``<tensor>@grad``)
        when it alone flows there; None when several edges meet (each is then its edge's partial
        gradient, ``<node>:grad<i>``), the slot is no named tensor's, or it is a leaf's whose
        own hooks (``p.register_hook``) come between: what they return is the leaf's gradient,
        the one its ``.grad`` gets (named when the accumulator receives it)."""
        if dest is None:
            return None
        indegree = self._indegree if self._indegree is not None else self._run_indegree()
        if indegree.get((dest, k), 0) != 1:
            return None
        if dest in self._acc_vars:
            var = self._acc_vars[dest]()
            if var is not None and has_backward_hooks(var):
                return None
        return self.slot_grad(dest, k)

    def _in_run(self, name: str) -> str:
        """A gradient's own name, with ``#k`` in the k-th backward run (k >= 1)."""
        return name if self._run_index <= 0 else f"{name}#{self._run_index}"

    def _begin_listeners(self) -> bool:
        """Whether an attached listener acts on a node's start (``on_node_begin``)."""
        return self._listens("on_node_begin")

    def _listens(self, event: str) -> bool:
        """Whether an attached listener overrides ``event``."""
        base = getattr(Listener, event)
        return any(getattr(type(li), event) is not base for li in self.rec.listeners)

    def _current_run(self, ran: str | None = None) -> BackwardRun:
        """The backward run a node event belongs to. At its first node event, the reading of
        what still waits for a checksum is queued for the run's end (``_read_waiting_at_end``).
        ``ran``: the accumulator hooked alone whose hook asks, which has run already."""
        if self._run is None:  # backward started where the trace could not see it
            self._indegree, self._indegree_roots = None, None  # every recorded edge, when needed
            self._passed_on.clear()
            if self._acc_post_only:
                # No accumulator has run yet but ``ran`` (it would have started the run): what
                # their .grad is now is what it was at the start. ``ran``'s own has changed.
                self._hook_accumulator_starts(self._leaves.note_grads_before(self._acc_post_only, self._create_graph, skip=ran))
                if ran is not None:
                    self._leaves.infer_grad_before(ran)
            self._run_index = len(self._trace.backward_runs)
            self._run = BackwardRun(name=self.rec.counters.next("backward"), api="(engine)", roots=[],
                                    seq=len(self._trace.backward_runs), at=self.rec.call_seq)
            self._trace.backward_runs.append(self._run)
            self._open_runs.append(self._run.seq)  # no end is seen: filled till the block's end
        if self._reads_queued is not self._run:
            self._read_waiting_at_end(self._run)
        return self._run

    def _read_waiting_at_end(self, run: BackwardRun) -> None:
        """At the first node of a backward run: queue, ahead of any other final callback of the
        run, the reading of every value still waiting for its checksum. Other final callbacks
        write into gradients the trace has recorded, with no op it sees (DDP copies the averaged
        buckets back into each .grad): they must find those values read."""
        self._reads_queued = run
        if self.rec.hasher.active and _queue_callback is not None:
            try:
                _queue_callback(functools.partial(_read_waiting, self._rec_ref))
            except RuntimeError:  # not inside the engine's run (a hook called by hand)
                pass

    def _grad_names(self, node: str, grads: tuple[Any, ...], produced: bool,
                    own_calls: list[str] | None = None, received: tuple[Any, ...] = (),
                    received_names: list[str | None] | None = None) -> list[str | None]:
        """Names of the gradients a node received (``grad_outputs``) or, with ``produced``, made
        (``grad_inputs``), recording the new ones. A gradient already named (passed through
        unchanged) keeps its name; a new name is only formatted for a new tensor. ``received``
        (with their names): what the node received, when known; a gradient made as a view that
        reads exactly as one of them (``ViewBackward``'s reshape) copies its checksum and stats."""
        edges = self._edges.get(node, ()) if produced else ()
        names: list[str | None] = []
        lookup = self.rec.names.lookup
        passed = self._passed_on
        for i, g in enumerate(grads):
            if not isinstance(g, torch.Tensor):
                names.append(None)
                continue
            if not produced and passed:  # the very tensor a node passed on along this edge
                on_edge = passed.pop((node, i), None)
                # The same tensor at the same version: a slot fed by several edges may have been
                # summed into it in place by the engine (then it is that slot's sum, named below).
                # (by a weak reference, not id(): the engine's sum of a slot's edges is a new tensor,
                # which can take the address of a passed-on one that died meanwhile)
                if on_edge is not None and on_edge[1]() is g and on_edge[2] == version_of(g):
                    names.append(on_edge[0])
                    continue
            hit = lookup(g)
            if hit is not None and hit[1] == version_of(g) and not (own_calls and self._made_by(hit[0], own_calls)):
                if produced and i < len(edges) and edges[i][0] is not None:
                    names.append(self._pass_on(node, i, g, hit[0], edges[i]))
                else:
                    names.append(hit[0])
            elif produced:
                # A gradient the node's own code made (a custom backward: named by the op that
                # made it) is also recorded under its gradient name, so <param>@grad exists.
                dest, k = edges[i] if i < len(edges) else (None, 0)
                gname = self._sole_grad(dest, k)
                if hit is not None and gname is None:
                    names.append(hit[0])
                    continue
                same = self._received_as(node, g, received, received_names) \
                    if received_names and self.rec.names.reads_values else None
                names.append(self.rec.names.new_tensor(g, gname or self._in_run(f"{node}:grad{i}"), "grad", node,
                                              same_as=same))
            else:
                gname = self.slot_grad(node, i) or self._in_run(f"{node}:gin{i}")
                names.append(self.rec.names.new_tensor(g, gname, "grad", None))
        return names

    def _received_as(self, node: str, g: torch.Tensor, received: tuple[Any, ...],
                     received_names: list[str | None]) -> TensorRecord | None:
        """The record of a gradient ``node`` received that the view ``g`` it made reads as (see
        ``_reads_as``; ``ViewBackward0`` reshapes, ``TBackward0`` reorders), if any."""
        base = g._base
        if base is None:
            return None
        rec = self._node_recs.get(node)
        order = VIEW_NODES.get(rec.kind.rstrip("0123456789")) if rec is not None else None
        return self.rec.names.view_source(g, base, order, zip(received, received_names))

    def _pass_on(self, node: str, i: int, g: torch.Tensor, name: str, edge: tuple[str | None, int]) -> str:
        """A gradient ``node`` received and passes on unchanged (``AddBackward0`` hands its
        incoming gradient to both inputs): on each edge it is that edge's gradient, named by it
        (``<tensor>@grad`` when it alone flows into the slot, else ``<node>:grad<i>``), with
        the checksum and stats of the value it is, computed once."""
        dest, k = edge
        assert dest is not None
        edge_name = self._sole_grad(dest, k) or self._in_run(f"{node}:grad{i}")
        if edge_name == name:
            return name
        original = self._trace.tensors.get(name)
        if original is None:
            return name
        edge_name = self.rec.names.untaken(edge_name)
        self.rec.names.add_copy(original, edge_name, node)
        self._passed_on[(dest, k)] = (edge_name, weakref.ref(g), version_of(g))
        return edge_name

    def _made_by(self, tensor: str, calls: list[str]) -> bool:
        rec = self._trace.tensors.get(tensor)
        return rec is not None and rec.producer in calls

    # The node events run inside the nodes' hooks, with torch functions off already (node_hook,
    # node_done_hook): entering DisableTorchFunction again cost every node's run.
    def node_begin(self, node: str, grad_outputs: tuple[Any, ...]) -> None:
        """A node's pre-hook (the caller has torch functions off)."""
        if self.rec.stopped:
            return
        if node in self._flush_before:  # user code next, which may write into recorded tensors
            self.rec.hasher.before_write()
        with self.rec.lock:
            self._open_steps[node] = self._start_step(node, grad_outputs, ran=False)
        if node in self._acc_vars:  # the accumulator runs next: what it takes and writes
            self.let_go_of(grad_outputs)

    def _start_step(self, node: str, grad_outputs: tuple[Any, ...], ran: bool) -> NodeRun:
        """A node's run starts (its pre-hook), or an accumulator hooked alone has run (``ran``:
        its pre-hook's part, done after it): the step, what it received, the node running, and
        for an accumulator its leaf's .grad before (noted now, or at the backward's start)."""
        run = self._current_run(ran=node if ran else None)
        step = NodeRun(node, self._grad_names(node, grad_outputs, False), [])
        run.steps.append(step)
        self._running.append(node)
        if node in self._acc_vars:
            self._leaves.name_incoming(node, step, grad_outputs)
            if ran:
                self._leaves.name_grad_from_before(node)
            else:
                self._leaves.note_grad_before(node)
        for li in self.rec.listeners:
            li.on_node_begin(self._trace, node, step, grad_outputs)
        return step

    def node_end(self, node: str, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...] = ()) -> None:
        """A node's hook after its pre-hook (the caller has torch functions off)."""
        if self.rec.stopped:
            return
        with self.rec.lock:
            step = self._open_steps.pop(node, None)
            if step is None and node in self._acc_post_only:
                step = self._start_step(node, grad_outputs, ran=True)
            names = self._grad_names(node, grad_inputs, True, step.calls if step is not None else None)
            if self._create_graph:
                self._adopt_nodes(node, grad_inputs)
            if node in self._acc_vars:
                self._leaves.name_accumulated(node, step)
            if step is not None:
                step.grads_out = names
                # Listeners run while the node still counts as running: one that raises (the
                # raise_on_nonfinite guard) leaves it on the stack the error explanation reads.
                for li in self.rec.listeners:
                    li.on_node_end(self._trace, node, step, grad_inputs)
            if self._running and self._running[-1] == node:
                self._running.pop()
            elif node in self._running:
                self._running.remove(node)
        self.let_go_after(node, grad_inputs)

    def let_go_after(self, node: str, grads: tuple[Any, ...]) -> None:
        """``node``'s hook is done and ``grads`` (what it made) go on along its edges: the hasher
        holds none of those the engine reads reference counts of next (``Hasher.let_go``),
        which a held tensor would change: one for a leaf's accumulator (it keeps the gradient
        itself as ``.grad`` only when nobody else holds the tensor: the batch keeps an alias of
        its storage instead, no copy), and one for a slot several edges feed (their gradients
        are summed in place only into one nobody else holds, tensor and storage: the batch keeps
        a copy). The others stay in the batches, which keep filling: a launch per node would
        cost the launches batching saves."""
        if not self.rec.hasher.holds_tensors:
            return
        summed: list[torch.Tensor] = []  # into a slot: its storage must not be held either
        into_grad: list[torch.Tensor] = []  # to an accumulator: only the tensor must not be held
        indegree = None
        acc_vars = self._acc_vars
        for (dest, k), g in zip(self._edges.get(node, ()), grads):
            if dest is None or g is None:
                continue
            if indegree is None:
                indegree = self._run_indegree()
            if indegree.get((dest, k), 0) >= 2:  # (an accumulator's slot too: summed before it runs)
                summed.append(g)
            elif dest in acc_vars:
                into_grad.append(g)
        if summed:
            self.rec.hasher.let_go(summed)
        if into_grad:
            self.rec.hasher.let_go(into_grad, into_grad=True)

    def let_go_of(self, grads: tuple[Any, ...]) -> None:
        """An accumulator's pre-hook is done: the gradient it received (recorded there when no
        hook of its producer recorded it) is not held while it runs. (Its leaf's ``.grad``,
        which it may add into in place, was read first when it was recorded: note_grad_before.)"""
        if self.rec.hasher.holds_tensors:
            taken = [g for g in grads if isinstance(g, torch.Tensor)]
            if taken:
                self.rec.hasher.let_go(taken, into_grad=True)

    def _hook_accumulator_starts(self, accs: list[str]) -> None:
        """Give accumulators hooked alone their pre-hook after all: their leaf got a
        post-accumulate-grad hook after the forward (user code, whose calls read .grad while
        the accumulator counts as running: see name_leaf_grad)."""
        for acc in accs:
            ref = self._acc_vars.get(acc)
            var = ref() if ref is not None else None
            if var is None or get_gradient_edge is None:
                continue
            node = get_gradient_edge(var).node
            tag = node.metadata.get(_NODE_TAG)
            if tag is not None and tuple(tag) == (self.rec.trace_id, acc):
                self._handles.append(node.register_prehook(functools.partial(node_hook, self._rec_ref, acc)))
                self._acc_post_only.discard(acc)

    def leaf_grad_written_unseen(self, leaf: torch.Tensor) -> None:
        """``leaf``'s accumulator has just added into its .grad, and code the trace cannot see
        writes that .grad in place next (see ``LeafGrads.read_before_unseen_write``): the value
        is named and read now, before those writes (a waiting copy of it is snapshotted)."""
        acc = self._acc_by_var.get(leaf)
        if acc is None or self.rec.stopped:
            return
        with self.rec.lock:
            g = self._leaves.read_before_unseen_write(acc, self._open_steps.get(acc))
        if g is not None:
            self.rec.hasher.before_write([g])

    def forget_tensor(self, t: torch.Tensor) -> None:
        """Drop every weak reference of the graph to ``t`` (``swap_tensors`` refuses a tensor
        that has one; an accumulator's leaf among them: a new accumulator follows, swap_tensors
        poisons the one it had)."""
        self._acc_by_var.pop(t)
        for name in [n for n, r in self._acc_vars.items() if r() is t]:
            del self._acc_vars[name]
        for key in [k for k, (r, _) in self._retained.items() if r() is t]:
            del self._retained[key]
        for slot in [k for k, v in self._passed_on.items() if v[1]() is t]:
            del self._passed_on[slot]
        self._leaves.forget(t)

    def note_unnamed_hook_input(self, input_name: str) -> None:
        """A tensor without a name met in a hook of a grad node whose run is not recorded
        (``node_runs`` off): possibly a gradient that node received or produced, handed to a
        hook registered on the node itself (``grad_fn.register_hook``), which gradtrace cannot
        see. It stays ``input<k>`` (it may as well come from before the block); a note per
        node says so and how to have the node's gradients named."""
        if not self._unhooked:
            return
        node = self.engine_node()
        if node is None or node not in self._unhooked or node in self._hook_inputs_noted:
            return
        self._hook_inputs_noted.add(node)
        self._trace.notes.append(
            f"a hook of grad node {node} read {input_name}, a tensor without a name: if it is one of the "
            f"node's gradients (a hook registered on the node itself, grad_fn.register_hook, which gradtrace "
            f"cannot see), its name is not known because the node's run was not recorded; "
            f"trace(node_runs=True) names every node's gradients")

    def engine_node(self) -> str | None:
        """The recorded name of the grad node the autograd engine runs on this thread now (the
        node whose hooks run), if it is one the trace knows."""
        node = current_autograd_node() if current_autograd_node is not None else None
        return None if node is None else self._node_name(node)

    def node_done(self, node: str, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        """A node with no pre-hook ran: what it received and what it produced, in one event (the
        caller has torch functions off)."""
        if self.rec.stopped:
            return
        with self.rec.lock:
            run = self._current_run()
            step = NodeRun(node, self._grad_names(node, grad_outputs, False), [])
            run.steps.append(step)
            step.grads_out = self._grad_names(node, grad_inputs, True, None, grad_outputs, step.grads_in)
            if self._create_graph:
                self._adopt_nodes(node, grad_inputs)
            if self.rec.listeners:  # attached after this node was made: both events, back to back
                self._running.append(node)
                for li in self.rec.listeners:
                    li.on_node_begin(self._trace, node, step, grad_outputs)
                for li in self.rec.listeners:
                    li.on_node_end(self._trace, node, step, grad_inputs)
                self._running.pop()
        self.let_go_after(node, grad_inputs)

    def _adopt_nodes(self, parent: str, grads: tuple[Any, ...]) -> None:
        """Grad nodes that ``parent``'s backward has just made (``create_graph=True``: a gradient
        penalty's double backward) belong to it: named ``<parent>/<class>``, with the stack of
        the line that started the backward run. Without this they would be found later as
        nodes from outside the block."""
        run = self._run
        stack_id = run.stack_id if run is not None else None
        seq0 = None
        if self._bwd_seq0 is not None and self._bwd_seq0[0] == threading.get_ident():
            seq0 = self._bwd_seq0[1]  # (on an engine thread of its own: no lower bound)
        seq1 = get_seq() if get_seq is not None and seq0 is not None else None
        names: list[str] = []
        local_kinds = self._adopted_kinds.setdefault(parent, {})
        for g in grads:
            gf = grad_fn_of(g) if isinstance(g, torch.Tensor) else None
            if gf is None or (NODE_KINDS.get(type(gf)) or node_kind(gf)) == ACCUMULATE or self._node_name(gf) is not None:
                continue
            self._collect_nodes(gf, seq0, seq1, parent, stack_id, names, local_kinds)
        for n in names:
            rec = self._node_recs[n]
            rec.call, rec.parent = None, parent

    def _infer_failing_node(self, roots: list[torch.Tensor]) -> str | None:
        """The grad node a failed backward was running when that node had no pre-hook.

        The engine runs a node once every node feeding it has finished, and among the ready
        nodes the one with the highest sequence number first (accumulators, at the maximum,
        before the rest). So the failing node is the ready, unfinished node that sorts first;
        with several devices working in parallel this is a best guess. The graph is the one
        recorded at forward time: the live one may have dropped the edges of nodes that ran."""
        run = self._run
        if run is None:
            return None
        done = {st.node for st in run.steps} - set(self._running)
        seq_of = {name: sn for (sn, _kind), name in self._node_by_seq.items()}
        todo = self._root_names(roots)
        preds: dict[str, set[str]] = {n: set() for n in todo}
        while todo:
            name = todo.pop()
            for dest, _slot in self._edges.get(name, ()):
                if dest is None:
                    continue
                if dest not in preds:
                    preds[dest] = set()
                    todo.append(dest)
                preds[dest].add(name)
        ready = [n for n, ps in preds.items() if n not in done and ps <= done]
        return max(ready, key=lambda n: seq_of.get(n, _UINT64_MAX)) if ready else None


# detect_anomaly's check of a node's results (torch/csrc/autograd/engine.cpp).
_RETURNED_NAN = re.compile(r"Function '([A-Za-z_][A-Za-z0-9_]*)' returned nan values in its \d+(?:st|nd|rd|th) output")


def _returned_nan(exc: BaseException, run: BackwardRun) -> str | None:
    """The grad node that ``detect_anomaly`` found returning NaN (``exc``), by the class torch's
    message names: the last step of ``run`` of that class. None for any other error."""
    found = _RETURNED_NAN.match(str(exc))
    if found is None:
        return None
    kind = "/" + found.group(1)
    for step in reversed(run.steps):
        if step.node.endswith(kind):
            return step.node
    return None


# The engine's final callbacks (run when a backward's nodes are done, in the order queued): the
# public entry DDP and FSDP use, on the private engine object; without it nothing is queued.
_queue_callback = getattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback", None)


# gradtrace's own hooks run with torch functions off: the backward's mode (tracer.record.engine)
# is on around them, and what they do is not the user's code (nor worth a handler call per attribute).
def _read_waiting(ref: weakref.ref[Any]) -> None:
    rec = ref()
    if rec is not None and not rec.closed:
        with torch._C.DisableTorchFunction():
            rec.hasher.before_write()


_PRE_HOOK: Any = object()  # a unique marker: only a pre-hook call leaves the argument at it


def node_hook(ref: weakref.ref[Any], name: str, grads: tuple[Any, ...], grad_outputs: Any = _PRE_HOOK) -> None:
    """A node's pre-hook ``(grad_outputs)`` and hook ``(grad_inputs, grad_outputs)`` in one.
    (Another thread's backward through a recorded node, an accumulator of parameters it trains
    too, is not the trace's.)"""
    rec = ref()
    if rec is not None and not rec.closed and on_traced_thread(rec):
        with torch._C.DisableTorchFunction():
            try:
                if grad_outputs is _PRE_HOOK:
                    rec.graph.node_begin(name, grads)
                else:
                    rec.graph.node_end(name, grads, grad_outputs)
            except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
                rec.recorder_failed(exc)


def node_done_hook(ref: weakref.ref[Any], name: str, grad_inputs: tuple[Any, ...],
                    grad_outputs: tuple[Any, ...]) -> None:
    """The only hook of a node that needs no pre-hook (see ``Graph._register_node``)."""
    rec = ref()
    if rec is not None and not rec.closed and on_traced_thread(rec):
        with torch._C.DisableTorchFunction():
            try:
                rec.graph.node_done(name, grad_inputs, grad_outputs)
            except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
                rec.recorder_failed(exc)
