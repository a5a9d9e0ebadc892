"""``torch.compile``'d functions called inside a traced block: each call is one opaque call of the
trace (kind ``compiled``), its inputs and outputs linked like any call's, and its compiled code
runs exactly as outside a trace (no graph break, no recompilation caused by gradtrace).

``torch.compile`` puts the same wrapper function around every function it compiles (one code
object, found in ``_TorchDynamoContext.__call__``). Two things watch that wrapper while a trace is
active:

- entry and exit: the wrapper calls its context's ``enter_exit_hooks`` before Dynamo's frame
  evaluation is set, and their cleanups in ``finally``. A property on the context class adds our
  hook to the list the wrapper reads, for contexts made before the block too. Other readers of
  the attribute (Dynamo appending its own hooks) get the real list.
- the result, which ``finally`` cannot see: on Python 3.12+ a ``sys.monitoring`` PY_RETURN event
  local to the wrapper's code, armed once per trace; before 3.12 a profile function set by the
  exit hook and removed by the wrapper's return a few instructions later (never during the
  compiled code itself, so compilation is not slowed).

Both are private details of ``torch._dynamo``. Where they are missing (another torch), or when
``torch._dynamo`` was first imported inside the block, compiled functions run unseen and the
trace says so (``tracer.record.mode.COMPILED``), as compiled code always did before.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tracer.record.calls import PendingCall
from tracer.record.tensors import flat_tensors, unique

if TYPE_CHECKING:
    from tracer.record.opaque import OpaqueRegion
    from tracer.record.recorder import Recorder

_HOOKS_ATTRIBUTE = "enter_exit_hooks"
_NO_RESULT_NOTE = ("a torch.compile'd function's outputs were not linked (a profiler was active): "
                   "its call has no outputs")


def _nothing() -> None:
    return None


def _dynamo_context() -> tuple[type, types.CodeType] | None:
    """Dynamo's context class and the code of the wrapper it puts around compiled functions, or
    None (Dynamo not imported yet, or not laid out as expected)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    cls = getattr(eval_frame, "_TorchDynamoContext", None)
    code = getattr(vars(cls).get("__call__") if cls is not None else None, "__code__", None)
    if cls is None or code is None or _HOOKS_ATTRIBUTE in vars(cls):
        return None
    wrappers = [c for c in code.co_consts
                if isinstance(c, types.CodeType) and _HOOKS_ATTRIBUTE in c.co_names and "self" in c.co_freevars]
    return (cls, wrappers[0]) if len(wrappers) == 1 else None


class _HooksWithOurs:
    """``enter_exit_hooks`` of every Dynamo context while a trace is active: the wrapper of a
    compiled function reads the context's hooks followed by ours; everyone else the real list."""

    def __init__(self, watch: CompiledFunctionWatch, code: types.CodeType) -> None:
        self._watch = watch
        self._code = code

    def __get__(self, ctx: object, owner: type | None = None) -> Any:
        if ctx is None:
            return self
        hooks = vars(ctx).get(_HOOKS_ATTRIBUTE)
        if hooks is None:
            raise AttributeError(_HOOKS_ATTRIBUTE)
        if sys._getframe(1).f_code is self._code:
            return [*hooks, self._watch.enter]
        return hooks

    def __set__(self, ctx: object, value: Any) -> None:
        vars(ctx)[_HOOKS_ATTRIBUTE] = value


class CompiledFunctionWatch:
    """Turns each call of a compiled function on the traced thread into one opaque call."""

    def __init__(self, rec: Recorder) -> None:
        # Weak: the recorder owns this watch, and a finished trace is freed by reference counting.
        self._rec_ref = weakref.ref(rec)
        self._cls: type | None = None
        self._code: types.CodeType | None = None
        self._tool: int | None = None  # the sys.monitoring tool id held (3.12+)
        # The call whose result the wrapper is about to return: (the wrapper's frame, its call).
        self._awaiting: tuple[types.FrameType, PendingCall] | None = None

    def install(self) -> None:
        found = _dynamo_context()
        if found is None:
            return
        cls, code = found
        setattr(cls, _HOOKS_ATTRIBUTE, _HooksWithOurs(self, code))
        self._cls, self._code = cls, code
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            return
        for tool in (4, 3, 2, 1, 0, 5):
            if monitoring.get_tool(tool) is None:
                monitoring.use_tool_id(tool, "gradtrace")
                self._tool = tool
                monitoring.register_callback(tool, monitoring.events.PY_RETURN, self._on_return)
                monitoring.set_local_events(tool, code, monitoring.events.PY_RETURN)
                break

    def uninstall(self) -> None:
        """Safe to call twice."""
        if self._cls is not None:
            if isinstance(vars(self._cls).get(_HOOKS_ATTRIBUTE), _HooksWithOurs):
                delattr(self._cls, _HOOKS_ATTRIBUTE)
            self._cls = None
        if self._tool is not None:
            monitoring: Any = getattr(sys, "monitoring")  # noqa: B009 (3.12+: not in older typesheds)
            monitoring.set_local_events(self._tool, self._code, 0)
            monitoring.register_callback(self._tool, monitoring.events.PY_RETURN, None)
            monitoring.free_tool_id(self._tool)
            self._tool = None
        if self._awaiting is not None and sys.getprofile() == self._profile:
            sys.setprofile(None)
        self._awaiting = None

    # ---- the wrapper's hooks --------------------------------------------------------------------
    def enter(self) -> Callable[[], None]:
        """Called by the wrapper before the compiled code runs; returns its cleanup."""
        rec = self._rec_ref()
        if (rec is None or rec.closed or rec.paused or rec.stopped or rec.in_backward or self._awaiting is not None
                or threading.get_ident() != rec.owner):
            return _nothing
        frame: types.FrameType | None = sys._getframe(1)
        for _ in range(3):  # the wrapper, or (before 3.12) its list comprehension's caller
            if frame is None or frame.f_code is self._code:
                break
            frame = frame.f_back
        if frame is None or frame.f_code is not self._code:
            return _nothing
        wrapper_frame = frame
        local = frame.f_locals
        with torch._C.DisableTorchFunction():
            ins = unique(flat_tensors((local.get("args", ()), local.get("kwargs", {}))))
        region = rec.scopes.open_region(wrapper_frame, ins)
        raised_before = sys.exc_info()[1]  # an exception the caller is handling, not ours

        def leave() -> None:
            self._leave(region, wrapper_frame, raised_before)

        return leave

    def _leave(self, region: OpaqueRegion, wrapper_frame: types.FrameType, raised_before: BaseException | None) -> None:
        rec = self._rec_ref()
        if rec is None:
            return
        pending = rec.scopes.close_region(region)
        raised = sys.exc_info()[1]
        if raised is not None and raised is not raised_before:  # the compiled code raised
            rec.fail_call(pending, raised)
            return
        if self._tool is not None:  # the PY_RETURN event finishes it
            self._awaiting = (wrapper_frame, pending)
        elif sys.getprofile() is None:
            self._awaiting = (wrapper_frame, pending)
            sys.setprofile(self._profile)
        else:  # a profiler holds the hook: the call keeps its inputs, its outputs are not known
            rec.finish_call(pending, [])
            if _NO_RESULT_NOTE not in rec.trace.notes:
                rec.trace.notes.append(_NO_RESULT_NOTE)

    def _on_return(self, code: types.CodeType, offset: int, result: object) -> Any:
        awaiting = self._awaiting
        rec = self._rec_ref()
        if awaiting is not None and rec is not None and threading.get_ident() == rec.owner \
                and sys._getframe(1) is awaiting[0]:
            self._finish(result)
        return None

    def _profile(self, frame: types.FrameType, event: str, arg: object) -> None:
        awaiting = self._awaiting
        if event == "return" and awaiting is not None and frame is awaiting[0]:
            sys.setprofile(None)
            self._finish(arg)

    def _finish(self, result: object) -> None:
        assert self._awaiting is not None
        _frame, pending = self._awaiting
        self._awaiting = None
        rec = self._rec_ref()
        if rec is None or rec.closed:
            return
        with torch._C.DisableTorchFunction():
            outs = unique(flat_tensors(result))
        rec.finish_call(pending, outs)


__all__ = ["CompiledFunctionWatch"]
