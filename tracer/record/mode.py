"""The TorchFunctionMode that sees every torch call the user's code makes, and hands the ones
that make or change tensors to the recorder."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from tracer.options import RaisedOnPurpose
from tracer.record.naming import tensor_backward_of
from tracer.record.own_work import OWN_WORK
from tracer.record.tensors import NODE_KINDS, node_kind

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder


# True only while Dynamo traces Python (torch.compile of a function called inside the block):
# then the handler is compiled into the graph as the op itself, nothing recorded, so the mode
# causes no graph break and no recompilation. Its ops run untraced (one opaque region).
_dynamo_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", None) \
    or getattr(torch.compiler, "is_compiling", None) or (lambda: False)


class CompiledRegions:
    """Set from inside compiled code (Dynamo replays the attribute store after each run of the
    compiled graph): whether a compiled function ran while a trace was active."""

    ran = False


COMPILED = CompiledRegions()


# What an aten operator called from Python is (``torch.ops.aten.mm.default``): what a
# ``__torch_dispatch__`` handler calls.
_OP_OVERLOADS = frozenset({"OpOverload", "OpOverloadPacket"})
# Whether a callable's class is one of those, by the class: every torch call asks, and reading the
# name of a class defined in C (``builtin_function_or_method``) makes a new string each time.
_IS_OVERLOAD: dict[type, bool] = {}
_HANDLER_DEPTH = 12  # frames looked at above an operator call for a __torch_dispatch__ handler


def from_dispatch_handler() -> bool:
    """Whether the operator being called comes from a ``__torch_dispatch__`` handler (a user's
    dispatch mode, FlopCounterMode, DebugMode, or a tensor subclass) a few frames up: torch's
    own work passing through it (``save_for_backward``'s detach, a built-in grad node's mm,
    ``AccumulateGrad``'s add_), not a call of the user's code. Such work is not recorded, as a
    forward call's inner ops are not; a custom Function's backward calls torch itself and stays
    recorded. Likewise an operator that one of torch's Python references or decompositions calls
    (``torch._refs.mul`` calling ``prims.mul``: the engine runs them on meta tensors for a
    forward-mode AD tangent's shape inside a backward)."""
    f: FrameType | None = sys._getframe(2)  # (above this function and the mode's handler)
    caller = f
    while caller is not None and caller.f_code.co_filename in _DISPATCH_FILES:
        caller = caller.f_back  # (the mode's handlers, torch's OpOverload.__call__)
    if caller is not None and caller.f_code.co_filename.startswith(_TORCH_REFERENCES):
        return True
    for _ in range(_HANDLER_DEPTH):
        if f is None:
            return False
        if f.f_code.co_name == "__torch_dispatch__":
            return True
        f = f.f_back
    return False


# torch's Python references and decompositions of its operators: the operators they call are theirs.
_DISPATCH_FILES = frozenset({__file__, torch._ops.__file__})
_TORCH_REFERENCES = tuple(os.path.join(os.path.dirname(torch.__file__), d) + os.sep
                          for d in ("_refs", "_prims", "_prims_common", "_decomp"))


class RecordingMode(TorchFunctionMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder: Recorder | None = recorder  # None once the recorder is uninstalled

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        # An error gradtrace raises on purpose (raise_on_nonfinite, a tripped watch) reaches the
        # program from here, its traceback cut to this frame (which pytest and IPython hide) and
        # the program's own: the recorder's and torch's frames below say nothing to the user.
        __tracebackhide__ = True
        try:  # (free in CPython 3.11+ until something raises)
            if kwargs is None:
                kwargs = {}
            if _dynamo_compiling():
                COMPILED.ran = True
                return func(*args, **kwargs)
            rec = self.recorder
            overload = _IS_OVERLOAD.get(type(func))
            if overload is None:
                overload = _IS_OVERLOAD[type(func)] = type(func).__name__ in _OP_OVERLOADS
            if rec is None or (overload and from_dispatch_handler()):
                return func(*args, **kwargs)
            try:  # ApiNames.describe, its cache hit inlined: this runs for every torch call
                hit = rec.api.cache.get(func)
            except TypeError:  # an unhashable callable
                hit = None
            if hit is None:
                try:
                    hit = rec.api.describe(func)
                except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
                    rec.recorder_failed(exc)
                    return func(*args, **kwargs)
            api, short, kind, writes = hit
            if kind == "skip":
                return func(*args, **kwargs)
            if kind == "grad_alias" or kind == "data_alias":
                # p.grad / p.data: read by the hundred inside optimizer steps (paused: nothing to
                # do), so before the open step's frame test below, which every op inside it pays.
                out = func(*args, **kwargs)
                if out is not None and not (rec.paused or rec.stopped):
                    try:
                        with OWN_WORK():
                            if kind == "grad_alias":
                                rec.grad_alias(args[0], out)
                            else:
                                rec.data_alias(args[0], out)
                    except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
                        rec.recorder_failed(exc)
                return out
            steps = rec.steps
            if steps.open is not None and not steps.running():
                try:
                    with OWN_WORK():
                        steps.close("optimizer.step() raised; its changes up to there are recorded")
                except Exception as exc:
                    rec.recorder_failed(exc)
            # Tensor.backward is run as naming.tensor_backward: the function the mode was handed may
            # be a program's wrapper of it, which has run already (it handed the call on).
            if rec.paused or rec.stopped:
                if kind == "backward" and api == "Tensor.backward":
                    func = tensor_backward_of(func)
                return func(*args, **kwargs)
            if kind == "backward":
                return rec.graph.record_backward(tensor_backward_of(func) if api == "Tensor.backward" else func, api, args,
                                           kwargs)
            if kind == "hook":
                try:
                    with OWN_WORK():
                        rec.graph.tensor_hook_registered()
                except Exception as exc:
                    rec.recorder_failed(exc)
                return func(*args, **kwargs)
            if kind == "retain":
                out = func(*args, **kwargs)
                try:
                    with OWN_WORK():
                        rec.graph.grad_retained(args[0])
                except Exception as exc:
                    rec.recorder_failed(exc)
                return out
            if kind == "set_data":
                return rec.capture.record_set_data(func, api, short, args, kwargs, writes)
            if kind == "collective":
                # References to collectives taken before the trace land here, not in the wrappers
                # (tracer.features.distributed sets the hook while a process group is traced).
                hook = rec.collective_hook
                wrapped = hook(rec, func) if hook is not None else None
                if wrapped is not None:
                    return wrapped(*args, **kwargs)
                kind = "op"
            return rec.capture.record_call(func, api, short, kind, args, kwargs, writes)

        except Exception as exc:
            if isinstance(exc, RaisedOnPurpose):
                raise exc.with_traceback(None) from exc.__cause__
            raise

# The grad node the autograd engine runs on this thread (private; without it a compiled region's
# backward is recorded op by op instead of staying opaque).
current_autograd_node: Callable[[], Any] | None = getattr(torch._C, "_current_autograd_node", None)
# The backward of a torch.compile region (AOTAutograd's Function) is as opaque as its forward:
# one grad node, the ops of its compiled backward graph not recorded.
COMPILED_BACKWARDS = frozenset({"CompiledFunctionBackward", "CompiledFunctionBackwardBackward"})


class BackwardRecordingMode(RecordingMode):
    """The mode a recorded backward runs under (tracer.record.engine): what the recording mode
    does, except inside a compiled region's backward, whose ops run unrecorded."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        node = current_autograd_node() if current_autograd_node is not None else None
        if node is not None and (NODE_KINDS.get(type(node)) or node_kind(node)) in COMPILED_BACKWARDS:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


# The torch-function mode stack (private functions every torch >= 2.0 has; without them no mode
# is known to be on top: the engine's entry always adds the backward's mode, and compiled regions
# fall back to DisableTorchFunction, see tracer.record.opaque).
_stack_len: Callable[[], int] | None = getattr(torch._C, "_len_torch_function_stack", None)
_stack_at: Callable[[int], Any] | None = getattr(torch._C, "_get_function_stack_at", None)


def top_mode() -> Any:
    """The mode on top of this thread's torch-function stack (None: none, or not readable)."""
    if _stack_len is None or _stack_at is None:
        return None
    n = _stack_len()
    return _stack_at(n - 1) if n else None


_stack_pop: Callable[[], Any] | None = getattr(torch._C, "_pop_torch_function_stack", None)
_stack_push: Callable[[Any], None] | None = getattr(torch._C, "_push_on_torch_function_stack", None)


def take_off_top(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` off this thread's torch-function stack if it is on top (False: it is not, or
    torch lacks the stack functions; nothing was changed). ``put_back`` undoes it."""
    if _stack_pop is None or _stack_push is None or top_mode() is not mode:
        return False
    _stack_pop()
    return True


def put_back(mode: TorchFunctionMode) -> None:
    """Put ``mode`` back on top of this thread's torch-function stack (after ``take_off_top``)."""
    assert _stack_push is not None  # (take_off_top took it off: torch has the functions)
    _stack_push(mode)


def top_recording_mode() -> RecordingMode | None:
    """The recording mode on top of this thread's torch-function stack, if that is one."""
    top = top_mode()
    return top if isinstance(top, RecordingMode) else None


class Owned(Protocol):
    """A recorder, as far as telling its threads apart goes."""

    @property
    def owner(self) -> int: ...  # the ident of the thread that entered the block


def on_traced_thread(rec: Owned) -> bool:
    """Whether the code running on this thread belongs to ``rec``'s trace: the thread that
    entered the block, or an autograd engine thread running one of its backward runs (the engine
    hands the torch-function modes a run started under, this recorder's among them, to the
    threads that run its nodes: tracer.record.engine). Any other thread is the program's own,
    whatever it runs (its own custom Functions and backward passes, or nodes of the traced graph
    it runs a backward through): nothing of it is recorded. The owner's test is one comparison;
    only another thread looks through its (short) mode stack."""
    if threading.get_ident() == rec.owner:
        return True
    if _stack_len is None or _stack_at is None:
        return False
    for i in range(_stack_len()):
        mode = _stack_at(i)
        if isinstance(mode, RecordingMode) and mode.recorder is rec:
            return True
    return False
