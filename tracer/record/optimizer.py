"""The recorder's optimizer side: ``optimizer.step()`` recorded as one call, from the parameters,
gradients and state to what it left behind (``optimizer_ops=True`` records every op inside)."""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any, NamedTuple

import torch

from tracer.options import RaisedOnPurpose
from tracer.record.calls import PendingCall
from tracer.record.identity import identity
from tracer.record.state import RecorderState
from tracer.record.tensors import (
    unique,
    version_of,
    versions_of,
)


class OpenStep(NamedTuple):
    """An optimizer step in progress, recorded as one call when it ends."""

    optimizer: Any
    frame: FrameType  # the frame running the step (torch's step wrapper), for step_running()
    call: PendingCall
    versions: list[int]  # of call.ins when the step began
    written: set[int]  # identities of the tensors the step writes, whatever their versions say


class OptimizerMixin(RecorderState):
    """Optimizer steps (part of ``Recorder``)."""

    # ---- optimizers ---------------------------------------------------------------------------
    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self.owner or self.closed or self.open_step is not None:
            return  # (an open step: an optimizer stepped from inside another's step is part of it)
        try:
            self._step_begins(optimizer, args, kwargs, sys._getframe(1))
        except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
            self.recorder_failed(exc)

    def _step_begins(self, optimizer: Any, args: Any, kwargs: Any, caller: FrameType) -> None:
        """An optimizer step begins (``caller``: the frame that runs it): name what it reads and
        open its record."""
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
        closure = (args[1] if len(args) > 1 else None) or (kwargs or {}).get("closure")
        if not (self.optimizer_ops or self.paused or self.stopped or closure is not None):
            # A closure (LBFGS) runs a forward and backward inside the step: those stay visible.
            self._open_step(optimizer, caller)
        # The step writes into parameters, gradients and state in place: every value waiting for
        # its checksum is read first, those the step's record has just named among them.
        self.hasher.before_write()

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
            with_state = self.optimizer_state
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
            with self.submits_batched():
                in_names = [self._name_at(t, v) for t, v in zip(ins, vers)]
            seq = self._call_seq
            self._call_seq += 1
            name = self.counters.next(cls.__name__)
            stack_id = self.stack_table.capture()
        tokens = [li.before_call() for li in self.listeners] if self.listeners else None
        # No sequence-number bracket: a step makes no grad nodes.
        call = PendingCall(f"{cls.__module__}.{cls.__qualname__}.step", cls.__name__, "optimizer", ins, in_names,
                           seq, None, tokens, name, stack_id)
        self.open_step = OpenStep(optimizer, frame, call, vers, written)
        self._step_depth = 0
        self.paused = True
        if optimizer not in self._step_hooked:
            # Per optimizer, so it runs before the global post-hooks (a step trace's boundary).
            self._step_hooked.add(optimizer)
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_post))

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        __tracebackhide__ = True  # (raise_on_nonfinite stops here at a NaN the step made)
        st = self.open_step
        if st is not None and st.optimizer is optimizer and threading.get_ident() == self.owner:
            try:
                self.close_step()
            except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
                if isinstance(exc, RaisedOnPurpose):  # raise_on_nonfinite: from here, not from below
                    raise exc.with_traceback(None) from exc.__cause__
                self.recorder_failed(exc)

    def step_running(self) -> bool:
        """Whether the open optimizer step is still running (its frame is on this thread's stack);
        False once it raised, which skipped its post-hook."""
        st = self.open_step
        if st is None:
            return False
        # Every op inside the step asks (a per-parameter step: thousands of times). They mostly
        # come from one loop at one depth below the step's frame: a look at that depth first,
        # one C call, and the walk only when it misses (the frame found there is the step's own,
        # so a hit is never wrong).
        depth = self._step_depth
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
                self._step_depth = depth
                return True
            f = f.f_back
            depth += 1
        return False

    def close_step(self, error: str | None = None) -> None:
        """End the open optimizer step: record it as one call (with ``error`` if it raised)."""
        st = self.open_step
        if st is None:
            return
        self.open_step = None
        self.paused = False
        optimizer = st.optimizer
        created: list[torch.Tensor] = []
        with self.lock, torch._C.DisableTorchFunction():
            # A step that raised wrote what its version counters say, no more can be known.
            written = st.written if error is None else set()
            now = versions_of(st.call.ins)
            mutated = [t for t, v, n in zip(st.call.ins, st.versions, now) if n != v or identity(t) in written]
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
                            if self.optimizer_state:
                                self._new_tensor(v, f"{owner}.{key}", "state", st.call.name)
                                created.append(v)
        # Its outputs are what it changed (as an in-place op returns its target) and what it made.
        call = self.finish_call(st.call, mutated + created, mutated)
        if error is not None:
            call.error = error
