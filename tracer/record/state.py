"""What a recorder holds (``RecorderState``): every table of one active trace, and naming the
tensor values it meets, versions, aliases and all. The rooms of the recorder (autograd, modules,
optimizer, functions) build on it; ``tracer.record.recorder.Recorder`` joins them."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tracer.model import BackwardRun, Call, GradNode, NodeRun, Trace
from tracer.model.records import Phase
from tracer.options import RaisedOnPurpose, TraceOptions
from tracer.record import naming
from tracer.record.checksums.hasher import Hasher
from tracer.record.failsafe import failure_note, passes_on
from tracer.record.listeners import Listener
from tracer.record.phases import PhaseTracker
from tracer.record.stacks import NoStacks, Stacks, StackTable
from tracer.record.tensors import (
    get_seq,
)
from tracer.record.weakmap import IdWeakMap

if TYPE_CHECKING:
    from tracer.record.calls import PendingCall
    from tracer.record.mode import RecordingMode
    from tracer.record.modules import ModuleScopes
    from tracer.record.optimizer import OptimizerSteps
    from tracer.record.tensor_names import TensorNames

_TRACE_IDS = itertools.count()


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
        # The recorder's own hasher (``hasher`` is a stand-in while ``Recorder.unhashed`` runs).
        self.own_hasher = self.hasher
        # Built-in grad nodes get their hook (their runs recorded) at once when this is set,
        # else only when a backward run starts that needs them (see _hook_waiting_nodes):
        # names of the nodes waiting for it.
        self._every_node_run = options.every_node_run
        self._unhooked: set[str] = set()
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
        # (note_unnamed_hook_input).
        self._hook_inputs_noted: set[str] = set()
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
        self._node_seq = 0
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

    if TYPE_CHECKING:  # defined by the rooms that join in Recorder; declared for the others
        mode: RecordingMode
        scopes: ModuleScopes
        steps: OptimizerSteps
        names: TensorNames

        def _collect_nodes(self, root: Any, seq0: int | None, seq1: int | None, call: str, stack_id: int | None,
                           out: list[str], local_kinds: dict[str, int]) -> str | None: ...
        def _engine_node(self) -> str | None: ...
        def begin_call(self, ins: list[torch.Tensor], *, api: str, short: str, kind: str,
                       name: str | None = None) -> PendingCall: ...
        def finish_call(self, pending: PendingCall, outs: list[torch.Tensor], mutated: Sequence[torch.Tensor] = (),
                        *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Call: ...
        def fail_call(self, pending: PendingCall, exc: BaseException, *, args: tuple[Any, ...] = (),
                      kwargs: dict[str, Any] | None = None) -> None: ...
        def stop(self, reason: str) -> None: ...
        def append_call(self, call: Call, tokens: list[Any] | None = None,
                        produced: list[torch.Tensor] | None = None) -> None: ...
