"""The recorder: observes forward API calls, custom Functions, modules and grad nodes.

Hook points (see docs/design notes in DESIGN.md for why each one):
- a ``TorchFunctionMode`` (thread-local) sees the public API calls the user wrote;
- ``autograd.Function.apply`` is wrapped while a trace is active, since Functions do not go
  through ``__torch_function__`` (the wrapper checks the owning thread);
- global module forward pre/post hooks give the module path of every call (owning thread only);
- each grad node a call creates gets a hook, which records the backward order and the gradients
  the node received and produced; nodes that run Python (custom backwards, accumulators with
  hooks, saved-tensor unpack hooks) or that a listener follows also get a pre-hook, so calls
  made inside them know their node. A failing node without one is inferred from the graph.
  The hooks hold only a weak reference to the recorder and a node name, never a tensor, and do
  nothing once the trace is closed;
- ``optimizer.step()`` is one call (global pre-hook, per-optimizer post-hook), unless
  ``optimizer_ops`` asks for every op inside it;
- ``Tensor.backward`` / ``torch.autograd.backward`` / ``torch.autograd.grad`` arrive through the
  mode and delimit backward runs.

Nodes are attributed to calls by bracketing each call with autograd's sequence number: nodes
whose number falls inside the bracket were created by that call (``F.linear`` on 3-D input makes
several). Where the private counter is missing, a node is attributed to the first call whose
outputs reach it (documented in the trace header as ``node_attribution``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from tracer.model import BackwardRun, Call, GradNode, NodeRun, TensorRecord, Trace, names
from tracer.options import TraceOptions
from tracer.record import naming
from tracer.record.checksums.hasher import Hasher
from tracer.record.effects import UNINITIALISED, Writes
from tracer.record.identity import identity
from tracer.record.listeners import Listener
from tracer.record.stacks import StackTable
from tracer.record.weakmap import IdWeakMap

_get_seq: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)
_CAPTURE_NOW = -1  # _finish_call's stack_id default: capture the stack at that moment
# Private: the innermost saved-tensor hooks (None when none are active). Where it is missing,
# hooks are assumed active (every node then gets the pre-hook, as before this mattered).
_top_saved_hooks: Callable[[bool], Any] | None = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_ACCUMULATE = "AccumulateGrad"
_UINT64_MAX = 2**64 - 1
# Accumulator nodes are marked in their ``metadata`` dict (which lives as long as the C++ node,
# unlike its Python wrapper, and cannot be weakly referenced) with (trace id, node name): a new
# accumulator object for a parameter already named (its first graph died: gradient accumulation,
# a discarded forward) is then told apart from one already hooked.
_NODE_TAG = "gradtrace"
_TRACE_IDS = itertools.count()
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dt: torch.dtype) -> str:
    n = _DTYPE_NAMES.get(dt)
    if n is None:
        n = _DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return n


_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(dev: torch.device) -> str:
    # One string per device for the whole process, not a new one per tensor record.
    n = _DEVICE_NAMES.get(dev)
    if n is None:
        n = _DEVICE_NAMES[dev] = str(dev)
    return n


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return 0


def flat_tensors(obj: Any, out: list[torch.Tensor] | None = None, depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside an argument or result (tuples, lists, dicts, a few levels deep)."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3:
        if isinstance(obj, tuple | list):
            for x in obj:
                if isinstance(x, torch.Tensor):
                    out.append(x)
                elif isinstance(x, tuple | list | dict):
                    flat_tensors(x, out, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                flat_tensors(x, out, depth + 1)
    return out


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (non-reentrant checkpointing, CPU offload) are active: their
    unpack side runs Python inside built-in grad nodes, whose calls need the running node."""
    if _top_saved_hooks is None:
        return True
    try:
        return _top_saved_hooks(False) is not None
    except TypeError:  # another signature: be conservative
        return True


_BackwardCFunction = torch.autograd.function.BackwardCFunction


def _runs_user_code(node: Any, kind: str) -> bool:
    if kind == _ACCUMULATE:
        var = getattr(node, "variable", None)
        return getattr(var, "_post_accumulate_grad_hooks", None) is not None
    return isinstance(node, _BackwardCFunction)


def _grad_fn(t: torch.Tensor) -> Any:
    """``t.grad_fn``, or None where reading it raises (a no_grad view whose base changed)."""
    try:
        return t.grad_fn
    except RuntimeError:
        return None


def _creates_graph(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a backward call passes ``create_graph=True`` (by keyword or position)."""
    if "create_graph" in kwargs:
        return bool(kwargs["create_graph"])
    # Positions: Tensor.backward(self, gradient, retain_graph, create_graph),
    # autograd.backward(tensors, grad_tensors, retain_graph, create_graph),
    # autograd.grad(outputs, inputs, grad_outputs, retain_graph, create_graph).
    pos = 4 if api.endswith(".grad") else 3
    return len(args) > pos and bool(args[pos])


def _storage_key(t: torch.Tensor) -> int:
    """Which storage a tensor's bytes live in (0 when it has none that can be read): the storage
    object's identity, not its address, which a later allocation may reuse once it is freed
    (FSDP frees and reallocates parameter storages every step). ``_cdata`` is private; the
    address is the fallback."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return 0
    key = getattr(s, "_cdata", None)
    if key is None:
        try:
            key = s.data_ptr()
        except (RuntimeError, NotImplementedError):
            return 0
    return key if s.nbytes() else 0  # type: ignore[no-any-return]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors show the same bytes the same way (``p`` and ``p.data``)."""
    try:
        return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape \
            and a.stride() == b.stride()
    except (RuntimeError, NotImplementedError):
        return False


def _unique(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of ``ts`` without repeats (by identity), in first-seen order."""
    n = len(ts)
    if n < 2:
        return ts
    if n == 2:
        return ts if ts[0] is not ts[1] else ts[:1]
    if len({identity(t) for t in ts}) == n:  # the usual case: no repeat, keep the list
        return ts
    seen: set[int] = set()
    res = []
    for t in ts:
        key = identity(t)
        if key not in seen:
            seen.add(key)
            res.append(t)
    return res


def _first(item: tuple[Any, ...]) -> Any:
    return item[0]


def _call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """The distinct tensors among a call's arguments (what ``flat_tensors`` finds in both)."""
    ts: list[torch.Tensor] = []
    for a in args:  # flat_tensors(args, ts), its first level inlined: most arguments are flat
        if isinstance(a, torch.Tensor):
            ts.append(a)
        elif isinstance(a, tuple | list | dict):
            flat_tensors(a, ts, 1)
    if kwargs:
        flat_tensors(kwargs, ts)
    return _unique(ts)


def _versions_of(ts: list[torch.Tensor]) -> list[int]:
    try:
        return [t._version for t in ts]
    except RuntimeError:  # an inference tensor among them: ask one by one
        return [_version(t) for t in ts]


class _OpenStep(NamedTuple):
    """An optimizer step in progress, recorded as one call when it ends."""

    optimizer: Any
    frame: FrameType  # the frame running the step (torch's step wrapper), for step_running()
    call: PendingCall
    versions: list[int]  # of call.ins when the step began
    written: set[int]  # identities of the tensors the step writes, whatever their versions say


@dataclass(slots=True)
class PendingCall:
    """A call in progress: its inputs named and its place in the trace taken before it runs
    (``Recorder.begin_call``), finished by ``finish_call`` or ``fail_call``."""

    api: str
    short: str
    kind: str
    ins: list[torch.Tensor]
    in_names: list[str]
    seq: int
    seq0: int | None  # autograd's sequence number before the call (its grad nodes come after)
    tokens: list[Any] | None  # what each listener's before_call returned
    name: str | None = None  # taken early (a custom Function: its inner calls name it as parent)
    stack_id: int | None = -1  # taken early (-1: captured when the call is finished)


class _Unhashed:
    """Stands in for the recorder's hasher while tensors that have no data yet are named (the
    results of an async collective): each gets a note instead of a checksum."""

    def __init__(self, real: Hasher, note: str) -> None:
        self._real = real
        self._note = note

    def submit(self, rec: TensorRecord, t: torch.Tensor) -> None:
        rec.hash_note = self._note

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Mode(TorchFunctionMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder: Recorder | None = recorder  # None once the recorder is uninstalled

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        rec = self.recorder
        if rec is None:
            return func(*args, **kwargs)
        try:  # ApiNames.describe, its cache hit inlined: this runs for every torch call
            hit = rec.api._cache.get(func)
        except TypeError:  # an unhashable callable
            hit = None
        api, short, kind, writes = hit if hit is not None else rec.api.describe(func)
        if rec._step is not None and kind != "skip" and not rec.step_running():
            rec.close_step("optimizer.step() raised; its changes up to there are recorded")
        if kind == "skip" or rec.paused or rec.stopped:
            return func(*args, **kwargs)
        if kind == "backward":
            return rec.record_backward(func, api, args, kwargs)
        if kind == "collective":
            # References to collectives taken before the trace land here, not in the wrappers
            # (tracer.features.distributed sets the hook while a process group is traced).
            hook = rec.collective_hook
            wrapped = hook(rec, func) if hook is not None else None
            if wrapped is not None:
                return wrapped(*args, **kwargs)
            kind = "op"
        return rec.record_call(func, api, short, kind, args, kwargs, writes)


class Recorder:
    """Owns every hook of one active trace and turns what they see into trace records."""

    def __init__(self, trace: Trace, options: TraceOptions, *,
                 on_records: Callable[[], None] | None = None) -> None:
        self.trace = trace
        self.options = options
        # False: each optimizer.step() is one call (see _open_step); True: every op inside it.
        self.optimizer_ops = options.optimizer_ops
        self._step: _OpenStep | None = None  # the optimizer step running now, recorded as one call
        self._step_hooked: weakref.WeakSet[Any] = weakref.WeakSet()
        self.owner = threading.get_ident()
        self.lock = threading.RLock()
        self.api = naming.ApiNames()
        self.counters = naming.Counters()
        self.stack_table: StackTable | None = StackTable() if options.stacks else None
        self.hasher = Hasher(options.hash, stats=options.effective_stats)
        self._own_hasher = self.hasher
        self.on_records = on_records
        self.listeners: list[Listener] = []
        self.paused = False
        self.closed = False
        # Set when a bound (max_calls) is reached: from then on nothing more is recorded.
        self.stopped = False
        self.max_calls: int | None = options.max_calls
        # Set by tracer.features.distributed: (recorder, function) -> the recording wrapper of a
        # collective the mode met, or None.
        self.collective_hook: Callable[[Recorder, Any], Callable[..., Any] | None] | None = None
        self._in_backward = 0
        # >0 while a recorded op runs: a Function applied inside an op (a torch.library custom
        # op's generated autograd Function) is that op's implementation, not a call of its own.
        self.op_depth = 0
        self._tensor_names: IdWeakMap[tuple[str, int]] = IdWeakMap()  # tensor -> (name, version)
        self._interned: dict[tuple[int, ...], tuple[int, ...]] = {}  # shapes and strides of records
        self._named: IdWeakMap[tuple[str, str]] = IdWeakMap()  # param/buffer/state -> (name, role)
        self._module_paths: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._module_stack: list[str] = []
        self._scope_frames: list[FrameType | None] = []  # per _module_stack entry, see _module_pre
        self._parents: list[str] = []  # enclosing custom Function calls
        self._running: list[str] = []  # grad nodes running now (nesting in backward)
        self._node_by_seq: dict[tuple[int, str], str] = {}
        self.trace_id = next(_TRACE_IDS)
        self._acc_by_var: IdWeakMap[str] = IdWeakMap()  # leaf tensor -> its accumulator's name
        self._acc_vars: dict[str, weakref.ref[torch.Tensor]] = {}  # accumulator name -> its leaf
        # Accumulator running now -> the name of its leaf's .grad before it ran (None: no .grad).
        self._grad_before: dict[str, str | None] = {}
        self._aliases: dict[int, list[weakref.ref[torch.Tensor]]] = {}  # storage -> tensors
        self._node_modules: dict[str, str] = {}  # nodes that run user code -> their call's module
        # A backward run with create_graph=True makes grad nodes while it runs; those are
        # adopted by the node that made them (see _adopt_nodes).
        self._create_graph = False
        self._bwd_seq0: tuple[int, int] | None = None  # (thread, sequence number) at its start
        self._edges: dict[str, tuple[tuple[str | None, int], ...]] = {}  # node -> (dest node, slot) per output
        self._node_recs: dict[str, GradNode] = {}
        self._slot_tensor: dict[tuple[str, int], str] = {}
        # Edges into each (node, input slot) in the graph the running backward walks: a gradient
        # that alone flows into a tensor's slot is that tensor's gradient (see _grad_names).
        self._indegree: dict[tuple[str, int], int] = {}
        self._versions: dict[str, int] = {}
        self._handles: list[Any] = []
        # Grad nodes that run user Python (custom Function backwards, accumulators with
        # post-accumulate hooks such as an optimizer step in backward): flush checksums first.
        self._flush_before: set[str] = set()
        # Saved-tensor hooks were active while the call being finished ran (see _register_node).
        self._saved_hooks = True
        # Compiled regions running now: (module, the DisableTorchFunction context, its hook, the call)
        self._opaque: list[tuple[torch.nn.Module, Any, Any, PendingCall]] = []
        self._module_handles: list[Any] = []
        self._run: BackwardRun | None = None
        self._run_index = -1
        self._open_steps: dict[str, NodeRun] = {}
        self._call_seq = 0
        self._tensor_seq = 0
        self._node_seq = 0
        self._inputs = 0
        self._mode = _Mode(self)
        self._self_ref = weakref.ref(self)
        self.node_attribution = "sequence-number" if _get_seq is not None else "first-seen"

    # ---- installation -------------------------------------------------------------------------
    def install(self) -> None:
        self._install_module_hooks()
        try:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        except ImportError:
            pass
        _install_apply_wrapper(self)
        self._mode.__enter__()

    def _install_module_hooks(self) -> None:
        from torch.nn.modules import module as nn_module

        try:
            post = nn_module.register_module_forward_hook(self._module_post, always_call=True)
        except TypeError:  # older torch without always_call
            post = nn_module.register_module_forward_hook(self._module_post)
        self._module_handles = [nn_module.register_module_forward_pre_hook(self._module_pre), post]

    def _remove_module_hooks(self) -> None:
        for h in self._module_handles:
            h.remove()
        self._module_handles = []

    def uninstall(self) -> None:
        """Remove every mode, hook and wrapper. Safe to call twice."""
        if self.closed:
            return
        if self._step is not None:  # the block ended inside optimizer.step() (it raised)
            try:
                self.close_step("optimizer.step() raised; its changes up to there are recorded")
            except Exception:  # recording must not stop the uninstall
                self._step = None
        self.closed = True
        try:
            self._mode.__exit__(None, None, None)
            # The mode points back at this recorder: once it is off the stack, drop that link, so
            # that a finished trace is freed by reference counting, not by the cycle collector
            # (which would walk all of its records to find the cycle).
            self._mode.recorder = None
        finally:
            _uninstall_apply_wrapper(self)
            for h in self._handles:
                try:
                    h.remove()
                except Exception:  # a handle whose owner is gone already
                    pass
            self._handles.clear()
            while self._opaque:
                _, ctx, local, _pending = self._opaque.pop()
                ctx.__exit__(None, None, None)
                local.remove()
            self._remove_module_hooks()
            if self.stack_table is not None:
                self.stack_table.clear_scopes()
            self._scope_frames.clear()

    @property
    def function_depth(self) -> int:
        """How many custom Function forwards enclose the call being recorded."""
        return len(self._parents)

    @property
    def backward_open(self) -> bool:
        """Whether a backward run is in progress (its record still being filled)."""
        return self._run is not None

    @property
    def in_backward(self) -> bool:
        """Whether a backward run of this trace is in progress."""
        return self._in_backward > 0

    @property
    def running_node(self) -> str | None:
        """The grad node running now (innermost), when a backward is in progress."""
        return self._running[-1] if self._running else None

    def stop(self, reason: str) -> None:
        """Stop recording cleanly (a bound was reached); the trace and the console say why."""
        if self.stopped:
            return
        self.stopped = True
        self.trace.notes.append(reason)
        warnings.warn(f"gradtrace: {reason}", RuntimeWarning, stacklevel=2)

    # ---- tensors ------------------------------------------------------------------------------
    def _new_tensor(self, t: torch.Tensor, name: str, role: str, producer: str | None,
                    previous: str | None = None, like: TensorRecord | None = None,
                    uninitialized: bool = False) -> str:
        """Record a new tensor value. ``like``: the record of the version this one replaced,
        when the call cannot have changed shape, strides, dtype or device (foreach in-place
        ops): its metadata is reused instead of read again (an optimizer step makes ~10 new
        versions of every parameter and state tensor). ``uninitialized``: memory nobody wrote
        (``torch.empty_like``): recorded, never hashed."""
        tensors = self.trace.tensors
        if name in tensors:  # never overwrite: disambiguate deterministically
            k = 1
            while f"{name}#{k}" in tensors:
                k += 1
            name = f"{name}#{k}"
        if like is not None:
            try:
                ver = t._version
            except RuntimeError:  # inference tensors have no version counter
                ver = 0
            rec = TensorRecord(name, like.shape, like.dtype, like.device, role, producer, like.stride,
                               like.contiguous, like.requires_grad, ver, self._tensor_seq, None, None, None,
                               None, previous)
            return self._add_record(rec, t, ver)
        try:
            stride: tuple[int, ...] | None = t.stride()
            contiguous = t.is_contiguous()
        except RuntimeError:  # sparse and other layouts have no strides
            stride, contiguous = None, False
        # Shapes and strides repeat across a step: one tuple per distinct value, not two fresh
        # tuples per record (memory, and fewer objects for the garbage collector to visit).
        interned = self._interned
        size = t.shape
        try:
            shape = interned.get(size)
            if shape is None:
                shape = tuple(size)
                interned[shape] = shape
            if stride is not None:
                stride = interned.setdefault(stride, stride)
        except TypeError:  # symbolic sizes are not hashable: keep this record's own tuples
            shape = tuple(size)
        if stride is not None and type(stride) is not tuple:
            stride = tuple(stride)
        try:
            ver = t._version
        except RuntimeError:  # inference tensors have no version counter
            ver = 0
        dtype = _DTYPE_NAMES.get(t.dtype) or _dtype_name(t.dtype)
        device = _DEVICE_NAMES.get(t.device) or _device_name(t.device)
        # Positional (the field order of TensorRecord): keyword binding cost as much as the rest.
        rec = TensorRecord(name, shape, dtype, device, role, producer, stride, contiguous, t.requires_grad, ver,
                           self._tensor_seq, None, None, None, None, previous)
        if uninitialized:
            rec.uninitialized = True
            rec.hash_note = f"not hashed: uninitialised memory (made by {producer}); its first write is a new version"
        return self._add_record(rec, t, ver)

    def _add_record(self, rec: TensorRecord, t: torch.Tensor, ver: int) -> str:
        name = rec.name
        self._tensor_seq += 1
        self.trace.tensors[name] = rec
        self._tensor_names[t] = (name, ver)
        if rec.uninitialized:
            return name
        hasher = self.hasher
        # With nothing to hash or summarise, skip the call; a stand-in hasher (an async
        # collective's outputs get a note instead of a checksum) is always called.
        if hasher is not self._own_hasher or getattr(hasher, "active", True):
            hasher.submit(rec, t)
        return name

    def name_of(self, t: torch.Tensor) -> str:
        """The current name of a tensor, registering it (and hashing it) on first sight."""
        return self._name_at(t, _version(t))

    def _name_at(self, t: torch.Tensor, version: int) -> str:
        """``name_of`` for a tensor whose current version the caller has just read."""
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
            name = self._new_tensor(t, named[0], named[1], None)
            self._index_alias(t)
            return name
        if self._running:
            name = self._name_leaf_grad(t, version)
            if name is not None:
                return name
        if self._aliases:
            name = self._alias_name(t, version)
            if name is not None:
                return name
        self._inputs += 1
        name = self._new_tensor(t, f"input{self._inputs - 1}", "input", None)
        self._index_alias(t)
        return name

    # ---- aliases: tensors that share a named tensor's storage -----------------------------------
    # ``p.data``, ``p.detach()`` and views share p's bytes; ``.data`` does not even share its
    # version counter. Tensors from outside the block (parameters, buffers, optimizer state,
    # inputs, leaves' gradients) are indexed by storage, so that a write through an alias makes a
    # new version of the tensor it aliases. Outputs of calls are not indexed (thousands per step);
    # a write into one through a view still shows as a new version of its base.
    def _index_alias(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key:
            self._aliases.setdefault(key, []).append(weakref.ref(t))

    def _alias_name(self, t: torch.Tensor, version: int) -> str | None:
        """The name of an indexed tensor that ``t`` is the same view of (``p.data``), if any."""
        key = _storage_key(t)
        for ref in self._aliases.get(key, ()) if key else ():
            o = ref()
            if o is not None and o is not t and _same_view(o, t) and _storage_key(o) == key:
                hit = self._tensor_names.get(o)
                if hit is None:
                    continue
                name = self._name_at(o, _version(o))  # a new version first, if o changed unseen
                self._tensor_names[t] = (name, version)
                self._aliases[key].append(weakref.ref(t))
                return name
        return None

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
            key = _storage_key(t) if self._aliases else 0
            if key:  # (an entry whose storage has changed since, by set_ or resize, is not an alias)
                others += [o for o in (r() for r in self._aliases.get(key, ()))
                           if o is not None and _storage_key(o) == key]
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
                if _same_view(o, t):  # the same bytes seen through another tensor object
                    self._tensor_names[o] = (new, _version(o))
                else:
                    old = self.trace.tensors.get(hit[0])
                    role = old.role if old is not None else "input"
                    self._new_tensor(o, self._bump(self._base_name(hit[0])), role, call, previous=hit[0])

    @staticmethod
    def _base_name(name: str) -> str:
        return names.base_name(name)

    def _bump(self, base: str) -> str:
        n = self._versions.get(base, 0) + 1
        self._versions[base] = n
        return names.version_name(base, n)

    # ---- forward calls ------------------------------------------------------------------------
    def record_call(self, func: Any, api: str, short: str, kind: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any], writes: Writes | None = None) -> Any:
        ins = _call_tensors(args, kwargs)
        vers = _versions_of(ins)
        # Lists of exactly the right length (not grown by appends): they are kept in the Call.
        in_names = [""] * len(ins)
        with self.lock:
            known = self._tensor_names.get
            for i, t in enumerate(ins):
                hit = known(t)  # _name_at's usual outcome inlined: a tensor named before, unchanged
                in_names[i] = hit[0] if hit is not None and hit[1] == vers[i] else self._name_at(t, vers[i])
            seq = self._call_seq
            self._call_seq += 1
        tokens = [li.before_call() for li in self.listeners] if self.listeners else None
        seq0 = _get_seq() if _get_seq is not None else None
        if self.hasher.active and (writes is not None or kind != "op" or "out" in kwargs
                                   or kwargs.get("inplace") is True):
            self.hasher.before_write()  # tensors waiting for a checksum are read before a write
        self.op_depth += 1
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            self._record_failed(api, short, kind, args, kwargs, in_names, seq, exc)
            raise
        finally:
            self.op_depth -= 1
        outs = _unique(flat_tensors(out))
        mutated: list[torch.Tensor] = []
        if ins:
            now = _versions_of(ins)
            written = writes.tensors(args, kwargs) if writes is not None else None
            if written:  # what the op's schema says it writes, whatever the version counters say
                ids = {identity(t) for t in written}
                mutated = [t for t, v, n in zip(ins, vers, now) if n != v or identity(t) in ids]
            elif now != vers:  # one comparison in C for the usual call that changes nothing
                mutated = [t for t, v, n in zip(ins, vers, now) if n != v]
        if not outs and not mutated:
            return out  # metadata queries and conversions: noise, not a call
        # The stack starts at the caller of the mode's handler: capture <- _finish_call <-
        # record_call <- _Mode.__torch_function__ <- the caller.
        self._finish_call(api, short, kind, args, kwargs, ins, in_names, outs, mutated, seq, seq0, tokens=tokens,
                          skip=4)
        return out

    def _finish_call(self, api: str, short: str, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                     ins: list[torch.Tensor], in_names: list[str], outs: list[torch.Tensor],
                     mutated: list[torch.Tensor], seq: int, seq0: int | None,
                     name: str | None = None, tokens: list[Any] | None = None,
                     stack_id: int | None = _CAPTURE_NOW, skip: int = 2) -> Call:
        """Record a finished call. ``skip``: where the stack capture starts, counted outwards from
        the capture's own frame (0); every frame it jumps must be the recorder's. Jumped frames
        are not read, and under an audit hook each read frame costs one (see tracer.record.identity)."""
        if mutated:
            # By identity through a set: an in-place foreach op returns the ~150 tensors it also
            # mutated, and a pairwise test was quadratic in them.
            out_ids = {identity(o) for o in outs}
            produced = outs + [t for t in mutated if identity(t) not in out_ids]
        else:
            produced = outs
        # Read grad_fn inside the bracket: an in-place change through a view regenerates the
        # base's grad_fn lazily (CopySlices), and it must land on this call.
        try:
            grad_fns = [t.grad_fn for t in produced]
        except RuntimeError:  # a view made under no_grad whose base changed in place refuses it
            grad_fns = [_grad_fn(t) for t in produced]
        seq1 = _get_seq() if _get_seq is not None else None
        with self.lock, torch._C.DisableTorchFunction():
            if stack_id == _CAPTURE_NOW:
                stack_id = self.stack_table.capture(skip) if self.stack_table is not None else None
            if name is None:
                name = self.counters.next(short)
            in_pos = {identity(t): i for i, t in enumerate(ins)} if ins else None
            names_of: dict[int, str] = {}
            # Lists of exactly the right length, filled in place (they are kept in the Call).
            mutated_names = [""] * len(mutated)
            if mutated:
                assert in_pos is not None
                tensors = self.trace.tensors
                versions = self._versions
                # Foreach ops and optimizer steps never resize, restride or retype a tensor.
                same_meta = kind == "optimizer" or api.startswith("torch._foreach_")
                for j, t in enumerate(mutated):  # an optimizer's foreach op changes ~150 at once
                    old = in_names[in_pos[identity(t)]]
                    old_rec = tensors.get(old)
                    role = old_rec.role if old_rec is not None and old_rec.role in ("param", "buffer", "state") \
                        else "output"
                    head, sep, tail = old.rpartition("@v")  # names.base_name(old), inlined
                    base = head if sep and tail.isdigit() else old
                    n = versions.get(base, 0) + 1
                    versions[base] = n
                    new = self._new_tensor(t, names.version_name(base, n), role, name, previous=old,
                                           like=old_rec if same_meta else None)
                    names_of[identity(t)] = new
                    mutated_names[j] = new
                self._write_through_aliases(mutated, names_of, name, ins)
            uninit = short in UNINITIALISED
            n_outs = len(outs)
            out_names = [""] * n_outs
            tensor_names = self._tensor_names
            for i, t in enumerate(outs):
                key = identity(t)
                known = names_of.get(key)
                if known is None and in_pos is not None and key in in_pos:
                    known = in_names[in_pos[key]]  # returned an input unchanged (x.to(x.dtype))
                if known is None and kind != "function":
                    # A custom Function's outputs are the very tensors its forward's inner ops
                    # made, but as the Function's outputs they carry its grad node: they are
                    # named by the Function (MyFn0:out), not by the op inside it.
                    hit = tensor_names.get(t)
                    if hit is not None and hit[1] == _version(t):
                        known = hit[0]
                if known is None:
                    known = self._new_tensor(t, names.output_name(name, i, n_outs), "output", name,
                                             uninitialized=uninit)
                names_of[key] = known
                out_names[i] = known
            if len(produced) > n_outs:
                # What it wrote without returning it (foreach in-place ops, GradScaler's unscale
                # return nothing) is among its outputs too.
                out_names += [names_of[identity(t)] for t in produced[n_outs:]]
            node_names: list[str] = []
            local_kinds: dict[str, int] | None = None
            for t, gf in zip(produced, grad_fns):
                if gf is None:
                    continue
                if local_kinds is None:
                    local_kinds = {}
                    self._saved_hooks = _saved_tensor_hooks_active()
                root = self._collect_nodes(gf, seq0, seq1, name, stack_id, node_names, local_kinds)
                if root is not None:
                    self._slot_tensor[(root, t.output_nr)] = names_of[identity(t)]
            running = self._running
            parent = self._parents[-1] if self._parents else (running[-1] if running else None)
            if self._module_stack:
                module = self._module_stack[-1]
            else:  # in backward: the module of the running node's forward call
                module = self._node_modules.get(running[-1], "") if running else ""
            # Positional, in Call's field order: this runs for every recorded call.
            call = Call(name, api, module, in_names, out_names, naming.short_args(args, kwargs), node_names,
                        stack_id, parent, kind, "backward" if self._in_backward else "forward", seq, mutated_names)
            self.trace.calls.append(call)
            if running and parent == running[-1]:  # made by a grad node's own code
                step = self._open_steps.get(parent)
                if step is not None:
                    step.calls.append(name)
            if self.listeners:
                for li, tok in zip(self.listeners, tokens or [None] * len(self.listeners)):
                    li.on_call(self.trace, call, tok, produced)
            if self.max_calls is not None and len(self.trace.calls) >= self.max_calls:
                self.stop(f"recording stopped at max_calls={self.max_calls}: later calls, grad nodes "
                          "and backward runs were not recorded")
        if self.on_records is not None:
            self.on_records()
        return call

    # ---- the public recording API (features record their own calls through it) ---------------
    def begin_call(self, ins: list[torch.Tensor], *, api: str, short: str, kind: str,
                   name: str | None = None) -> PendingCall:
        """Name a call's inputs and take its place in the trace, before it runs."""
        with self.lock, torch._C.DisableTorchFunction():
            in_names = [self.name_of(t) for t in ins]
            seq = self._call_seq
            self._call_seq += 1
        tokens = [li.before_call() for li in self.listeners] if self.listeners else None
        return PendingCall(api, short, kind, ins, in_names, seq, _get_seq() if _get_seq is not None else None,
                           tokens, name)

    def finish_call(self, pending: PendingCall, outs: list[torch.Tensor], mutated: Sequence[torch.Tensor] = (),
                    *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Call:
        """Record a call begun with ``begin_call`` that returned ``outs`` and wrote ``mutated``."""
        p = pending
        with torch._C.DisableTorchFunction():
            return self._finish_call(p.api, p.short, p.kind, args, kwargs or {}, p.ins, p.in_names, outs,
                                     list(mutated), p.seq, p.seq0, name=p.name, tokens=p.tokens,
                                     stack_id=p.stack_id, skip=3)

    def fail_call(self, pending: PendingCall, exc: BaseException, *, args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None) -> None:
        """Record a call begun with ``begin_call`` that raised ``exc`` (it has no outputs)."""
        p = pending
        if p.name is not None:
            self._record_failed_named(p.name, p.api, args, kwargs or {}, p.in_names, p.seq, exc)
        else:
            self._record_failed(p.api, p.short, p.kind, args, kwargs or {}, p.in_names, p.seq, exc)

    def add_call(self, call: Call, produced: Sequence[torch.Tensor] = ()) -> Call:
        """Add a call whose records the caller made itself (``next_call_seq``, ``call_name``,
        ``new_version``...): listeners hear it, bounds count it."""
        with self.lock:
            self.trace.calls.append(call)
            for li in self.listeners:
                li.on_call(self.trace, call, None, list(produced))
            if self.max_calls is not None and len(self.trace.calls) >= self.max_calls:
                self.stop(f"recording stopped at max_calls={self.max_calls}: later calls, grad nodes "
                          "and backward runs were not recorded")
        if self.on_records is not None:
            self.on_records()
        return call

    @contextlib.contextmanager
    def unhashed(self, note: str) -> Iterator[None]:
        """Tensors recorded inside get ``note`` instead of a checksum (their data are not there)."""
        saved = self.hasher
        self.hasher = _Unhashed(saved, note)  # type: ignore[assignment]
        try:
            yield
        finally:
            self.hasher = saved

    def next_call_seq(self) -> int:
        """The place in the trace of a call about to start."""
        with self.lock:
            seq = self._call_seq
            self._call_seq += 1
            return seq

    def call_name(self, short: str) -> str:
        """The next name for a call of ``short`` (``all_reduce0``, ``all_reduce1``...)."""
        return self.counters.next(short)

    def capture_stack(self) -> int | None:
        """The interned id of the caller's stack (None when stacks are off)."""
        return self.stack_table.capture(2) if self.stack_table is not None else None

    def current_name(self, t: torch.Tensor) -> str | None:
        """The name ``t`` has in the trace if its value has not changed since, else None."""
        hit = self._tensor_names.get(t)
        return hit[0] if hit is not None and hit[1] == _version(t) else None

    def known_name(self, t: torch.Tensor) -> str | None:
        """The last name ``t`` had in the trace, whatever happened to it since (None: never seen)."""
        hit = self._tensor_names.get(t)
        return None if hit is None else hit[0]

    def param_name(self, t: torch.Tensor) -> str | None:
        """The module path of a parameter or buffer the trace has seen."""
        named = self._named.get(t)
        return None if named is None else named[0]

    def new_version(self, t: torch.Tensor, of: str, role: str, producer: str | None) -> str:
        """Record ``t`` as the next version of ``of`` (changed in place by ``producer``)."""
        with self.lock:
            return self._new_tensor(t, self._bump(self._base_name(of)), role, producer, previous=of)

    def leaf_grad(self, t: torch.Tensor, param: str, producer: str | None, previous: str | None) -> str:
        """Record ``t`` as a value of leaf ``param``'s gradient: ``param@grad``, or its next
        version when that name is taken."""
        base = f"{param}@grad"
        with self.lock:
            return self._new_leaf_grad(t, self._bump(base) if base in self.trace.tensors else base, producer,
                                       previous)

    def module_path(self, module: torch.nn.Module) -> str | None:
        """The path the trace named ``module`` by (None: not seen)."""
        return self._module_paths.get(module)

    @property
    def run_index(self) -> int:
        """The index of the backward run in progress or last run (0 before any)."""
        return max(self._run_index, 0)

    def _record_failed(self, api: str, short: str, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                       in_names: list[str], seq: int, exc: BaseException) -> None:
        with self.lock, torch._C.DisableTorchFunction():
            stack_id = self.stack_table.capture() if self.stack_table is not None else None
            call = Call(name=self.counters.next(short), api=api,
                        module=self._module_stack[-1] if self._module_stack else "", inputs=in_names,
                        outputs=[], args=naming.short_args(args, kwargs), stack_id=stack_id,
                        parent=self._parents[-1] if self._parents else None, kind=kind,
                        phase="backward" if self._in_backward else "forward", seq=seq,
                        error=f"{type(exc).__name__}: {exc}")
            self.trace.calls.append(call)

    # ---- grad nodes ---------------------------------------------------------------------------
    def _node_key(self, node: Any) -> tuple[int, str]:
        return (node._sequence_nr(), type(node).__name__)

    def _collect_nodes(self, root: Any, seq0: int | None, seq1: int | None, call: str, stack_id: int | None,
                       out: list[str], local_kinds: dict[str, int]) -> str | None:
        """Name the nodes this call created, reachable from ``root``; returns root's name."""
        node_by_seq = self._node_by_seq
        bracket = seq0 is not None and seq1 is not None
        kind = type(root).__name__
        if kind == _ACCUMULATE:
            return self._accumulator(root)
        sn = root._sequence_nr()
        key = (sn, kind)
        # The cheap bracket test first: an output can carry an earlier call's node.
        if (bracket and not (seq0 <= sn < seq1)) or key in node_by_seq:  # type: ignore[operator]
            return node_by_seq.get(key)
        nexts = root.next_functions
        new: list[tuple[int, str, Any, Any]] = [(sn, kind, root, nexts)]
        todo = [nxt for nxt, _ in nexts if nxt is not None]
        # Nodes are told apart by (sequence number, class), as everywhere in the recorder; a
        # node reached twice is skipped the second time, whether new or not.
        new_keys: set[tuple[int, str]] = {key}
        while todo:
            node = todo.pop()
            kind = type(node).__name__
            if kind == _ACCUMULATE:
                continue
            sn = node._sequence_nr()
            if bracket and not (seq0 <= sn < seq1):  # type: ignore[operator]
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
            new.sort(key=_first)
        names: list[str] = []
        for sn, kind, node, _ in new:
            k = local_kinds.get(kind, 0)
            local_kinds[kind] = k + 1
            nname = f"{call}/{kind}" if k == 0 else f"{call}/{kind}#{k}"
            self._register_node(node, nname, kind, call, None, stack_id, external=False, key=(sn, kind))
            names.append(nname)
        out.extend(names)
        for (_, _, node, nexts), nname in zip(new, names):
            self._link_edges(node, nname, nexts)
        return node_by_seq.get((root._sequence_nr(), type(root).__name__))

    def _node_name(self, node: Any) -> str | None:
        kind = type(node).__name__
        if kind == _ACCUMULATE:
            tag = node.metadata.get(_NODE_TAG)
            return tag[1] if tag is not None and tag[0] == self.trace_id else None
        return self._node_by_seq.get((node._sequence_nr(), kind))

    def _accumulator(self, node: Any) -> str:
        """The name of a leaf's accumulator node, hooking every accumulator object the first time
        it is seen. Autograd makes a new ``AccumulateGrad`` for a parameter whenever the last graph
        holding the old one dies (gradient accumulation, a discarded forward): each new object is
        the same accumulator for the trace (one name, one record) but needs its own hooks."""
        md = node.metadata
        tag = md.get(_NODE_TAG)
        if tag is not None and tag[0] == self.trace_id:
            return tag[1]  # type: ignore[no-any-return]
        var = node.variable
        name = self._acc_by_var.get(var)
        if name is None:
            tname = self._base_name(self.name_of(var))
            name = f"{tname}/AccumulateGrad"
            self._acc_by_var[var] = name
            self._acc_vars[name] = weakref.ref(var)
            self._slot_tensor[(name, 0)] = tname
            self._register_node(node, name, _ACCUMULATE, None, tname, None, external=False)
        else:
            self._hook_node(node, name, _ACCUMULATE, external=False)
        md[_NODE_TAG] = (self.trace_id, name)
        return name

    def _register_node(self, node: Any, name: str, kind: str, call: str | None, param: str | None,
                       stack_id: int | None, external: bool, key: tuple[int, str] | None = None) -> None:
        if kind != _ACCUMULATE:  # accumulators are known by their leaf (see _accumulator)
            self._node_by_seq[key if key is not None else self._node_key(node)] = name
        self._add_node_record(name, kind, call, param, stack_id, external)
        self._hook_node(node, name, kind, external)
        if self.listeners and self._listens("on_grad_node"):
            for li in self.listeners:
                li.on_grad_node(self.trace, name, node)

    def _add_node_record(self, name: str, kind: str, call: str | None, param: str | None,
                         stack_id: int | None, external: bool) -> None:
        rec = GradNode(name, kind, call, param, [], stack_id, self._node_seq, external)
        self._node_seq += 1
        self.trace.grad_nodes.append(rec)
        self._node_recs[name] = rec

    def _hook_node(self, node: Any, name: str, kind: str, external: bool) -> None:
        # Hook handles are not kept: the hooks go with their node (the backward frees it), and
        # one that outlives the trace (a graph kept alive past the block) finds the recorder
        # closed and returns at once. Keeping and removing them cost a Python call per hook.
        user_code = _runs_user_code(node, kind)
        if user_code and self._module_stack:
            self._node_modules[name] = self._module_stack[-1]
        # Accumulators always get both: the pre-hook notes the leaf's .grad before it runs, the
        # hook names what it became (the gradient itself, or a new version accumulated into it).
        if user_code or external or kind == _ACCUMULATE or self._saved_hooks \
                or (self.listeners and self._begin_listeners()):
            # Something needs the node's start: its own Python code (custom backward, post-
            # accumulate hooks) or a saved-tensor unpack hook records calls whose parent is the
            # running node, and listeners such as the memory one attribute work to it. One
            # callable serves as pre-hook and hook (told apart by their arguments).
            hook = functools.partial(_node_hook, self._self_ref, name)
            node.register_prehook(hook)
            node.register_hook(hook)
            if user_code and self.hasher.active:
                self._flush_before.add(name)
        else:
            # A built-in node runs no Python: its hook alone sees what it received and made
            # (one hook per node instead of two: half the registrations and engine callbacks).
            node.register_hook(functools.partial(_node_done_hook, self._self_ref, name))

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
                kind = type(nxt).__name__
                if kind == _ACCUMULATE:
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
        kind = type(node).__name__
        if kind == _ACCUMULATE:
            return self._accumulator(node)
        # Created before the traced block (or by code the trace could not see).
        name = self.counters.next(f"external/{kind}")
        self._register_node(node, name, kind, None, None, None, external=True)
        self._link_edges(node)
        return name

    # ---- backward -----------------------------------------------------------------------------
    def record_backward(self, func: Any, api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One backward run, from ``Tensor.backward``, ``autograd.backward`` or ``autograd.grad``.
        A run started inside another one (``autograd.grad`` in a custom Function's backward) is
        recorded as a run of its own; the outer run's state is put back when it ends."""
        outer = (self._run, self._run_index, self._indegree, self._create_graph, self._bwd_seq0)
        with self.lock, torch._C.DisableTorchFunction():
            first = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
            roots = [self.name_of(t) for t in _unique(flat_tensors(first))]
            stack_id = self.stack_table.capture() if self.stack_table is not None else None
            run = BackwardRun(name=self.counters.next("grad" if api.endswith(".grad") else "backward"),
                              api=api, roots=roots, stack_id=stack_id, seq=len(self.trace.backward_runs))
            self._run_index = run.seq  # gradients of the k-th run are named ...#k
            self._run = run
            self.trace.backward_runs.append(run)
            self._indegree = self._indegree_from(_unique(flat_tensors(first)))
            self._create_graph = _creates_graph(api, args, kwargs)
            if self._create_graph and _get_seq is not None:
                self._bwd_seq0 = (threading.get_ident(), _get_seq())
        for li in self.listeners:
            li.on_backward_begin(self.trace, run)
        # Waiting checksums are read before the backward: gradient accumulation and custom
        # backward code may write into tensors already recorded.
        self.hasher.before_write()
        self._in_backward += 1
        error: BaseException | None = None
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            run.status = "failed"
            run.error = f"{type(exc).__name__}: {exc}"
            error = exc
            # The outermost run explains the error once, with every level still running (a
            # nested run leaves its running nodes in place for it).
            if isinstance(exc, Exception) and outer[0] is None:
                running = list(self._running)
                try:  # a node with no pre-hook does not show in _running: find it from the graph
                    with torch._C.DisableTorchFunction():
                        failing = self._infer_failing_node(_unique(flat_tensors(first)))
                except Exception:  # never let the explanation hide the user's error
                    failing = None
                if failing is not None and failing not in running:
                    running.append(failing)
                self._explain(exc, run, running)
            raise
        finally:
            for li in self.listeners:
                li.on_backward_end(self.trace, run, error)
            self._in_backward -= 1
            self._run, self._run_index, self._indegree, self._create_graph, self._bwd_seq0 = outer
            if self._run is None:
                self._running.clear()
                self._open_steps.clear()
        if api.endswith(".grad"):
            with self.lock, torch._C.DisableTorchFunction():
                results = flat_tensors(out)
                run.outputs = [self._new_tensor(t, names.output_name(run.name, i, len(results)), "grad", run.name)
                               for i, t in enumerate(results)]
        if self.on_records is not None:
            self.on_records()
        return out

    def _indegree_all(self) -> dict[tuple[str, int], int]:
        indegree: dict[tuple[str, int], int] = {}
        for edges in self._edges.values():
            for dest, k in edges:
                if dest is not None:
                    indegree[(dest, k)] = indegree.get((dest, k), 0) + 1
        return indegree

    def _indegree_from(self, roots: list[torch.Tensor]) -> dict[tuple[str, int], int]:
        """Edges into each (node, slot) of the recorded graph reachable from ``roots``. Counted per
        backward run: with gradient accumulation each micro-batch's graph has its own edges into
        the same accumulators, and each run's gradient of a parameter is that parameter's."""
        todo = [n for n in (self._node_name(gf) for gf in map(_grad_fn, roots) if gf is not None) if n is not None]
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

    def _explain(self, exc: Exception, run: BackwardRun, running: list[str]) -> None:
        from tracer.analysis.explain import add_note, explain_backward_error

        try:
            with self.lock, torch._C.DisableTorchFunction():
                table = self.stack_table
                note = explain_backward_error(self.trace, run, running, exc,
                                              table.frames_of if table is not None else lambda _sid: ())
        except Exception as inner:  # never let the explanation hide the user's error
            note = f"gradtrace: could not explain this error ({type(inner).__name__}: {inner})"
        add_note(exc, note)
        run.error = f"{run.error}\n{note}"

    def _slot_grad(self, node: str, slot: int) -> str | None:
        """``<tensor>@grad`` for the gradient into ``node``'s input ``slot`` when that slot is a
        named tensor's (the suffix says which backward run), else None."""
        base = self._slot_tensor.get((node, slot))
        return None if base is None else f"{base}{names.grad_suffix(max(self._run_index, 0))}"

    def _in_run(self, name: str) -> str:
        """A gradient's own name, with ``#k`` in the k-th backward run (k >= 1)."""
        return name if self._run_index <= 0 else f"{name}#{self._run_index}"

    def _begin_listeners(self) -> bool:
        """Whether an attached listener acts on a node's start (``on_node_begin``)."""
        return self._listens("on_node_begin")

    def _listens(self, event: str) -> bool:
        """Whether an attached listener overrides ``event``."""
        base = getattr(Listener, event)
        return any(getattr(type(li), event) is not base for li in self.listeners)

    def _current_run(self) -> BackwardRun:
        if self._run is None:  # backward started where the trace could not see it
            self._indegree = self._indegree_all()
            self._run_index = len(self.trace.backward_runs)
            self._run = BackwardRun(name=self.counters.next("backward"), api="(engine)", roots=[],
                                    seq=len(self.trace.backward_runs))
            self.trace.backward_runs.append(self._run)
        return self._run

    def _grad_names(self, node: str, grads: tuple[Any, ...], produced: bool,
                    own_calls: list[str] | None = None) -> list[str | None]:
        """Names of the gradients a node received (``grad_outputs``) or, with ``produced``, made
        (``grad_inputs``), recording the new ones. A gradient already named (passed through
        unchanged) keeps its name; a new name is only formatted for a new tensor."""
        edges = self._edges.get(node, ()) if produced else ()
        names: list[str | None] = []
        tensor_names = self._tensor_names
        for i, g in enumerate(grads):
            if not isinstance(g, torch.Tensor):
                names.append(None)
                continue
            hit = tensor_names.get(g)
            if hit is not None and hit[1] == _version(g) and not (own_calls and self._made_by(hit[0], own_calls)):
                names.append(hit[0])
            elif produced:
                # A gradient the node's own code made (a custom backward: named by the op that
                # made it) is also recorded under its gradient name, so <param>@grad exists.
                dest, k = edges[i] if i < len(edges) else (None, 0)
                # The gradient of a tensor when it alone flows into that slot; else this edge's
                # own partial gradient.
                gname = self._slot_grad(dest, k) if dest is not None and self._indegree.get((dest, k), 0) == 1 \
                    else None
                if hit is not None and gname is None:
                    names.append(hit[0])
                    continue
                names.append(self._new_tensor(g, gname or self._in_run(f"{node}:grad{i}"), "grad", node))
            else:
                gname = self._slot_grad(node, i) or self._in_run(f"{node}:gin{i}")
                names.append(self._new_tensor(g, gname, "grad", None))
        return names

    def _made_by(self, tensor: str, calls: list[str]) -> bool:
        rec = self.trace.tensors.get(tensor)
        return rec is not None and rec.producer in calls

    def node_begin(self, node: str, grad_outputs: tuple[Any, ...]) -> None:
        if self.stopped:
            return
        if node in self._flush_before:  # user code next, which may write into recorded tensors
            self.hasher.before_write()
        with self.lock, torch._C.DisableTorchFunction():
            run = self._current_run()
            step = NodeRun(node, self._grad_names(node, grad_outputs, False), [])
            run.steps.append(step)
            self._open_steps[node] = step
            self._running.append(node)
            if node in self._acc_vars:
                self._name_leaf_incoming(node, step, grad_outputs)
                self._note_grad_before(node)
            for li in self.listeners:
                li.on_node_begin(self.trace, node, step, grad_outputs)

    def node_end(self, node: str, grad_inputs: tuple[Any, ...]) -> None:
        if self.stopped:
            return
        with self.lock, torch._C.DisableTorchFunction():
            step = self._open_steps.pop(node, None)
            names = self._grad_names(node, grad_inputs, True, step.calls if step is not None else None)
            if self._create_graph:
                self._adopt_nodes(node, grad_inputs)
            if node in self._acc_vars:
                self._name_accumulated(node, step)
            if step is not None:
                step.grads_out = names
                # Listeners run while the node still counts as running: one that raises (the
                # raise_on_nonfinite guard) leaves it on the stack the error explanation reads.
                for li in self.listeners:
                    li.on_node_end(self.trace, node, step, grad_inputs)
            if self._running and self._running[-1] == node:
                self._running.pop()
            elif node in self._running:
                self._running.remove(node)

    # ---- a leaf's .grad -------------------------------------------------------------------------
    # The gradient a backward run brings to a leaf ``p`` is ``p@grad`` (``p@grad#k`` in the k-th
    # run). When the leaf had no .grad, that gradient becomes its .grad (the very tensor, or a copy
    # of the same bytes), so .grad carries that name. When .grad existed, the run adds into it:
    # in place, a new version ``<.grad's name>@v<n>``; out of place (create_graph), likewise a new
    # version of ``p@grad``. A .grad from before the block, first seen here, is ``p@grad@v0``.
    def _grad_of_leaf(self, acc: str) -> torch.Tensor | None:
        ref = self._acc_vars.get(acc)
        var = ref() if ref is not None else None
        return None if var is None else var.grad

    def _name_leaf_incoming(self, acc: str, step: NodeRun, grads: tuple[Any, ...]) -> None:
        """The gradient reaching a leaf's accumulator is that leaf's gradient, ``p@grad``, even when
        the same tensor already has another name (passed through unchanged: ``(a + b)`` hands one
        tensor to both accumulators): it is then recorded under that name too."""
        slot = self._slot_grad(acc, 0)
        g = grads[0] if grads else None
        if slot is None or not isinstance(g, torch.Tensor) or not step.grads_in or step.grads_in[0] == slot:
            return
        if slot in self.trace.tensors:  # already recorded in this run (cannot happen twice): keep it
            return
        step.grads_in[0] = self._new_tensor(g, slot, "grad", None)

    def _note_grad_before(self, acc: str) -> None:
        """Pre-hook of an accumulator: the name of its leaf's .grad before the run adds to it."""
        g = self._grad_of_leaf(acc)
        if g is None:
            self._grad_before[acc] = None
            return
        hit = self._tensor_names.get(g)
        if hit is not None and hit[1] == _version(g):
            self._grad_before[acc] = hit[0]
        elif hit is not None:  # changed where the trace could not see it
            self._grad_before[acc] = self._name_at(g, _version(g))
        else:
            base = f"{self._slot_tensor[(acc, 0)]}@grad"
            self._grad_before[acc] = self._new_leaf_grad(g, names.version_name(base, 0), None, None)

    def _new_leaf_grad(self, g: torch.Tensor, name: str, producer: str | None, previous: str | None) -> str:
        name = self._new_tensor(g, name, "grad", producer, previous=previous)
        self._index_alias(g)
        return name

    def _name_accumulated(self, acc: str, step: NodeRun | None) -> None:
        """Hook of an accumulator (it has run): give its leaf's .grad its name."""
        before = self._grad_before.pop(acc, None)
        g = self._grad_of_leaf(acc)
        if g is None:
            return
        ver = _version(g)
        hit = self._tensor_names.get(g)
        if hit is not None:
            if hit[1] != ver:  # accumulated in place
                base = self._base_name(hit[0])
                self._new_leaf_grad(g, self._bump(base), acc, hit[0])
            return  # else: the incoming gradient itself, already named
        incoming = step.grads_in[0] if step is not None and step.grads_in else None
        if before is None and incoming is not None:
            # A copy of the incoming gradient (it was still referenced, so not stolen): the same
            # bytes under the same name.
            self._tensor_names[g] = (incoming, ver)
            self._index_alias(g)
            return
        base = f"{self._slot_tensor[(acc, 0)]}@grad"  # added out of place into the old .grad
        self._new_leaf_grad(g, self._bump(base) if base in self.trace.tensors else base, acc, before)

    def _name_leaf_grad(self, t: torch.Tensor, version: int) -> str | None:
        """A tensor seen for the first time while an accumulator runs (a post-accumulate-grad hook
        reading .grad): the .grad the accumulator has just made, named as its hook would."""
        acc = self._running[-1]
        if acc not in self._acc_vars or self._grad_of_leaf(acc) is not t:
            return None
        self._name_accumulated(acc, self._open_steps.get(acc))
        hit = self._tensor_names.get(t)
        # What the accumulator's own hook will find: .grad named, unchanged since.
        self._grad_before[acc] = None if hit is None else hit[0]
        return None if hit is None else hit[0]

    def node_done(self, node: str, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        """A node with no pre-hook ran: what it received and what it produced, in one event."""
        if self.stopped:
            return
        with self.lock, torch._C.DisableTorchFunction():
            run = self._current_run()
            step = NodeRun(node, self._grad_names(node, grad_outputs, False), [])
            run.steps.append(step)
            step.grads_out = self._grad_names(node, grad_inputs, True)
            if self._create_graph:
                self._adopt_nodes(node, grad_inputs)
            if self.listeners:  # attached after this node was made: both events, back to back
                self._running.append(node)
                for li in self.listeners:
                    li.on_node_begin(self.trace, node, step, grad_outputs)
                for li in self.listeners:
                    li.on_node_end(self.trace, node, step, grad_inputs)
                self._running.pop()

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
        seq1 = _get_seq() if _get_seq is not None and seq0 is not None else None
        names: list[str] = []
        local_kinds: dict[str, int] = {}
        for g in grads:
            gf = _grad_fn(g) if isinstance(g, torch.Tensor) else None
            if gf is None or type(gf).__name__ == _ACCUMULATE or self._node_name(gf) is not None:
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
        todo = [n for n in (self._node_name(gf) for gf in map(_grad_fn, roots) if gf is not None) if n is not None]
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

    # ---- modules ------------------------------------------------------------------------------
    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self.owner or self._in_backward or self.closed:
            return
        path = self._module_paths.get(module)
        if path is None:
            path = self._register_module(module)
        self._module_stack.append(path)
        table = self.stack_table
        if table is not None:
            # The frame that called this hook runs the module's forward and stays on the stack
            # until the post-hook: stack captures inside the module stop walking there.
            frame = sys._getframe(1)
            table.open_scope(frame)
            self._scope_frames.append(frame)
        else:
            self._scope_frames.append(None)
        if type(module).__name__ == "OptimizedModule" and not self.paused:
            self._enter_opaque(module, args)

    def _pop_modules(self, start: int) -> None:
        """Leave the module calls from ``start`` on (module stack and stack-capture scopes)."""
        del self._module_stack[start:]
        frames = self._scope_frames
        if len(frames) > start:
            table = self.stack_table
            if table is not None:
                for f in frames[start:]:
                    table.close_scope(f)
            del frames[start:]

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self.owner or self._in_backward or self.closed:
            return
        path = self._module_paths.get(module)
        stack = self._module_stack
        if stack and stack[-1] == path:
            self._pop_modules(len(stack) - 1)
        elif path in stack:
            self._pop_modules(len(stack) - 1 - stack[::-1].index(path))

    def register_root_module(self, module: torch.nn.Module) -> None:
        """Name modules, parameters and buffers from ``module`` down, as if it were called first
        (a trainer's model, whose forward may never be called itself)."""
        if module not in self._module_paths:
            self._register_module(module)

    def _register_module(self, module: torch.nn.Module) -> str:
        cls = type(module).__name__
        if self._module_stack:  # a module not reachable from any root seen so far
            parent = self._module_stack[-1]
            path = f"{parent}.<{cls}>" if parent else f"<{cls}>"
            self._module_paths[module] = path
            self.trace.modules[path] = cls
            return path
        prefix = "" if "" not in self.trace.modules else cls
        k = 1
        while prefix in self.trace.modules and prefix:
            prefix = f"{cls}#{k}"
            k += 1
        # One walk over the modules names them, their parameters and their buffers, in the order
        # (and with the first-wins naming of shared ones) of named_parameters()/named_buffers();
        # three separate walks cost ~2 ms per trace on a GPT-2-sized model.
        named = self._named
        params: list[tuple[str, torch.Tensor]] = []
        buffers: list[tuple[str, torch.Tensor]] = []
        for sub_path, sub in module.named_modules():
            full = f"{prefix}.{sub_path}" if prefix and sub_path else prefix or sub_path
            if sub not in self._module_paths:
                self._module_paths[sub] = full
                self.trace.modules[full] = type(sub).__name__
            dot = f"{full}." if full else ""
            params += [(dot + k, v) for k, v in sub._parameters.items() if v is not None]
            buffers += [(dot + k, v) for k, v in sub._buffers.items() if v is not None]
        for pname, p in params:
            if p not in named:
                named[p] = (pname, "param")
        for bname, b in buffers:
            if b not in named:
                named[b] = (bname, "buffer")
        return self._module_paths[module]

    def _enter_opaque(self, module: torch.nn.Module, args: Any) -> None:
        # A compiled region runs with no trace machinery in its way: torch functions undisturbed
        # (a mode inside makes Dynamo graph-break and recompile) and our global module hooks
        # removed (Dynamo would inline them into the compiled frame). A one-shot hook on the
        # compiled module itself ends the region and puts everything back.
        with torch._C.DisableTorchFunction():
            ins = _unique(flat_tensors(args))
        pending = self.begin_call(ins, api="torch.compile", short="compiled", kind="compiled")
        self._remove_module_hooks()
        try:
            local = module.register_forward_hook(self._opaque_post, always_call=True)
        except TypeError:
            local = module.register_forward_hook(self._opaque_post)
        ctx = torch._C.DisableTorchFunction()
        ctx.__enter__()
        self.paused = True
        self._opaque.append((module, ctx, local, pending))
        note = "torch.compile regions are recorded as one opaque call each; the calls inside them were not seen"
        if note not in self.trace.notes:
            self.trace.notes.append(note)

    def _opaque_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._opaque or self._opaque[-1][0] is not module:
            return
        _module, ctx, local, pending = self._opaque.pop()
        ctx.__exit__(None, None, None)
        local.remove()
        self.paused = bool(self._opaque)
        if not self._opaque:
            self._install_module_hooks()
        with torch._C.DisableTorchFunction():
            outs = _unique(flat_tensors(output))
        self.finish_call(pending, outs)
        if self._module_stack:
            self._pop_modules(len(self._module_stack) - 1)

    # ---- optimizers ---------------------------------------------------------------------------
    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self.owner or self.closed or self._step is not None:
            return  # (an open step: an optimizer stepped from inside another's step is part of it)
        self.hasher.before_write()  # the step writes into parameters and state, in place
        with self.lock, torch._C.DisableTorchFunction():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    named = self._named.get(p)
                    if named is None:
                        continue
                    pname = named[0]
                    g = p.grad
                    if g is not None:
                        hit = self._tensor_names.get(g)
                        if hit is None:
                            # A .grad no backward of the block made (set by hand, or before the block).
                            base = f"{pname}@grad"
                            self._new_leaf_grad(g, self._bump(base) if base in self.trace.tensors else base,
                                                None, None)
                        elif hit[1] != _version(g):
                            self.name_of(g)  # changed in place since it was named: a new version
                    for key, v in optimizer.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor) and v not in self._named:
                            self._named[v] = (f"{pname}.{key}", "state")
        closure = (args[1] if len(args) > 1 else None) or (kwargs or {}).get("closure")
        if not (self.optimizer_ops or self.paused or self.stopped or closure is not None):
            # A closure (LBFGS) runs a forward and backward inside the step: those stay visible.
            self._open_step(optimizer, sys._getframe(1))

    def _open_step(self, optimizer: Any, frame: FrameType) -> None:
        """Record ``optimizer.step()`` as one call: its inputs are the parameters, gradients and
        state; its outputs the new versions of what it changed and the state it created. The
        ops inside are not recorded (``optimizer_ops=True`` records them): a foreach AdamW step
        makes ~10 versions of every parameter and state tensor, which cost more to record than
        the rest of a step, and the values that matter are the ones the step leaves behind."""
        cls = type(optimizer)
        # Hooks run outside the mode's handler, where every tensor attribute read (p.grad) would
        # go through the mode: hence DisableTorchFunction around all of this.
        with self.lock, torch._C.DisableTorchFunction():
            tensors: list[torch.Tensor] = []
            # What the step writes: every parameter that has a gradient and that parameter's
            # state, and, when GradScaler passes its scale in (fused optimizers unscale in
            # place), the gradients too. Fused optimizers write all of it without bumping a
            # version counter, so the versions cannot tell.
            written: set[int] = set()
            unscales = getattr(optimizer, "grad_scale", None) is not None
            for group in optimizer.param_groups:
                for p in group["params"]:
                    tensors.append(p)
                    g = p.grad
                    if g is not None:
                        tensors.append(g)
                        written.add(identity(p))
                        if unscales:
                            written.add(identity(g))
                    for v in optimizer.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor):
                            tensors.append(v)
                            if g is not None:
                                written.add(identity(v))
            ins = _unique(tensors)
            vers = _versions_of(ins)
            in_names = [self._name_at(t, v) for t, v in zip(ins, vers)]
            seq = self._call_seq
            self._call_seq += 1
            name = self.counters.next(cls.__name__)
            stack_id = self.stack_table.capture() if self.stack_table is not None else None
        tokens = [li.before_call() for li in self.listeners] if self.listeners else None
        # No sequence-number bracket: a step makes no grad nodes.
        call = PendingCall(f"{cls.__module__}.{cls.__qualname__}.step", cls.__name__, "optimizer", ins, in_names,
                           seq, None, tokens, name, stack_id)
        self._step = _OpenStep(optimizer, frame, call, vers, written)
        self.paused = True
        if optimizer not in self._step_hooked:
            # Per optimizer, so it runs before the global post-hooks (a step trace's boundary).
            self._step_hooked.add(optimizer)
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_post))

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        st = self._step
        if st is not None and st.optimizer is optimizer and threading.get_ident() == self.owner:
            self.close_step()

    def step_running(self) -> bool:
        """Whether the open optimizer step is still running (its frame is on this thread's stack);
        False once it raised, which skipped its post-hook."""
        st = self._step
        if st is None:
            return False
        f: FrameType | None = sys._getframe(1)
        while f is not None:
            if f is st.frame:
                return True
            f = f.f_back
        return False

    def close_step(self, error: str | None = None) -> None:
        """End the open optimizer step: record it as one call (with ``error`` if it raised)."""
        st = self._step
        if st is None:
            return
        self._step = None
        self.paused = False
        optimizer = st.optimizer
        created: list[torch.Tensor] = []
        with self.lock, torch._C.DisableTorchFunction():
            # A step that raised wrote what its version counters say, no more can be known.
            written = st.written if error is None else set()
            mutated = [t for t, v in zip(st.call.ins, st.versions) if identity(t) in written or _version(t) != v]
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
                            self._new_tensor(v, f"{owner}.{key}", "state", st.call.name)
                            created.append(v)
        # Its outputs are what it changed (as an in-place op returns its target) and what it made.
        call = self.finish_call(st.call, mutated + created, mutated)
        if error is not None:
            call.error = error

    # ---- custom autograd Functions ------------------------------------------------------------
    def record_function(self, cls: type, apply: Callable[..., Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> Any:
        with torch._C.DisableTorchFunction():
            ins = _unique(flat_tensors(args) + (flat_tensors(kwargs) if kwargs else []))
            vers = [_version(t) for t in ins]
        # Named before it runs: the calls inside its forward name it as their parent.
        pending = self.begin_call(ins, api=f"{cls.__module__}.{cls.__qualname__}.apply", short=cls.__name__,
                                  kind="function", name=self.counters.next(cls.__name__))
        assert pending.name is not None
        self._parents.append(pending.name)
        try:
            out = apply(cls, *args, **kwargs)
        except BaseException as exc:
            self._parents.pop()
            self.fail_call(pending, exc, args=args, kwargs=kwargs)
            raise
        self._parents.pop()
        with torch._C.DisableTorchFunction():
            outs = _unique(flat_tensors(out))
            mutated = [t for t, v in zip(ins, vers) if _version(t) != v]
        self.finish_call(pending, outs, mutated, args=args, kwargs=kwargs)
        return out

    def _record_failed_named(self, name: str, api: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                             in_names: list[str], seq: int, exc: BaseException) -> None:
        with self.lock, torch._C.DisableTorchFunction():
            stack_id = self.stack_table.capture() if self.stack_table is not None else None
            self.trace.calls.append(Call(
                name=name, api=api, module=self._module_stack[-1] if self._module_stack else "",
                inputs=in_names, outputs=[], args=naming.short_args(args, kwargs), stack_id=stack_id,
                parent=self._parents[-1] if self._parents else None, kind="function",
                phase="backward" if self._in_backward else "forward", seq=seq,
                error=f"{type(exc).__name__}: {exc}"))


# ---- node hooks: module-level functions so they capture no tensor and no recorder ------------------
_PRE_HOOK: Any = object()  # a unique marker: only a pre-hook call leaves the argument at it


def _node_hook(ref: weakref.ref[Recorder], name: str, grads: tuple[Any, ...], grad_outputs: Any = _PRE_HOOK) -> None:
    """A node's pre-hook ``(grad_outputs)`` and hook ``(grad_inputs, grad_outputs)`` in one."""
    rec = ref()
    if rec is not None and not rec.closed:
        if grad_outputs is _PRE_HOOK:
            rec.node_begin(name, grads)
        else:
            rec.node_end(name, grads)


def _node_done_hook(ref: weakref.ref[Recorder], name: str, grad_inputs: tuple[Any, ...],
                    grad_outputs: tuple[Any, ...]) -> None:
    """The only hook of a node that needs no pre-hook (see ``Recorder._register_node``)."""
    rec = ref()
    if rec is not None and not rec.closed:
        rec.node_done(name, grad_inputs, grad_outputs)


# ---- the autograd.Function.apply wrapper, installed while a trace is active ------------------------
_FunctionBase = torch.autograd.function.Function
_ORIGINAL_APPLY = _FunctionBase.__dict__["apply"]
_ACTIVE: Recorder | None = None


# Private (the node the autograd engine runs on this thread); without it, Functions applied on an
# engine thread (CUDA backward) are not recorded.
_current_autograd_node: Callable[[], Any] | None = getattr(torch._C, "_current_autograd_node", None)


def _on_traced_thread(rec: Recorder) -> bool:
    """The trace's own thread, or an autograd engine thread running one of its backward passes."""
    if threading.get_ident() == rec.owner:
        return True
    return bool(rec.in_backward) and _current_autograd_node is not None and _current_autograd_node() is not None


def _traced_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    rec = _ACTIVE
    original = _ORIGINAL_APPLY.__func__
    if rec is None or rec.closed or rec.paused or rec.stopped or rec.op_depth or not _on_traced_thread(rec):
        return original(cls, *args, **kwargs)
    return rec.record_function(cls, original, args, kwargs)


# ---- custom backward code: BackwardCFunction.apply runs a Function's backward (or vjp) -------------
# The whole backward pass runs inside the mode's handler for Tensor.backward, where the mode is
# off (and on CUDA it runs on engine threads, where it never was on). To see the ops a custom
# Function's backward makes, a mode of the same recorder is pushed around that code alone: they
# become calls nested under the running grad node, with their stacks inside backward().
_ORIGINAL_BACKWARD_APPLY = _BackwardCFunction.__dict__["apply"]


def _traced_backward_apply(self: Any, *args: Any) -> Any:
    rec = _ACTIVE
    if rec is None or rec.closed or rec.paused or rec.stopped or not rec.in_backward:
        return _ORIGINAL_BACKWARD_APPLY(self, *args)
    with _Mode(rec):
        return _ORIGINAL_BACKWARD_APPLY(self, *args)


def _install_apply_wrapper(rec: Recorder) -> None:
    global _ACTIVE
    _ACTIVE = rec
    _FunctionBase.apply = classmethod(_traced_apply)  # type: ignore[method-assign,assignment]
    _BackwardCFunction.apply = _traced_backward_apply  # type: ignore[method-assign]


def _uninstall_apply_wrapper(rec: Recorder) -> None:
    global _ACTIVE
    if _ACTIVE is rec:
        _ACTIVE = None
        _FunctionBase.apply = _ORIGINAL_APPLY  # type: ignore[method-assign]
        _BackwardCFunction.apply = _ORIGINAL_BACKWARD_APPLY  # type: ignore[method-assign]


def active_recorder() -> Recorder | None:
    return _ACTIVE
