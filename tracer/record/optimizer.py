"""Optimizer steps (a part of the recorder): ``optimizer.step()`` recorded as one call, from the
parameters, gradients and state to what it left behind (``optimizer_ops=True`` records every op
inside)."""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tracer.model.phases import CLOSURE_STEP_NOTE
from tracer.options import RaisedOnPurpose
from tracer.record.calls import PendingCall
from tracer.record.identity import identity
from tracer.record.mode import put_back, take_off_top, top_mode
from tracer.record.part import Part, remove_all
from tracer.record.tensors import (
    step_function_cell,
    unique,
    versions_of,
)

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder


class OpenStep(NamedTuple):
    """An optimizer step in progress, recorded as one call when it ends."""

    optimizer: Any
    frame: FrameType  # the frame running the step (torch's step wrapper), for step_running()
    call: PendingCall
    versions: list[int]  # of call.ins when the step began
    written: set[int]  # identities of the tensors the step writes, whatever their versions say


class OptimizerSteps(Part):
    """Optimizer steps (a part of ``Recorder``): ``optimizer.step()`` recorded as one call, unless
    ``optimizer_ops`` asks for every op inside it. Owns the step running now."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        options = rec.options
        # False: each optimizer.step() is one call (see _open_step); True: every op inside it.
        self._every_op = options.optimizer_ops
        # Whether a step's state tensors are its inputs and outputs (see TraceOptions).
        self._with_state = options.records_optimizer_state
        self.open: OpenStep | None = None  # the optimizer step running now, recorded as one call
        self._depth = 0  # where running() last found the open step's frame (0: not yet)
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._handles: list[Any] = []
        # The step wrapper's cell that holds a stand-in (see _run_without_mode) until the stand-in
        # runs, and the step function it held.
        self._swapped: Any = None
        self._swapped_func: Any = None

    def install(self) -> None:
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))

    def close_open(self) -> None:
        """Close a step still open (the block ended inside ``optimizer.step()``: it raised)."""
        if self.open is not None:
            try:
                self.close("optimizer.step() raised; its changes up to there are recorded")
            except Exception:  # recording must not stop the uninstall
                self.open = None

    def _restore_step_function(self) -> None:
        """Put back the step function whose stand-in was never called (a pre-hook after ours
        raised, or a frame that reads another cell: see _run_without_mode)."""
        if self._swapped is not None:
            self._swapped.cell_contents = self._swapped_func
            self._swapped = self._swapped_func = None

    def remove_hooks(self) -> None:
        self._restore_step_function()
        remove_all(self._handles)

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        rec = self.rec
        if threading.get_ident() != rec.owner or rec.closed or self.open is not None:
            return  # (an open step: an optimizer stepped from inside another's step is part of it)
        try:
            self._step_begins(optimizer, args, kwargs, sys._getframe(1))
        except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
            rec.recorder_failed(exc)

    def _step_begins(self, optimizer: Any, args: Any, kwargs: Any, caller: FrameType) -> None:
        """An optimizer step begins (``caller``: the frame that runs it): name what it reads and
        open its record."""
        rec = self.rec
        rec.names.name_step_inputs(optimizer)
        closure = (args[1] if len(args) > 1 else None) or (kwargs or {}).get("closure")
        if not (self._every_op or rec.paused or rec.stopped or closure is not None):
            self._open_step(optimizer, caller)
        elif closure is not None and not (self._every_op or rec.paused or rec.stopped):
            # A closure (LBFGS) runs a forward and backward inside the step: those stay visible,
            # and the trace says why there is no one optimizer call (once per class).
            note = CLOSURE_STEP_NOTE.format(cls=type(optimizer).__name__)
            if note not in rec.trace.notes:
                rec.trace.notes.append(note)
        # The step writes into parameters, gradients and state in place: every value waiting for
        # its checksum is read first, those the step's record has just named among them.
        rec.hasher.before_write()

    def _open_step(self, optimizer: Any, frame: FrameType) -> None:
        """Record ``optimizer.step()`` as one call: its inputs are the parameters, gradients and
        state; its outputs the new versions of what it changed and the state it created. The
        ops inside are not recorded (``optimizer_ops=True`` records them): a foreach AdamW step
        makes ~10 versions of every parameter and state tensor, which cost more to record than
        the rest of a step, and the values that matter are the ones the step leaves behind."""
        rec = self.rec
        cls = type(optimizer)
        # Hooks run outside the mode's handler, where every tensor attribute read (p.grad) would
        # go through the mode: hence DisableTorchFunction around all of this.
        with rec.lock, torch._C.DisableTorchFunction():
            tensors: list[torch.Tensor] = []
            # What the step writes: every parameter that has a gradient and that parameter's
            # state, and, when GradScaler passes its scale in (fused optimizers unscale in
            # place), the gradients too. Fused optimizers write all of it without bumping a
            # version counter, so the versions cannot tell.
            written: set[int] = set()
            unscales = getattr(optimizer, "grad_scale", None) is not None
            with_state = self._with_state
            for group in optimizer.param_groups:
                for p in group["params"]:
                    tensors.append(p)
                    g = p.grad
                    if g is not None:
                        tensors.append(g)
                        written.add(identity(p))
                        if unscales:
                            written.add(identity(g))
                    if not with_state:  # (named all the same, by _optimizer_pre: code that reads it later)
                        continue
                    for v in optimizer.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor):
                            tensors.append(v)
                            if g is not None:
                                written.add(identity(v))
            ins = unique(tensors)
            vers = versions_of(ins)
            # A fresh trace meets the optimizer's state here first: hundreds of values, whose
            # stats are computed together (Hasher.submit_many).
            in_names = rec.names.names_at(ins, vers)
            seq = rec.next_call_seq()
            name = rec.counters.next(cls.__name__)
            stack_id = rec.stack_table.capture()
        tokens = [li.before_call() for li in rec.listeners] if rec.listeners else None
        # No sequence-number bracket: a step makes no grad nodes.
        call = PendingCall(f"{cls.__module__}.{cls.__qualname__}.step", cls.__name__, "optimizer", ins, in_names,
                           seq, None, tokens, name, stack_id)
        self.open = OpenStep(optimizer, frame, call, vers, written)
        self._depth = 0
        rec.paused = True
        if optimizer not in self._hooked:
            # Per optimizer, so it runs before the global post-hooks (a step trace's boundary).
            self._hooked.add(optimizer)
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_post))
        self._run_without_mode(frame, type(optimizer).step)

    def _run_without_mode(self, frame: FrameType, step: Any) -> None:
        """Have the step function that ``frame`` (torch's step wrapper, its pre-hooks running)
        calls next run with the recording mode off the torch-function stack, and put the mode
        back the moment it returns or raises. Inside a step recorded as one call the mode has
        nothing to do, and an AdamW step over a ResNet-50 makes ~2,000 torch calls: each one
        handed to the mode cost ~2 µs (torch's dispatch to a Python mode, then its handler).

        The wrapper calls the step function through a closure cell shared by every optimizer of
        the class: it holds the stand-in below until the stand-in's first call, which puts the
        function back at once, so that a later or concurrent call (another thread, a nested
        step) is the plain one. Where the wrapper is not torch's known one, or the mode is not
        on top of the stack (a program's mode entered inside the block), the step runs as
        before: under the mode, its calls passed on one by one."""
        self._restore_step_function()  # (a stand-in an earlier step never called)
        cell = step_function_cell(frame, step)
        rec = self.rec
        if cell is None or top_mode() is not rec.mode:
            return
        func = cell.cell_contents

        def step_without_mode(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # (an error of the step: its traceback is the step's own)
            cell.cell_contents = func  # (only this call is the stand-in's)
            if self._swapped is cell:
                self._swapped = self._swapped_func = None
            if sys._getframe(1) is not frame or rec.closed or not take_off_top(rec.mode):
                return func(*args, **kwargs)  # (not the step that was opened: as it was)
            try:
                return func(*args, **kwargs)
            finally:
                put_back(rec.mode)

        cell.cell_contents = step_without_mode
        self._swapped = cell
        self._swapped_func = func

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        __tracebackhide__ = True  # (raise_on_nonfinite stops here at a NaN the step made)
        st = self.open
        if st is not None and st.optimizer is optimizer and threading.get_ident() == self.rec.owner:
            try:
                self.close()
            except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
                if isinstance(exc, RaisedOnPurpose):  # raise_on_nonfinite: from here, not from below
                    raise exc.with_traceback(None) from exc.__cause__
                self.rec.recorder_failed(exc)

    def running(self) -> bool:
        """Whether the open optimizer step is still running (its frame is on this thread's stack);
        False once it raised, which skipped its post-hook."""
        st = self.open
        if st is None:
            return False
        # Every op inside the step asks (a per-parameter step: thousands of times). They mostly
        # come from one loop at one depth below the step's frame: a look at that depth first,
        # one C call, and the walk only when it misses (the frame found there is the step's own,
        # so a hit is never wrong).
        depth = self._depth
        if depth:
            try:
                if sys._getframe(depth) is st.frame:
                    return True
            except ValueError:  # the stack is not that deep now
                pass
        f: FrameType | None = sys._getframe(1)
        depth = 1
        while f is not None:
            if f is st.frame:
                self._depth = depth
                return True
            f = f.f_back
            depth += 1
        return False

    def close(self, error: str | None = None) -> None:
        """End the open optimizer step: record it as one call (with ``error`` if it raised)."""
        st = self.open
        if st is None:
            return
        rec = self.rec
        self.open = None
        rec.paused = False
        marks = rec.marks()
        try:
            with rec.lock, torch._C.DisableTorchFunction():
                # A step that raised wrote what its version counters say, no more can be known.
                written = st.written if error is None else set()
                now = versions_of(st.call.ins)
                mutated = [t for t, v, n in zip(st.call.ins, st.versions, now) if n != v or identity(t) in written]
                created = rec.names.name_new_state(st.optimizer, st.call.name, self._with_state)
            # Its outputs are what it changed (as an in-place op returns its target) and what it
            # made; its arguments, the settings of its param groups (what a diff of two runs names
            # when the step read equal values and wrote different ones: the learning rate differs).
            call = rec.finish_call(st.call, mutated + created, mutated, kwargs=group_settings(st.optimizer))
        except BaseException as exc:  # (the state it named is taken back with the call)
            rec.take_back(marks, exc, st.call.api)
            raise
        if error is not None:
            call.error = error


# Settings of a param group that choose an implementation, not the arithmetic, or that a
# scheduler keeps for itself: not among a step's arguments.
_NOT_SETTINGS = frozenset({"params", "foreach", "fused", "capturable", "differentiable", "initial_lr"})


def group_settings(optimizer: Any) -> dict[str, Any]:
    """The settings of ``optimizer``'s param groups as a step's keyword arguments: numbers and
    tuples of them, and switches that are on (``amsgrad``, ``nesterov``); group 0's by their own
    name, group k's as ``g<k>.<name>``, every group's learning rate first. Every group's whole
    settings (not only where they differ from group 0's), so that two runs' steps compare
    setting by setting. A tensor setting (a capturable optimizer's ``lr``) is not read: that
    would wait for the device."""
    try:
        groups = [_settings_of(group) for group in optimizer.param_groups]
    except Exception:  # (not a torch optimizer's shape: no settings to show)
        return {}
    lrs: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for g, settings in enumerate(groups):
        prefix = f"g{g}." if g else ""
        for key, shown in settings.items():
            (lrs if key == "lr" else rest)[prefix + key] = shown
    return lrs | rest


def _settings_of(group: dict[str, Any]) -> dict[str, Any]:
    settings = {}
    for key, value in group.items():
        if isinstance(key, str) and key not in _NOT_SETTINGS:
            shown = _setting(value)
            if shown is not None:
                settings[key] = shown
    return settings


def _setting(value: Any) -> Any:
    if isinstance(value, bool):
        return True if value else None
    if isinstance(value, int | float):
        return value
    if isinstance(value, tuple) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return value
    if isinstance(value, torch.Tensor):
        return _TensorSetting(f"tensor{list(value.shape)}")
    return None


class _TensorSetting(str):
    """A tensor setting's text, shown bare (not quoted) among the arguments."""

    def __repr__(self) -> str:
        return str(self)
