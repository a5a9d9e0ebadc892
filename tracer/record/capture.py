"""The capture (a part of the recorder): what the hot path takes at each torch call, and what
cannot be recovered later.

At the call, ``PythonCapture`` takes the call's input tensors with their identities and version
counters (named at once, before the op can change them in place), autograd's sequence number
before the op (the start of the call's bracket), runs the op, then takes what it returned and
wrote (version counters compared, and what the op's schema says it writes), their ``grad_fn``,
the sequence number after it (the bracket's end: the grad nodes numbered inside it are this
call's) and the Python stack (``StackTable.capture``: interned frame ids; files, lines and
source text are read when the trace is saved).

The narrow interface to the rest of the recorder, which a native implementation of the same
part (an opt-in ``RecordFunction`` observer, with this one as the fallback) would call the same
way:

- ``TensorNames.name_inputs(ins, versions, short)`` (under the recorder's lock): the inputs'
  names, before the op runs;
- ``Recorder.record_captured(...)`` (under the lock, torch functions off): everything above,
  turned into names (``TensorNames.name_call_values``), linked grad nodes
  (``Graph.link_call_nodes``), checksums (the hasher, through the names) and a ``Call`` appended
  (``Recorder.append_call``, which the file format's stream writer reads from);
- ``Recorder.record_raised(...)``: a call whose op raised.

The runs of grad nodes are captured by the hooks the graph puts on them (``Graph.node_begin``,
``node_end``, ``node_done``), module scopes by the global module hooks (``ModuleScopes``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tracer.model import Call
from tracer.record.calls import CAPTURE_NOW
from tracer.record.effects import Writes
from tracer.record.identity import identity
from tracer.record.own_work import OWN_WORK
from tracer.record.part import Part
from tracer.record.tensors import (
    GRAD_FN,
    call_tensors,
    flat_tensors,
    get_seq,
    grad_fn_of,
    same_view,
    unique,
    versions_of,
)
from tracer.record.transforms import current_transform, unwrapped_grad_fns

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder


class PythonCapture(Part):
    """The capture of every torch call the recording mode hands over, in Python."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        self._trace = rec.trace
        self._names = rec.names

    def release(self) -> None:
        self.__dict__.pop("_names", None)
        super().release()

    def record_call(self, func: Any, api: str, short: str, kind: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any], writes: Writes | None = None) -> Any:
        # Three parts: before the op, the op, after it. A failure of gradtrace's own code
        # before or after stops the recording and leaves the op to run (tracer.record.failsafe);
        # the op's own exception is recorded and goes on to the program. The parts before and
        # after are gradtrace's own work, which no mode of the program's sees (OWN_WORK, see
        # tracer.record.own_work); the op runs under the modes the program called it under.
        rec = self.rec
        try:
            with OWN_WORK():
                before = self._before_call(api, short, kind, args, kwargs, writes)
        except Exception as exc:
            rec.recorder_failed(exc)
            return func(*args, **kwargs)
        ins, vers, in_names, seq, tokens, seq0, written = before
        rec.op_depth += 1
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            try:
                rec.record_raised(api, short, kind, args, kwargs, in_names, seq, exc)
            except Exception as own:
                rec.recorder_failed(own)
            raise
        finally:
            rec.op_depth -= 1
        try:
            with OWN_WORK():
                self._after_call(api, short, kind, args, kwargs, ins, vers, in_names, seq, seq0, tokens, written,
                                 out)
        except Exception as exc:  # (what it had recorded is taken back: see close)
            rec.recorder_failed(exc)
        return out

    def _before_call(self, api: str, short: str, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                     writes: Writes | None) -> tuple[list[torch.Tensor], list[int], list[str], int,
                                                     list[Any] | None, int | None, list[torch.Tensor] | None]:
        """Capture a call's inputs (identities and versions; named now, before the op can change
        them) and take its place, before the op runs."""
        rec = self.rec
        ins = call_tensors(args, kwargs)
        vers = versions_of(ins)
        # (torch's out= convention: an op writes its result into out=, whole, reading none of it)
        out_only = _out_only(args, kwargs) if kwargs and "out" in kwargs and kind in ("op", "custom_op") else None
        with rec.lock:
            in_names = self._names.name_inputs(ins, vers, short, out_only)
            seq = rec.call_seq
            rec.call_seq += 1
        listeners = rec.listeners
        tokens = [li.before_call() for li in listeners] if listeners else None
        seq0 = get_seq() if get_seq is not None else None
        # What the op's schema says this call writes (most schemas name an ``out=`` that the
        # call does not pass: then it writes nothing, and a call without keywords is not asked).
        written = writes.tensors(args, kwargs) if writes is not None and (writes.positions or kwargs) else None
        hasher = rec.hasher
        if hasher.active:
            # Tensors waiting for a checksum are read before a write: only those the write can
            # reach when the schema names every tensor written, else all of them.
            if kind != "op" or "out" in kwargs or kwargs.get("inplace") is True:
                hasher.before_write()
            elif written:
                hasher.before_write(written)
        return ins, vers, in_names, seq, tokens, seq0, written

    def _after_call(self, api: str, short: str, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                    ins: list[torch.Tensor], vers: list[int], in_names: list[str], seq: int, seq0: int | None,
                    tokens: list[Any] | None, written: list[torch.Tensor] | None, out: Any) -> None:
        """Record a call whose op has returned ``out``."""
        outs = [out] if type(out) is torch.Tensor else unique(flat_tensors(out))  # (the usual: one tensor)
        mutated: list[torch.Tensor] = []
        if ins:
            now = versions_of(ins)
            if written:  # what the op's schema says it writes, whatever the version counters say
                ids = {identity(t) for t in written}
                mutated = [t for t, v, n in zip(ins, vers, now) if n != v or identity(t) in ids]
            elif now != vers:  # one comparison in C for the usual call that changes nothing
                mutated = [t for t, v, n in zip(ins, vers, now) if n != v]
        if not outs and not mutated:
            return  # metadata queries and conversions: noise, not a call
        # The stack starts at the caller of the mode's handler: capture <- close <- _after_call <-
        # record_call <- RecordingMode.__torch_function__ <- the caller.
        self.close(api, short, kind, args, kwargs, ins, in_names, outs, mutated, seq, seq0, tokens=tokens, skip=5)

    def close(self, api: str, short: str, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              ins: list[torch.Tensor], in_names: list[str], outs: list[torch.Tensor], mutated: list[torch.Tensor],
              seq: int, seq0: int | None, name: str | None = None, tokens: list[Any] | None = None,
              stack_id: int | None = CAPTURE_NOW, skip: int = 2) -> Call:
        """Close a call that returned ``outs`` and wrote ``mutated``: what it produced, their
        grad_fn, the end of its sequence-number bracket and its stack are captured, then the
        recorder records it (``Recorder.record_captured``). ``skip``: where the stack capture
        starts, counted outwards from the capture's own frame (0); every frame it jumps must be
        the recorder's. Jumped frames are not read, and under an audit hook each read frame
        costs one (see tracer.record.identity). The caller has torch functions off (``OWN_WORK``:
        ``record_call``'s bracket, ``Recorder.finish_call``)."""
        rec = self.rec
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
            grad_fns = list(map(GRAD_FN, produced))
        except RuntimeError:  # a view made under no_grad whose base changed in place refuses it
            grad_fns = [grad_fn_of(t) for t in produced]
        if current_transform() is not None:  # (vmap: the graph is made on the plain tensors its wrappers hold)
            grad_fns = unwrapped_grad_fns(produced, grad_fns)
        seq1 = get_seq() if get_seq is not None else None
        trace = self._trace  # (rec.marks(), inlined: every recorded call passes here)
        marks = (len(trace.calls), len(trace.tensors), len(trace.grad_nodes))
        with rec.lock:  # (torch functions are off already: see the docstring)
            if stack_id == CAPTURE_NOW:
                stack_id = rec.stack_table.capture(skip)
            try:
                call = rec.record_captured(api, short, kind, args, kwargs, ins, in_names, outs, mutated, produced,
                                           grad_fns, seq, seq0, seq1, name, tokens, stack_id)
            except BaseException as exc:
                rec.take_back(marks, exc, api)
                raise
        if rec.on_records is not None:
            rec.on_records()
        return call

    def record_set_data(self, func: Any, api: str, short: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                        writes: Writes | None) -> Any:
        """``t.data = v``: from now on ``t`` shows ``v``'s bytes, its version counter unchanged
        (``Module.to``/``.half()``/``.float()`` on every parameter and its ``.grad``,
        ``vector_to_parameters``). Recorded as a call that writes ``t``: a new version of it,
        read again. Assigning ``t`` a view of its own bytes (``Module.to`` to the device and
        dtype it has already) changes nothing and is not recorded."""
        target = args[0] if args else None
        value = args[1] if len(args) > 1 else None
        try:
            with OWN_WORK():
                unchanged = not isinstance(target, torch.Tensor) or not isinstance(value, torch.Tensor) \
                    or value is target or same_view(target, value)
        except Exception as exc:  # gradtrace's own fault: see tracer.record.failsafe
            self.rec.recorder_failed(exc)
            return func(*args, **kwargs)
        if unchanged:
            return func(*args, **kwargs)
        return self.record_call(func, api, short, "op", args, kwargs, writes)


def _out_only(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """The identities of the tensors a call passes as ``out=`` and as no other argument (one it
    also reads, ``torch.add(a, b, out=a)``, is read before it is written)."""
    outs: list[torch.Tensor] = []
    flat_tensors(kwargs["out"], outs)
    if not outs:
        return set()
    others: list[torch.Tensor] = []
    flat_tensors(args, others)
    flat_tensors({k: v for k, v in kwargs.items() if k != "out"}, others)
    return set(map(identity, outs)) - set(map(identity, others))
