"""Custom ``autograd.Function`` calls: ``Function.apply`` does not go through the torch function
mode, so it is wrapped while a trace is active (the wrapper checks the owning thread); and
``BackwardCFunction.apply`` is wrapped so that the ops of a custom backward are recorded too."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tracer.model import Call
from tracer.options import RaisedOnPurpose
from tracer.record import naming
from tracer.record.mode import (
    COMPILED_BACKWARDS,
    BackwardRecordingMode,
    on_traced_thread,
    top_recording_mode,
)
from tracer.record.opaque import ModeOff
from tracer.record.part import Part

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder
from tracer.record.tensors import (
    BackwardCFunction,
    flat_tensors,
    unique,
    version_of,
)


class CustomFunctions(Part):
    """Custom Function calls (a part of ``Recorder``): each ``Function.apply`` one call, named
    before its forward runs, so the calls inside it name it as their parent."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        self._open: list[str] = []  # the Function calls whose forward runs now, innermost last

    @property
    def depth(self) -> int:
        """How many custom Function forwards enclose the call being recorded."""
        return len(self._open)

    def innermost(self) -> str | None:
        """The call of the innermost Function whose forward runs now (None: none)."""
        return self._open[-1] if self._open else None

    def record(self, cls: type, apply: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rec = self.rec
        with torch._C.DisableTorchFunction():
            ins = unique(flat_tensors(args) + (flat_tensors(kwargs) if kwargs else []))
            vers = [version_of(t) for t in ins]
        # Named before it runs: the calls inside its forward name it as their parent.
        pending = rec.begin_call(ins, api=f"{cls.__module__}.{cls.__qualname__}.apply", short=cls.__name__,
                                 kind="function", name=rec.counters.next(cls.__name__))
        assert pending.name is not None
        self._open.append(pending.name)
        try:
            out = apply(cls, *args, **kwargs)
        except BaseException as exc:
            self._open.pop()
            rec.fail_call(pending, exc, args=args, kwargs=kwargs)
            raise
        self._open.pop()
        with torch._C.DisableTorchFunction():
            outs = unique(flat_tensors(out))
            mutated = [t for t, v in zip(ins, vers) if version_of(t) != v]
        rec.finish_call(pending, outs, mutated, args=args, kwargs=kwargs)
        return out

    def record_failed(self, name: str, api: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      in_names: list[str], seq: int, exc: BaseException) -> None:
        """A Function call named before it ran (``record``) raised."""
        rec = self.rec
        with rec.lock, torch._C.DisableTorchFunction():
            rec.append_call(Call(
                name=name, api=api, module=rec.current_module, inputs=in_names, outputs=[],
                args=naming.short_args(args, kwargs), stack_id=rec.stack_table.capture(),
                parent=self.innermost(), kind="function", phase=rec.phase_of(name, "function", in_names, ()),
                seq=seq, error=f"{type(exc).__name__}: {exc}"))


_FunctionBase = torch.autograd.function.Function
_ORIGINAL_APPLY = _FunctionBase.__dict__["apply"]
_ACTIVE: Recorder | None = None


def _traced_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    rec = _ACTIVE
    original = _ORIGINAL_APPLY.__func__
    if rec is None or rec.closed or rec.paused or rec.stopped or rec.op_depth or not on_traced_thread(rec):
        return original(cls, *args, **kwargs)
    __tracebackhide__ = True  # an error raised on purpose reaches the program from here (see mode.py)
    try:
        return rec.functions.record(cls, original, args, kwargs)
    except Exception as exc:
        if isinstance(exc, RaisedOnPurpose):
            raise exc.with_traceback(None) from exc.__cause__
        raise


# ---- custom backward code: BackwardCFunction.apply runs a Function's backward (or vjp) -------------
# A backward the recorder started runs under a mode of the recorder (tracer.record.engine), on every
# engine thread: a custom Function's backward ops are recorded through it, as calls nested under
# the running grad node, with their stacks inside backward(). A backward it did not start (one
# the engine runs without going through torch functions) has no mode: one is put on around the
# custom code alone.
_ORIGINAL_BACKWARD_APPLY = BackwardCFunction.__dict__["apply"]


def _traced_backward_apply(self: Any, *args: Any) -> Any:
    rec = _ACTIVE
    top = top_recording_mode()
    if type(self).__name__ in COMPILED_BACKWARDS:
        if top is None:
            return _ORIGINAL_BACKWARD_APPLY(self, *args)
        off = ModeOff(top)
        try:
            return _ORIGINAL_BACKWARD_APPLY(self, *args)
        finally:
            off.restore()
    if rec is None or rec.closed or rec.paused or rec.stopped or not rec.in_backward or top is not None \
            or not on_traced_thread(rec):  # (another thread's own backward, run meanwhile)
        return _ORIGINAL_BACKWARD_APPLY(self, *args)
    with BackwardRecordingMode(rec):
        return _ORIGINAL_BACKWARD_APPLY(self, *args)


def install_apply_wrapper(rec: Recorder) -> None:
    global _ACTIVE
    _ACTIVE = rec
    _FunctionBase.apply = classmethod(_traced_apply)  # type: ignore[method-assign,assignment]
    BackwardCFunction.apply = _traced_backward_apply  # type: ignore[method-assign]


def uninstall_apply_wrapper(rec: Recorder) -> None:
    global _ACTIVE
    if _ACTIVE is rec:
        _ACTIVE = None
        _FunctionBase.apply = _ORIGINAL_APPLY  # type: ignore[method-assign]
        BackwardCFunction.apply = _ORIGINAL_BACKWARD_APPLY  # type: ignore[method-assign]


def active_recorder() -> Recorder | None:
    return _ACTIVE


def _stop_in_forked_child() -> None:
    """A process forked inside a traced block (DataLoader workers, ``os.fork``) records
    nothing: the trace, its file and its hashing threads are the parent's (the file is
    disowned by tracer.model.writer's own fork handler). Every hook and the mode see a closed,
    stopped recorder and pass through."""
    rec = _ACTIVE
    if rec is not None:
        rec.stopped = True
        rec.closed = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stop_in_forked_child)

