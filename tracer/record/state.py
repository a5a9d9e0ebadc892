"""What a recorder holds (``RecorderState``): every table of one active trace, and naming the
tensor values it meets, versions, aliases and all. The rooms of the recorder (autograd, modules,
optimizer, functions) build on it; ``tracer.record.recorder.Recorder`` joins them."""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tracer.model import BackwardRun, Call, GradNode, NodeRun, TensorRecord, Trace, names
from tracer.model.records import Phase, Role
from tracer.options import RaisedOnPurpose, TraceOptions
from tracer.record import naming
from tracer.record.checksums.hasher import Hasher
from tracer.record.failsafe import failure_note, passes_on
from tracer.record.identity import identity
from tracer.record.listeners import Listener
from tracer.record.module_roots import name_in_callers, parameter_path, swaps_parameters
from tracer.record.owners import constructing_a_module, needs_search, owning_root_module
from tracer.record.phases import PhaseTracker
from tracer.record.stacks import NoStacks, Stacks, StackTable
from tracer.record.tensors import (
    DEVICE_NAMES,
    DTYPE_NAMES,
    RAGGED_NOTE,
    REORDERED,
    SAME_ORDER,
    VIEW_OPS,
    device_name,
    dtype_name,
    get_seq,
    plain_sizes,
    same_elements,
    same_multiset,
    same_values,
    same_view,
    storage_key,
    version_of,
)
from tracer.record.weakmap import IdWeakMap

if TYPE_CHECKING:
    from tracer.record.calls import PendingCall
    from tracer.record.mode import RecordingMode
    from tracer.record.modules import ModuleScopes
    from tracer.record.optimizer import OptimizerSteps

_TRACE_IDS = itertools.count()
# Searches of the live objects for a parameter's model per trace (each one gc pass; see owners.py).
MAX_OWNER_SEARCHES = 4
# Roles whose values have a name of their own, kept through writes by any alias.
OWNED_ROLES = frozenset({"param", "buffer", "state"})


class RecorderState:
    """The tables of one trace's recorder, and how tensor values get their names."""

    def __init__(self, trace: Trace, options: TraceOptions, *,
                 on_records: Callable[[], None] | None = None) -> None:
        self.trace = trace
        self.options = options
        self.owner = threading.get_ident()
        self.lock = threading.RLock()
        self.api = naming.ApiNames()
        self.counters = naming.Counters()
        self.stack_table: Stacks = StackTable() if options.stacks else NoStacks()
        self.hasher = Hasher(options.hash, stats=options.effective_stats)
        self._own_hasher = self.hasher
        # Whether values are read at all (checksums or stats): only then is a view worth telling
        # apart from a new value (see _same_values_input; the names+links+stacks trace skips it).
        self._reads_values = self.hasher.active
        # Set while a call with many new values is being recorded: their (record, tensor) pairs,
        # handed to Hasher.submit_many when the call's records are all made.
        self._deferred: list[tuple[TensorRecord, torch.Tensor]] | None = None
        # Built-in grad nodes get their hook (their runs recorded) at once when this is set,
        # else only when a backward run starts that needs them (see _hook_waiting_nodes):
        # names of the nodes waiting for it.
        self._every_node_run = options.every_node_run
        self._unhooked: set[str] = set()
        # Stats and no checksums: a transposed view of a contiguous value has that value's stats
        # (same_multiset), so it copies them too.
        self._stats_only = options.hash == "none" and options.effective_stats
        self.on_records = on_records
        self.listeners: list[Listener] = []
        self.paused = False
        self.closed = False
        # Set when a bound (max_calls) is reached: from then on nothing more is recorded.
        self.stopped = False
        self.failed = False  # gradtrace's own code failed while recording (recorder_failed)
        self.max_calls: int | None = options.max_calls
        # Set by tracer.features.distributed: (recorder, function) -> the recording wrapper of a
        # collective the mode met, or None.
        self.collective_hook: Callable[[Any, Any], Callable[..., Any] | None] | None = None
        self._in_backward = 0
        self.phases = PhaseTracker(trace.tensors)  # which phase each call is in
        # >0 while a recorded op runs: a Function applied inside an op (a torch.library custom
        # op's generated autograd Function) is that op's implementation, not a call of its own.
        self.op_depth = 0
        self._tensor_names: IdWeakMap[tuple[str, int]] = IdWeakMap()  # tensor -> (name, version)
        self._interned: dict[tuple[int, ...], tuple[int, ...]] = {}  # shapes and strides of records
        self._named: IdWeakMap[tuple[str, Role]] = IdWeakMap()  # param/buffer/state -> (name, role)
        # What p.grad or p.data returned before the parameter p was named -> (p, "grad"/"data"):
        # named when a call first uses it (see name_grad_alias, name_data_alias).
        self._read_before_named: IdWeakMap[tuple[torch.Tensor, str]] = IdWeakMap()
        self._running: list[str] = []  # grad nodes running now (nesting in backward)
        self._node_by_seq: dict[tuple[int, str], str] = {}
        self.trace_id = next(_TRACE_IDS)
        self._acc_by_var: IdWeakMap[str] = IdWeakMap()  # leaf tensor -> its accumulator's name
        self._acc_vars: dict[str, weakref.ref[torch.Tensor]] = {}  # accumulator name -> its leaf
        self._tensor_hooks = False  # Tensor.register_hook was called in the block
        # Non-leaf tensors whose gradient is retained (Tensor.retain_grad in the block): the
        # tensor (weakly) and the name its .grad gets, ``<name then>.grad`` (see autograd.py).
        self._retained: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        # Accumulator running now -> the name of its leaf's .grad before it ran (None: no .grad).
        self._grad_before: dict[str, str | None] = {}
        # Accumulators hooked without a pre-hook (see _acc_hook_alone): what their leaf's .grad was
        # is noted when a backward starts; a .grad the trace has no name for (from before the
        # block) is named only if its accumulator runs: the value then (weakly) and its version.
        self._acc_post_only: set[str] = set()
        self._grad_unnamed: dict[str, tuple[weakref.ref[torch.Tensor], int]] = {}
        # Nodes whose runs are not recorded and whose hooks read tensors without a name
        # (_note_unrecorded_node_hook).
        self._hook_inputs_noted: set[str] = set()
        self._aliases: dict[int, list[weakref.ref[torch.Tensor]]] = {}  # storage -> tensors
        self._node_modules: dict[str, str] = {}  # nodes that run user code -> their call's module
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
        self._versions: dict[str, int] = {}
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
        self._open_steps: dict[str, NodeRun] = {}
        self._call_seq = 0
        self._tensor_seq = 0
        self._node_seq = 0
        self._inputs = 0
        self._owner_searches = 0  # passes over the live objects made for this trace (see _name_model_of)
        self._self_ref = weakref.ref(self)
        self.node_attribution = "sequence-number" if get_seq is not None else "first-seen"

    def phase_of(self, name: str, kind: str, in_names: Sequence[str], produced: Sequence[Any],
                 writes: bool = False) -> Phase:
        """The phase of a call named ``name`` about to be recorded (tracer.record.phases): for
        features that build their own ``Call`` (collectives, custom Functions). ``writes``: it
        wrote a tensor in place."""
        if self._in_backward:
            return "backward"
        if kind != "optimizer" and self.scopes.innermost() is not None:
            return self.phases.module_call()
        return self.phases.outside_modules(name, kind, in_names, produced, writes)

    # ---- tensors ------------------------------------------------------------------------------
    def _new_tensor(self, t: torch.Tensor, name: str, role: Role, producer: str | None,
                    previous: str | None = None, like: TensorRecord | None = None,
                    uninitialized: bool = False, same_as: TensorRecord | None = None) -> str:
        """Record a new tensor value. ``like``: the record of the version this one replaced,
        when the call cannot have changed shape, strides, dtype or device (foreach in-place
        ops): its metadata is reused instead of read again (an optimizer step makes ~10 new
        versions of every parameter and state tensor). ``uninitialized``: memory nobody wrote
        (``torch.empty_like``): recorded, never hashed. ``same_as``: the record of a value
        this one reads as (``_reads_as``: a view of it): its checksum and stats are copied from
        that record, not computed again."""
        name = self._untaken(name)
        if like is not None:
            try:
                ver = t._version
            except RuntimeError:  # inference tensors have no version counter
                ver = 0
            rec = TensorRecord(name, like.shape, like.dtype, like.device, role, producer, like.stride,
                               like.contiguous, like.requires_grad, ver, self._tensor_seq, None, None, None,
                               None, previous)
            return self._add_record(rec, t, ver, same_as)
        try:
            stride: tuple[int, ...] | None = t.stride()
            contiguous = t.is_contiguous()
        except RuntimeError:  # sparse and other layouts have no strides
            stride, contiguous = None, False
        # Shapes and strides repeat across a step: one tuple per distinct value, not two fresh
        # tuples per record (memory, and fewer objects for the garbage collector to visit).
        interned = self._interned
        ragged = False
        try:
            size = t.shape
            shape = interned.get(size)
            if shape is None:  # a shape not met before: plain ints only (SymInts hash too)
                shape = tuple(size)
                if not all(type(v) is int for v in shape) or (
                        stride is not None and not all(type(v) is int for v in stride)):
                    raise TypeError("symbolic sizes")
                interned[shape] = shape
            if stride is not None:
                stride = interned.setdefault(stride, stride)
        except (TypeError, RuntimeError):
            # Symbolic sizes (not hashable) and nested tensors (a strided one has no sizes at
            # all; a jagged one has a symbolic ragged size): plain ints in the record, 0 where a
            # size is not one number (JSON, and every reader, needs ints).
            shape, stride, ragged = plain_sizes(t, stride)
        if stride is not None and type(stride) is not tuple:
            stride = tuple(stride)
        try:
            ver = t._version
        except RuntimeError:  # inference tensors have no version counter
            ver = 0
        dtype = DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype)
        device = DEVICE_NAMES.get(t.device) or device_name(t.device)
        # Positional (the field order of TensorRecord): keyword binding cost as much as the rest.
        rec = TensorRecord(name, shape, dtype, device, role, producer, stride, contiguous, t.requires_grad, ver,
                           self._tensor_seq, None, None, None, None, previous)
        if uninitialized:
            rec.uninitialized = True
            rec.hash_note = f"not hashed: uninitialised memory (made by {producer}); its first write is a new version"
        elif ragged:
            rec.hash_note = RAGGED_NOTE
            self._tensor_seq += 1
            self.trace.tensors[rec.name] = rec
            self._tensor_names[t] = (rec.name, ver)
            return rec.name
        return self._add_record(rec, t, ver, same_as)

    @contextlib.contextmanager
    def submits_batched(self) -> Iterator[None]:
        """Within: the new values' tensors go to the hasher together at the end (see _deferred)."""
        started = self._defer_submits()
        try:
            yield
        finally:
            if started:
                self._submit_deferred()

    def _defer_submits(self) -> bool:
        """Start collecting the new values' tensors (False: nothing to hash, or already collecting)."""
        if not self._reads_values or self._deferred is not None:
            return False
        self._deferred = []
        return True

    def _submit_deferred(self) -> None:
        batch, self._deferred = self._deferred, None
        if batch:
            self.hasher.submit_many(batch)

    def _untaken(self, name: str) -> str:
        """``name``, or ``name#k`` with the first k not taken: a record is never overwritten."""
        tensors = self.trace.tensors
        if name not in tensors:
            return name
        k = 1
        while f"{name}#{k}" in tensors:
            k += 1
        return f"{name}#{k}"

    def _add_record(self, rec: TensorRecord, t: torch.Tensor, ver: int,
                    same_as: TensorRecord | None = None) -> str:
        name = rec.name
        self._tensor_seq += 1
        self.trace.tensors[name] = rec
        self._tensor_names[t] = (name, ver)
        if rec.uninitialized:
            return name
        hasher = self.hasher
        if hasher is self._own_hasher:
            # With nothing to hash or summarise, skip the call.
            if hasher.active:
                if same_as is not None:
                    hasher.same_as(rec, same_as)
                elif self._deferred is not None:  # submitted with the call's other values
                    self._deferred.append((rec, t))
                else:
                    hasher.submit(rec, t)
        else:
            # A stand-in (an async collective's outputs get a note instead of a checksum; kept
            # values see every tensor) is always handed the tensor itself.
            hasher.submit(rec, t)
        return name

    def _same_values_input(self, t: torch.Tensor, short: str, ins: list[torch.Tensor], in_names: list[str],
                           changed: dict[int, str]) -> TensorRecord | None:
        """The record of an input of the call that made ``t`` and that ``t`` reads as (see
        ``_reads_as``): ``t`` gets that record's checksum and stats. ``short``: the op's short
        name (empty for anything but a torch op); ``changed``: inputs the call wrote (their old
        record is stale)."""
        base = t._base
        if base is None and short != "detach":  # (one attribute read for every other output)
            return None
        unwritten = ((x, xname) for x, xname in zip(ins, in_names) if identity(x) not in changed)
        return self._view_source(t, base, VIEW_OPS.get(short), unwritten)

    def _view_source(self, t: torch.Tensor, base: torch.Tensor | None, order: str | None,
                     candidates: Iterable[tuple[Any, str | None]]) -> TensorRecord | None:
        """The record of the first named candidate tensor that the view ``t`` (of ``base``; None:
        an alias without one, ``detach``) reads as (``_reads_as``): a call's inputs for its
        outputs, a grad node's received gradients for the ones it made."""
        for x, xname in candidates:
            if xname is not None and isinstance(x, torch.Tensor) and (base is None or x is base or x._base is base) \
                    and self._reads_as(x, t, order):
                return self.trace.tensors.get(xname)
        return None

    def _reads_as(self, x: torch.Tensor, t: torch.Tensor, order: str | None) -> bool:
        """Whether ``t``, a view of ``x``'s bytes, has ``x``'s checksum and stats: it reads the same
        values in the same order, or, when only stats are taken, the same values in any order.
        ``order``: what the view's op (or grad node) does to the order of the elements
        (``tensors.VIEW_OPS``), None when not known: then only the layouts can tell."""
        if order is SAME_ORDER:
            return same_elements(x, t)
        if order is REORDERED:  # (a checksum reads the order: only a permutation that changes none)
            return same_elements(x, t) if self._stats_only else same_values(x, t)
        return same_values(x, t) or (self._stats_only and same_multiset(x, t))

    def name_of(self, t: torch.Tensor) -> str:
        """The current name of a tensor, registering it (and hashing it) on first sight."""
        return self._name_at(t, version_of(t))

    def _name_at(self, t: torch.Tensor, version: int, overwritten_by: str | None = None) -> str:
        """``name_of`` for a tensor whose current version the caller has just read.
        ``overwritten_by``: the call about to run writes every byte of ``t`` without reading them
        (an initialiser: ``uniform_``, ``kaiming_uniform_``, ``fill_``)."""
        hit = self._tensor_names.get(t)
        if hit is not None:
            name, ver = hit
            if version == ver:
                return name
            # Changed in place where the trace could not see it (untraced code, through .data).
            base = self._base_name(name)
            old = self.trace.tensors.get(name)
            return self._new_tensor(t, self._bump(base), old.role if old is not None else "input", None,
                                    previous=name)
        named = self._named.get(t)
        if named is not None:
            # A parameter first seen after code wrote its bytes through a live alias the trace
            # met first (an EMA helper's kept ``.data`` tensors, updated before the EMA model
            # runs): its record continues that alias's last version, whose bytes it holds.
            key = storage_key(t)  # (read once: for the alias and for the index)
            prior = self._same_view_alias(t, key) if key and key in self._aliases else None
            prior_name = self.name_of(prior) if prior is not None else None
            name = self._new_tensor(t, named[0], named[1], None, previous=prior_name,
                                    same_as=self.trace.tensors.get(prior_name) if prior_name is not None else None)
            self._index_alias(t, key)
            return name
        if self._running:
            leaf = self._name_leaf_grad(t, version)
            if leaf is not None:
                return leaf
        if self._aliases:
            alias = self._alias_name(t, version)
            if alias is not None:
                return alias
        if type(t) is torch.nn.Parameter and self._name_model_of(t):
            return self._name_at(t, version)
        if len(self._read_before_named):
            read = self._read_before_named.get(t)
            if read is not None and self._name_read_before(t, *read):
                return self._name_at(t, version)
        self._inputs += 1
        if overwritten_by is not None:
            # Met first as what an initialiser overwrites (``nn.Parameter(torch.empty(...))`` in a
            # constructor that runs in the block): bytes nobody wrote or will read, not hashed.
            name = self._new_tensor(t, f"input{self._inputs - 1}", "input", None, uninitialized=True)
            rec = self.trace.tensors[name]
            rec.hash_note = (f"not hashed: first seen being overwritten by {overwritten_by}, which reads none "
                             "of its bytes; its new value is the next version")
            self._index_alias(t)
            return name
        name = self._new_tensor(t, f"input{self._inputs - 1}", "input", None)
        if self._in_backward and self._unhooked:
            self._note_unrecorded_node_hook(name)
        self._index_alias(t)
        return name

    def name_data_alias(self, source: torch.Tensor, alias: torch.Tensor) -> None:
        """``source.data`` returned ``alias``: a new tensor object on the same bytes, seen the same
        way, with a version counter of its own (a write through it bumps no version of
        ``source``). It takes ``source``'s name, and both are indexed by their storage, so a
        write through either (``p.data.clamp_()`` before the model runs, ``y.data.mul_(2)``) is
        a new version of the value both show. A tensor the trace knows gives its name now; a
        parameter not named yet, when a call first uses ``alias`` (``_name_read_before``: its
        model is looked for then, not for a read that only asks for a dtype). ``.data`` of any
        other tensor leaves it unnamed (and costs nothing) until a call uses it."""
        if self._tensor_names.get(source) is not None or source in self._named:
            self._take_name_of(source, alias)
        elif type(source) is torch.nn.Parameter:
            self._read_before_named[alias] = (source, "data")

    def _take_name_of(self, source: torch.Tensor, alias: torch.Tensor) -> None:
        """``alias`` (``source.data``) takes ``source``'s current name; both indexed by storage."""
        name = self._name_at(source, version_of(source))
        self._tensor_names[alias] = (name, version_of(alias))
        key = storage_key(source)
        if not key:
            return
        refs = self._aliases.setdefault(key, [])
        if len(refs) > 8:  # (a loop of ``p.data.add_()`` leaves one dead alias per turn)
            refs[:] = [r for r in refs if r() is not None]
        if not any(r() is source for r in refs):
            refs.append(weakref.ref(source))
        refs.append(weakref.ref(alias))

    def name_grad_alias(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``param.grad`` returned ``grad``, a tensor the trace has not named: the gradient left
        from before the block (a block that starts after a backward pass: clipping, a
        hand-written update, a step that ends at each backward). A parameter's is named
        ``<param>@grad``, as the backward would have named it: now when the parameter has its
        name, else when a call first uses the gradient (``_name_read_before``: its model is
        looked for then; ``zero_grad()`` at the top of a block reads every ``.grad`` and uses
        none). Not during a backward run: there the accumulators' hooks name what ``.grad``
        becomes (a post-accumulate hook reads it before they run)."""
        if grad in self._named or type(param) is not torch.nn.Parameter or self._in_backward:
            return
        named = self._named.get(param)
        if named is None:
            self._read_before_named[grad] = (param, "grad")
        elif named[1] == "param":
            self._named[grad] = (f"{named[0]}@grad", "grad")

    def name_assigned_grad(self, pname: str, g: torch.Tensor, hit: tuple[str, int]) -> None:
        """``g``, the ``.grad`` of the parameter named ``pname``, is a value the trace named
        otherwise (``hit``): one the program assigned (``p.grad = torch.stack(grads).mean(0)``,
        as parameter-server and hand-made all-reduce loops do). It is also recorded as
        ``<pname>@grad`` (a later one ``@grad@v<k>``), with that value's checksum, and goes by
        that name from now on."""
        if hit[0].startswith(f"{pname}@grad"):
            return
        base = f"{pname}@grad"
        shown = self.trace.tensors.get(hit[0])
        name = self._new_tensor(g, self._bump(base) if base in self.trace.tensors else base, "grad",
                                shown.producer if shown is not None else None, same_as=shown)
        self._named[g] = (name, "grad")

    def _name_read_before(self, t: torch.Tensor, owner: torch.Tensor, how: str) -> bool:
        """Name ``t``, read as ``owner.data`` or ``owner.grad`` before ``owner`` (a parameter)
        had a name, now that a call uses it: ``owner``'s model named first if need be. Whether
        ``t`` has a name to take now."""
        if owner not in self._named and self._tensor_names.get(owner) is None:
            self._name_model_of(owner)
        if how == "data":  # (a parameter no module holds: the alias shares its input<k> name)
            self._take_name_of(owner, t)
            return True
        named = self._named.get(owner)
        if named is None or named[1] != "param":
            return False
        self._named[t] = (f"{named[0]}@grad", "grad")
        return True

    def _name_model_of(self, p: torch.Tensor) -> bool:
        """A parameter met before any module of its model ran in the block (outside any module
        call): name that model's modules, parameters and buffers now, as if it had been called
        first (tracer.record.owners). Whether ``p`` has a name to take now."""
        if constructing_a_module():
            return False
        running = self.scopes.innermost()
        if running is not None:  # used by a module running now: the one that holds it, if any
            module = self.scopes.module_at(running)
            if module is not None and self._name_replaced(module, running, p):
                return True
            # Not its own: another model's, reached by the walk over the graph (a GAN's generator,
            # whose forward ran in the step before, met from the discriminator's output).
        search = needs_search(p) and self._owner_searches < MAX_OWNER_SEARCHES
        if search:
            self._owner_searches += 1
        root = owning_root_module(p, search)
        if root is None:
            return False
        root_path = self.scopes.path_of(root)
        if root_path is not None:
            return self._name_replaced(root, root_path, p)
        # A second model (an EMA updated after the trained model's step) under the name the
        # user's code holds it by.
        self.scopes.register_root_module(root, name_in_callers(root, 1) if "" in self.trace.modules else None)
        return p in self._named

    def name_step_inputs(self, optimizer: Any) -> None:
        """An optimizer step begins: its parameters, their gradients and their state get names
        (a parameter met first here: its model is named; a ``.grad`` no backward of the block
        made; state that is not named yet: ``<param>.<key>``)."""
        with self.lock, torch._C.DisableTorchFunction():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    named = self._named.get(p)
                    if named is None:  # a step before any module of its model ran in the block
                        if p in self._tensor_names or not self._name_model_of(p):
                            continue
                        named = self._named.get(p)
                        assert named is not None  # (what _name_model_of says)
                    pname = named[0]
                    g = p.grad
                    if g is not None:
                        hit = self._tensor_names.get(g)
                        if hit is None:
                            # A .grad no backward of the block made (set by hand, or before the block).
                            base = f"{pname}@grad"
                            self._new_leaf_grad(g, self._bump(base) if base in self.trace.tensors else base,
                                                None, None)
                        elif hit[1] != version_of(g):
                            self.name_of(g)  # changed in place since it was named: a new version
                        else:
                            self.name_assigned_grad(pname, g, hit)
                    for key, v in optimizer.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor) and v not in self._named:
                            self._named[v] = (f"{pname}.{key}", "state")

    def names_at(self, ts: list[torch.Tensor], versions: list[int]) -> list[str]:
        """The names of many tensors whose versions the caller has just read, their new values
        handed to the hasher together (an optimizer step's parameters and state)."""
        with self.submits_batched():
            return [self._name_at(t, v) for t, v in zip(ts, versions)]

    def name_new_state(self, optimizer: Any, producer: str | None, record: bool) -> list[torch.Tensor]:
        """After an optimizer step: state it made (its first step) is named after its parameter,
        ``<param>.<key>``; ``record``: also recorded, made by ``producer``. Returns what was
        recorded."""
        created: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                named = self._named.get(p)
                hit = self._tensor_names.get(p) if named is None else None
                owner = named[0] if named is not None else self._base_name(hit[0]) if hit is not None else None
                for key, v in optimizer.state.get(p, {}).items():
                    # State made by this step (the first one): named after its parameter.
                    if owner is not None and isinstance(v, torch.Tensor) and v not in self._named \
                            and self._tensor_names.get(v) is None:
                        self._named[v] = (f"{owner}.{key}", "state")
                        if record:
                            self._new_tensor(v, f"{owner}.{key}", "state", producer)
                            created.append(v)
        return created

    def name_by_paths(self, params: list[tuple[str, torch.Tensor]], buffers: list[tuple[str, torch.Tensor]]) -> None:
        """A root module's parameters and buffers, by path (``named_parameters()``'s order and
        first-wins naming of shared ones): each takes its path for a name."""
        named = self._named
        renamed: list[tuple[torch.Tensor, str, Role]] = []
        for pname, p in params:
            if p not in named:
                named[p] = (pname, "param")
                renamed.append((p, pname, "param"))
        for bname, b in buffers:
            if b not in named:
                named[b] = (bname, "buffer")
                renamed.append((b, bname, "buffer"))
        self._take_paths(renamed)

    def _take_paths(self, tensors: list[tuple[torch.Tensor, str, Role]]) -> None:
        """Parameters and buffers the trace met before their module ran (made and initialised in
        the block, by the model's own constructor: ``input4``, ``zeros0:out``) take their paths
        now: a record of that name holding the value they hold (its checksum copied),
        ``previous`` the name they had."""
        known = self._tensor_names
        with self.lock, torch._C.DisableTorchFunction():
            for t, path, role in tensors:
                hit = known.get(t)
                if hit is None:
                    continue
                rec = self.trace.tensors.get(hit[0])
                if rec is None or rec.role in ("param", "buffer"):
                    continue
                same = rec if hit[1] == version_of(t) and not rec.uninitialized else None
                self._new_tensor(t, path, role, rec.producer, previous=hit[0], same_as=same)

    def _name_replaced(self, module: torch.nn.Module, prefix: str, p: torch.Tensor) -> bool:
        """A parameter of a model the trace has named already, not named itself: a new Parameter
        object put in place of the one named (``module.to_empty()`` after a meta-device build,
        a move between devices, ``module.weight = nn.Parameter(...)``). It is a new version of
        the path's value (``0.weight@v1``, ``previous`` the path's last version) when the path
        has a record, else the path itself."""
        if swaps_parameters(self.scopes.modules()):
            # FSDP2 puts the unsharded parameter in place of the sharded one for each forward
            # and backward: another form of the same value (named by the all-gather that makes
            # it), not a new one.
            return False
        path = parameter_path(module, prefix, p)
        if path is None:
            return False
        self._named[p] = (path, "param")  # (its gradients: <path>@grad)
        if path in self.trace.tensors:
            last = self._versions.get(path, 0)
            previous = names.version_name(path, last) if last else path
            self._new_tensor(p, self._bump(path), "param", None, previous=previous)
        else:
            self._new_tensor(p, path, "param", None)
        self._index_alias(p)
        return True

    def _note_unrecorded_node_hook(self, input_name: str) -> None:
        """A tensor without a name met in a hook of a grad node whose run is not recorded
        (``node_runs`` off): possibly a gradient that node received or produced, handed to a
        hook registered on the node itself (``grad_fn.register_hook``), which gradtrace cannot
        see. It stays ``input<k>`` (it may as well come from before the block); a note per
        node says so and how to have the node's gradients named."""
        node = self._engine_node()
        if node is None or node not in self._unhooked or node in self._hook_inputs_noted:
            return
        self._hook_inputs_noted.add(node)
        self.trace.notes.append(
            f"a hook of grad node {node} read {input_name}, a tensor without a name: if it is one of the "
            f"node's gradients (a hook registered on the node itself, grad_fn.register_hook, which gradtrace "
            f"cannot see), its name is not known because the node's run was not recorded; "
            f"trace(node_runs=True) names every node's gradients")

    # ---- aliases: tensors that share a named tensor's storage -----------------------------------
    # ``p.data``, ``p.detach()`` and views share p's bytes; ``.data`` does not even share its
    # version counter. Tensors from outside the block (parameters, buffers, optimizer state,
    # inputs, leaves' gradients) are indexed by storage, so that a write through an alias makes a
    # new version of the tensor it aliases. Outputs of calls are not indexed (thousands per step);
    # a write into one through a view still shows as a new version of its base.
    def _index_alias(self, t: torch.Tensor, key: int | None = None) -> None:
        """Index ``t`` by its storage (``key``: that storage's, when the caller has read it)."""
        if key is None:
            key = storage_key(t)
        if key:
            self._aliases.setdefault(key, []).append(weakref.ref(t))

    def _same_view_alias(self, t: torch.Tensor, key: int) -> torch.Tensor | None:
        """A named, indexed tensor that ``t`` (whose storage is ``key``) is the same view of
        (``p.data``), if any."""
        for ref in self._aliases.get(key, ()) if key else ():
            o = ref()
            if o is not None and o is not t and same_view(o, t) and storage_key(o) == key \
                    and self._tensor_names.get(o) is not None:
                return o
        return None

    def _alias_name(self, t: torch.Tensor, version: int) -> str | None:
        """The name of an indexed tensor that ``t`` is the same view of (``p.data``), if any."""
        key = storage_key(t)
        o = self._same_view_alias(t, key)
        if o is None:
            return None
        name = self._name_at(o, version_of(o))  # a new version first, if o changed unseen
        self._tensor_names[t] = (name, version)
        self._aliases[key].append(weakref.ref(t))
        return name

    def _write_through_aliases(self, mutated: list[torch.Tensor], names: dict[int, str], call: str,
                               ins: list[torch.Tensor]) -> None:
        """A call that changed ``mutated`` changed every named tensor sharing their bytes too. Its
        own inputs excepted: an op keeps what it reads (an in-place all-gather's input is a slice
        of its output, rewritten with the same bytes)."""
        done = set(names)
        done.update(identity(t) for t in ins)
        for t in mutated:
            new = names[identity(t)]
            others: list[torch.Tensor] = []
            key = storage_key(t) if self._aliases else 0
            if key:  # (an entry whose storage has changed since, by set_ or resize, is not an alias)
                for ref in self._aliases.get(key, ()):
                    o = ref()
                    # The tensor itself first, without reading its storage again: an optimizer
                    # step writes hundreds of indexed tensors, each usually its storage's only one.
                    if o is not None and o is not t and identity(o) not in done and storage_key(o) == key:
                        others.append(o)
            base = t._base
            if base is not None:
                others.append(base)
            for o in others:
                k = identity(o)
                if k in done:
                    continue
                hit = self._tensor_names.get(o)
                if hit is None:
                    continue
                done.add(k)
                if same_view(o, t):  # the same bytes seen through another tensor object
                    old = self.trace.tensors.get(hit[0])
                    own = self._base_name(hit[0])
                    if old is not None and old.role in OWNED_ROLES and self._base_name(new) != own:
                        # A parameter, buffer or optimizer state written through a detached
                        # alias (an EMA's foreach update of ``p.detach()`` lists, AveragedModel's
                        # first copy): its own next version, with the written value's checksum;
                        # else its name would stay on the value before the write.
                        self._new_tensor(o, self._bump(own), old.role, call, previous=hit[0],
                                         same_as=self.trace.tensors.get(new))
                    else:
                        self._tensor_names[o] = (new, version_of(o))
                else:
                    old = self.trace.tensors.get(hit[0])
                    role = old.role if old is not None else "input"
                    self._new_tensor(o, self._bump(self._base_name(hit[0])), role, call, previous=hit[0])

    @staticmethod
    def _base_name(name: str) -> str:
        return names.base_name(name)

    def recorder_failed(self, exc: Exception) -> None:
        """gradtrace's own code raised ``exc`` while recording, inside the user's program
        (tracer.record.failsafe): stop recording and keep the trace; or pass ``exc`` on, when
        gradtrace raised it on purpose or runs strict."""
        __tracebackhide__ = True
        if isinstance(exc, RaisedOnPurpose):  # (its traceback below here is gradtrace's own)
            raise exc.with_traceback(None) from exc.__cause__
        if passes_on(exc):
            raise exc
        self.failed = True
        self.stop(failure_note(exc))

    def _bump(self, base: str) -> str:
        n = self._versions.get(base, 0) + 1
        self._versions[base] = n
        return names.version_name(base, n)

    if TYPE_CHECKING:  # defined by the rooms that join in Recorder; declared for the others
        mode: RecordingMode
        scopes: ModuleScopes
        steps: OptimizerSteps

        def _collect_nodes(self, root: Any, seq0: int | None, seq1: int | None, call: str, stack_id: int | None,
                           out: list[str], local_kinds: dict[str, int]) -> str | None: ...
        def _name_leaf_grad(self, t: torch.Tensor, version: int) -> str | None: ...
        def _engine_node(self) -> str | None: ...
        def _new_leaf_grad(self, g: torch.Tensor, name: str, producer: str | None, previous: str | None) -> str: ...
        def begin_call(self, ins: list[torch.Tensor], *, api: str, short: str, kind: str,
                       name: str | None = None) -> PendingCall: ...
        def finish_call(self, pending: PendingCall, outs: list[torch.Tensor], mutated: Sequence[torch.Tensor] = (),
                        *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Call: ...
        def fail_call(self, pending: PendingCall, exc: BaseException, *, args: tuple[Any, ...] = (),
                      kwargs: dict[str, Any] | None = None) -> None: ...
        def _finish_call(self, api: str, short: str, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                         ins: list[torch.Tensor], in_names: list[str], outs: list[torch.Tensor],
                         mutated: list[torch.Tensor], seq: int, seq0: int | None,
                         name: str | None = None, tokens: list[Any] | None = None,
                         stack_id: int | None = -1, skip: int = 2) -> Call: ...
        def stop(self, reason: str) -> None: ...
        def append_call(self, call: Call, tokens: list[Any] | None = None,
                        produced: list[torch.Tensor] | None = None) -> None: ...
