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
import itertools
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

from tracer.model import Call, TensorRecord, Trace, names
from tracer.model.records import CallKind, Phase, Role
from tracer.options import RaisedOnPurpose, TraceOptions
from tracer.record import naming
from tracer.record.arrivals import install_rebuild_wrappers, uninstall_rebuild_wrappers
from tracer.record.autograd import Graph
from tracer.record.calls import PendingCall
from tracer.record.capture import PythonCapture
from tracer.record.checksums.hasher import Hasher
from tracer.record.compiled_functions import CompiledFunctionWatch
from tracer.record.engine import install_engine_wrapper, uninstall_engine_wrapper
from tracer.record.failsafe import failure_note, passes_on
from tracer.record.functions import (
    CustomFunctions,
    active_recorder,
    install_apply_wrapper,
    uninstall_apply_wrapper,
)
from tracer.record.listeners import Listener
from tracer.record.mode import RecordingMode
from tracer.record.modules import ModuleScopes
from tracer.record.optimizer import OptimizerSteps
from tracer.record.part import Part
from tracer.record.phases import PhaseTracker
from tracer.record.stacks import NoStacks, Stacks, StackTable, user_stacklevel
from tracer.record.storage_frees import install_resize_wrapper, uninstall_resize_wrapper
from tracer.record.swaps import Swaps, install_swap_wrapper, uninstall_swap_wrapper
from tracer.record.tensor_names import TensorNames
from tracer.record.tensors import (
    get_seq,
    version_of,
)

_TRACE_IDS = itertools.count()


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


# The longest text of an optimizer step's settings (tracer.record.optimizer.group_settings) kept:
# a diff compares them setting by setting, so they are cut only where a text of a call's
# arguments would hide one.
OPTIMIZER_ARGS_LIMIT = 1000


class Recorder:
    """Owns every hook of one active trace and turns what they see into trace records: a façade
    over the parts that own the recorder's state (docs/architecture.md, "The recorder's parts"),
    holding what they share (the trace, the lock, the hasher, the flags)."""

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
        # The recorder's own hasher (``hasher`` is a stand-in while ``unhashed`` runs).
        self.own_hasher = self.hasher
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
        self.phases = PhaseTracker(trace.tensors)  # which phase each call is in
        # >0 while a recorded op runs: a Function applied inside an op (a torch.library custom
        # op's generated autograd Function) is that op's implementation, not a call of its own.
        self.op_depth = 0
        self.call_seq = 0  # the place in the trace of the next call to begin
        self.trace_id = next(_TRACE_IDS)
        self.node_attribution = "sequence-number" if get_seq is not None else "first-seen"
        self.mode = RecordingMode(self)
        self._mode_entered = False  # (install() may fail before it enters the mode)
        self._compiled_functions = CompiledFunctionWatch(self)
        self.functions = CustomFunctions(self)
        self.scopes = ModuleScopes(self)
        self.steps = OptimizerSteps(self)
        self.names = TensorNames(self)
        self.swaps = Swaps(self)
        self.graph = Graph(self)
        self.capture = PythonCapture(self)
        self._parts: list[Part] = [self.functions, self.scopes, self.steps, self.names, self.swaps, self.graph,
                                   self.capture]

    # ---- installation -------------------------------------------------------------------------
    def install(self) -> None:
        self.hasher.prepare()
        self.scopes.install_hooks()
        self.steps.install()
        install_apply_wrapper(self)
        install_engine_wrapper()
        install_swap_wrapper()
        install_resize_wrapper()
        install_rebuild_wrappers()
        self.mode.__enter__()
        self._mode_entered = True
        self._compiled_functions.install()

    def uninstall(self) -> None:
        """Remove every mode, hook and wrapper. Safe to call twice."""
        if self.closed:
            return
        self.steps.close_open()  # the block ended inside optimizer.step() (it raised)
        self.closed = True
        # Regions still open (the block left from inside compiled code) put the mode back first:
        # the mode's own exit pops whatever is on top of the stack.
        self.scopes.close_all()
        self._compiled_functions.uninstall()
        try:
            # A mode's exit pops whatever mode is on top of the stack: only the recorder's own,
            # never the program's (install() may have failed before entering it).
            if self._mode_entered:
                self._mode_entered = False
                self.mode.__exit__(None, None, None)
            # The mode points back at this recorder: once it is off the stack, drop that link, so
            # that a finished trace is freed by reference counting, not by the cycle collector
            # (which would walk all of its records to find the cycle).
            self.mode.recorder = None
        finally:
            uninstall_apply_wrapper(self)
            uninstall_engine_wrapper()
            uninstall_swap_wrapper()
            uninstall_resize_wrapper()
            uninstall_rebuild_wrappers()
            self.graph.remove_hooks()
            self.steps.remove_hooks()
            self.scopes.remove_hooks()
            self.stack_table.clear_scopes()
            self.scopes.let_go_of_frames()

    def release(self) -> None:
        """The trace is done (uninstalled and finalised): drop the parts' links back to the
        recorder, its only reference cycle, so that it and its trace are freed by reference
        counting, not by the cycle collector walking every record. Safe to call twice."""
        for part in self._parts:
            part.release()

    @property
    def function_depth(self) -> int:
        """How many custom Function forwards enclose the call being recorded."""
        return self.functions.depth

    @property
    def finished_runs(self) -> int:
        """How many backward runs, from the first, are finished: the records a streamed file may
        hold. A run still open (one whose nested runs are running included) and every run after it
        are still being filled."""
        return self.graph.finished_runs

    @property
    def in_backward(self) -> bool:
        """Whether a backward run of this trace is in progress."""
        return self.graph.in_backward

    @property
    def current_module(self) -> str:
        """The path of the innermost module running now (``""``: the root module, or none)."""
        return self.scopes.innermost() or ""

    @property
    def running_node(self) -> str | None:
        """The grad node running now (innermost), when a backward is in progress."""
        return self.graph.running_node

    def phase_of(self, name: str, kind: str, in_names: Sequence[str], produced: Sequence[Any],
                 writes: bool = False) -> Phase:
        """The phase of a call named ``name`` about to be recorded (tracer.record.phases): for
        features that build their own ``Call`` (collectives, custom Functions). ``writes``: it
        wrote a tensor in place."""
        if self.graph.in_backward:
            return "backward"
        if kind != "optimizer" and self.scopes.innermost() is not None:
            return self.phases.module_call()
        return self.phases.outside_modules(name, kind, in_names, produced, writes)

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

    def marks(self) -> tuple[int, int, int]:
        """Where the trace's records end now (see ``take_back``)."""
        t = self.trace
        return len(t.calls), len(t.tensors), len(t.grad_nodes)

    def take_back(self, marks: tuple[int, int, int], exc: BaseException, what: str) -> None:
        """Recording ``what`` (an API) did not finish: ``exc`` came from inside it. Its records
        made since ``marks`` are taken back (half a call's records would name a producer no record
        has: its outputs are in before the call is), so that the trace, and the file it streams
        to, hold every call before it whole. A Ctrl-C or an exit landing in gradtrace's own work
        also stops the recording (what the recorder holds may be half updated); an exception
        raised on purpose keeps the call it was raised for."""
        if isinstance(exc, RaisedOnPurpose):
            return
        calls, tensors, nodes = marks
        t = self.trace
        del t.calls[calls:]
        del t.grad_nodes[nodes:]
        for name in list(t.tensors)[tensors:]:
            del t.tensors[name]
        if not isinstance(exc, Exception):
            self.stop(f"recording stopped: {type(exc).__name__} came while gradtrace recorded a call of {what}; "
                      "the trace holds every call before it")

    def stop(self, reason: str) -> None:
        """Stop recording cleanly (a bound was reached); the trace and the console say why."""
        if self.stopped:
            return
        self.stopped = True
        self.trace.notes.append(reason)
        warnings.warn(f"gradtrace: {reason}", RuntimeWarning, stacklevel=user_stacklevel())

    def data_alias(self, source: Any, alias: Any) -> None:
        """``source.data`` returned ``alias`` (see ``name_data_alias``)."""
        if isinstance(source, torch.Tensor) and isinstance(alias, torch.Tensor):
            with self.lock, torch._C.DisableTorchFunction():
                self.names.name_data_alias(source, alias)

    def grad_alias(self, param: Any, grad: Any) -> None:
        """``param.grad`` returned ``grad`` (see ``name_grad_alias``)."""
        names = self.names
        hit = names.lookup(grad)
        if hit is None:
            if isinstance(param, torch.Tensor):
                with self.lock, torch._C.DisableTorchFunction():
                    names.name_grad_alias(param, grad)
        elif not self.in_backward and not hit[0].endswith("@grad"):  # (usually <param>@grad)
            named = names.owned_name(param)
            if named is not None and named[1] == "param" and hit[1] == version_of(grad):
                with self.lock, torch._C.DisableTorchFunction():
                    names.name_assigned_grad(named[0], grad, hit)

    def record_captured(self, api: str, short: str, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                        ins: list[torch.Tensor], in_names: list[str], outs: list[torch.Tensor],
                        mutated: list[torch.Tensor], produced: list[torch.Tensor], grad_fns: list[Any], seq: int,
                        seq0: int | None, seq1: int | None, name: str | None, tokens: list[Any] | None,
                        stack_id: int | None) -> Call:
        """Record a call the capture has closed (``PythonCapture.close``: what it returned and
        wrote, their grad_fn, its sequence-number bracket [``seq0``, ``seq1``) and its stack), in
        phases: its values named, its grad nodes named and linked, where it was made, its record
        appended. The caller holds the lock, with torch functions off."""
        if name is None:
            name = self.counters.next(short)
        mutated_names, out_names, names_of = self.names.name_call_values(api, short, kind, name, ins, in_names, outs,
                                                                          mutated, produced,
                                                                          bool(kwargs) and "out" in kwargs)
        node_names = self.graph.link_call_nodes(produced, grad_fns, seq0, seq1, name, stack_id, names_of)
        parent, module, phase = self._context(name, kind, in_names, produced, mutated_names, api)
        # Positional, in Call's field order: this runs for every recorded call.
        args_text = naming.short_args(args, kwargs) if kind != "optimizer" else \
            naming.short_args(args, kwargs, OPTIMIZER_ARGS_LIMIT)  # (its param groups' settings, whole)
        call = Call(name, api, module, in_names, out_names, args_text, node_names,
                    stack_id, parent, kind, phase, seq, mutated_names)  # type: ignore[arg-type]
        if parent is not None:
            self.graph.note_node_call(parent, name)
        self.append_call(call, tokens, produced)
        return call

    def _context(self, name: str, kind: str, in_names: list[str], produced: list[torch.Tensor],
                 wrote: list[str], api: str = "") -> tuple[str | None, str, Phase]:
        """Where the call ``name`` was made: its parent (the custom Function whose forward runs,
        else the grad node whose code or hook runs), its module (in backward: the module of
        the running node's forward call) and its phase (tracer.record.phases)."""
        graph = self.graph
        running = graph.running_node
        parent = self.functions.innermost() or running
        in_backward = graph.in_backward
        if parent is None and in_backward:  # a hook's op: the node whose hook it is
            parent = graph.engine_node()
        module_now = self.scopes.innermost()
        if module_now is not None:
            module = module_now
        elif in_backward and parent is not None:
            # A custom backward's op, a hook's (a tensor hook runs before its node: parent is
            # that node), a forward recomputed by a checkpoint: the module of the forward call
            # whose grad node runs (a recomputed submodule's calls have their own scope above).
            module = graph.module_of_node(running if running is not None else parent)
        else:
            module = ""
        # The usual call, inside a module's forward, decides with two tests.
        if in_backward:
            phase: Phase = "backward"
        elif module_now is not None and kind != "optimizer":
            phase = "forward"
            if self.phases.window_open:
                self.phases.module_call()
        else:
            phase = self.phases.outside_modules(name, kind, in_names, produced, bool(wrote), api, wrote)
        return parent, module, phase

    # ---- the public recording API (features record their own calls through it) ---------------
    def begin_call(self, ins: list[torch.Tensor], *, api: str, short: str, kind: str,
                   name: str | None = None, may_write: bool | Sequence[torch.Tensor] = True) -> PendingCall:
        """Name a call's inputs and take its place in the trace, before it runs.

        ``may_write``: what the call may write with no op the recorder sees (a custom Function's
        extension kernel, a compiled region, a collective). True: anything, so every value still
        waiting for its checksum is read first; the tensors it writes, when those are known: only
        the waiting values they reach; False or none: nothing is read first."""
        with self.lock, torch._C.DisableTorchFunction():
            in_names = [self.names.name_of(t) for t in ins]
            seq = self.call_seq
            self.call_seq += 1
        # After the naming: an input first seen here is among what is read.
        if may_write is True:
            self.hasher.before_write()
        elif may_write:
            self.hasher.before_write(list(may_write))
        tokens = [li.before_call() for li in self.listeners] if self.listeners else None
        return PendingCall(api, short, kind, ins, in_names, seq, get_seq() if get_seq is not None else None,
                           tokens, name)

    def finish_call(self, pending: PendingCall, outs: list[torch.Tensor], mutated: Sequence[torch.Tensor] = (),
                    *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Call:
        """Record a call begun with ``begin_call`` that returned ``outs`` and wrote ``mutated``."""
        p = pending
        with torch._C.DisableTorchFunction():
            return self.capture.close(p.api, p.short, p.kind, args, kwargs or {}, p.ins, p.in_names, outs,
                                      list(mutated), p.seq, p.seq0, name=p.name, tokens=p.tokens,
                                      stack_id=p.stack_id, skip=3)

    def fail_call(self, pending: PendingCall, exc: BaseException, *, args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None) -> None:
        """Record a call begun with ``begin_call`` that raised ``exc`` (it has no outputs)."""
        p = pending
        if p.name is not None:
            self.functions.record_failed(p.name, p.api, args, kwargs or {}, p.in_names, p.seq, exc)
        else:
            self.record_raised(p.api, p.short, p.kind, args, kwargs or {}, p.in_names, p.seq, exc)

    def add_call(self, call: Call, produced: Sequence[torch.Tensor] = ()) -> Call:
        """Add a call whose records the caller made itself (``next_call_seq``, ``call_name``,
        ``new_version``...): listeners hear it, bounds count it."""
        with self.lock:
            self.append_call(call, None, list(produced))
        if self.on_records is not None:
            self.on_records()
        return call

    def append_call(self, call: Call, tokens: list[Any] | None = None, produced: list[torch.Tensor] | None = None) -> None:
        """The one place a call joins the trace (the caller holds the lock): appended, heard by
        the listeners (``tokens``: what each one's ``before_call`` returned) and counted against
        ``max_calls``. A call that raised (its error set already) made nothing: no listener
        hears it and it stops nothing."""
        self.trace.calls.append(call)
        if call.error is not None:
            return
        listeners = self.listeners
        if listeners:
            for li, tok in zip(listeners, tokens or [None] * len(listeners)):
                li.on_call(self.trace, call, tok, produced if produced is not None else [])
        if self.max_calls is not None and len(self.trace.calls) >= self.max_calls:
            self.stop(f"recording stopped at max_calls={self.max_calls}: later calls, grad nodes "
                      "and backward runs were not recorded")

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
            seq = self.call_seq
            self.call_seq += 1
            return seq

    def call_name(self, short: str) -> str:
        """The next name for a call of ``short`` (``all_reduce0``, ``all_reduce1``...)."""
        return self.counters.next(short)

    def capture_stack(self) -> int | None:
        """The interned id of the caller's stack (None when stacks are off)."""
        return self.stack_table.capture(2)

    def name_of(self, t: torch.Tensor) -> str:
        """The current name of a tensor, registering it (and hashing it) on first sight."""
        with self.lock:
            return self.names.name_of(t)

    def current_name(self, t: torch.Tensor) -> str | None:
        """The name ``t`` has in the trace if its value has not changed since, else None."""
        hit = self.names.lookup(t)
        return hit[0] if hit is not None and hit[1] == version_of(t) else None

    def known_name(self, t: torch.Tensor) -> str | None:
        """The last name ``t`` had in the trace, whatever happened to it since (None: never seen)."""
        hit = self.names.lookup(t)
        return None if hit is None else hit[0]

    def param_name(self, t: torch.Tensor) -> str | None:
        """The module path of a parameter or buffer the trace has seen."""
        named = self.names.owned_name(t)
        return None if named is None else named[0]

    def new_version(self, t: torch.Tensor, of: str, role: Role, producer: str | None) -> str:
        """Record ``t`` as the next version of ``of`` (changed in place by ``producer``)."""
        with self.lock:
            return self.names.new_tensor(t, self.names.bump(names.base_name(of)), role, producer, previous=of)

    def leaf_grad(self, t: torch.Tensor, param: str, producer: str | None, previous: str | None) -> str:
        """Record ``t`` as a value of leaf ``param``'s gradient: ``param@grad``, or its next
        version when that name is taken."""
        base = f"{param}@grad"
        with self.lock:
            return self.names.new_leaf_grad(t, self.names.bump(base) if base in self.trace.tensors else base, producer,
                                       previous)

    def leaf_grad_written_unseen(self, leaf: torch.Tensor) -> None:
        """From a post-accumulate-grad hook of ``leaf``: its .grad, just accumulated, is named and
        read now, because code the trace cannot see writes it in place next (DDP's bucket views)."""
        self.graph.leaf_grad_written_unseen(leaf)

    def module_path(self, module: torch.nn.Module) -> str | None:
        """The path the trace named ``module`` by (None: not seen)."""
        return self.scopes.path_of(module)

    def register_root_module(self, module: torch.nn.Module, held_as: str | None = None) -> None:
        """Name modules, parameters and buffers from ``module`` down, as if it were called first
        (a trainer's model, whose forward may never be called itself). ``held_as``: the name the
        user's code holds it by, the prefix of a second root."""
        self.scopes.register_root_module(module, held_as)

    @property
    def run_index(self) -> int:
        """The index of the backward run in progress or last run (0 before any)."""
        return self.graph.run_index

    def record_raised(self, api: str, short: str, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      in_names: list[str], seq: int, exc: BaseException) -> None:
        """A call whose op raised ``exc``: recorded with its inputs and the error, no outputs.
        The op a non-reentrant checkpoint stops its recomputation at is no error: torch raises
        its own ``_StopRecomputationError`` from the op's saved-tensor hook once it holds every
        tensor the backward needs, and drops the op's result. That op is recorded as the
        recomputation it is, without outputs and without an error."""
        stopped = type(exc).__name__ == "_StopRecomputationError" and type(exc).__module__ == "torch.utils.checkpoint"
        with self.lock, torch._C.DisableTorchFunction():
            stack_id = self.stack_table.capture()
            name = self.counters.next(short)
            parent, module, phase = self._context(name, kind, in_names, [], [])
            call = Call(name=name, api=api, module=module, inputs=in_names, outputs=[],
                        args=naming.short_args(args, kwargs), stack_id=stack_id, parent=parent,
                        kind=cast(CallKind, kind), phase=phase, seq=seq,
                        error=None if stopped else f"{type(exc).__name__}: {exc}")
            self.append_call(call)


__all__ = ["PendingCall", "Recorder", "active_recorder"]
