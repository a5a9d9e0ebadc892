"""``raise_on_nonfinite``: stop at the first NaN or unintended Inf, where it is made."""

from __future__ import annotations

from typing import Any

import torch

from tracer.analysis.numerics import NonFiniteError, find_anomalies, numel
from tracer.analysis.rules import carries_intended_inf, has_inf_constant
from tracer.model import Trace
from tracer.record.listeners import Listener
from tracer.record.own_work import own_work
from tracer.record.protocol import RecorderAPI
from tracer.record.transforms import transforms_off, unwrap


class NonFiniteGuard(Listener):
    """Listener behind ``raise_on_nonfinite``: checks each output and gradient as it is made, by
    the rules of ``find_anomalies`` (a NaN always, an Inf unless intended).

    Reading whether a tensor is finite synchronises with the device once per call: this mode is
    for hunting a NaN, not for routine runs (``check_numerics`` alone costs no sync per op).
    """

    def __init__(self, recorder: RecorderAPI) -> None:
        self._recorder = recorder
        self._intended: set[str] = set()  # tensors whose Inf is intended (see the module docstring)

    @staticmethod
    @own_work  # no mode of the user's sees these reads
    def _nonfinite(tensors: Any) -> tuple[bool, bool]:
        """(any NaN, any Inf) among the tensors, in one device read per tensor."""
        nan = inf = False
        with transforms_off():  # a torch.func tensor is read through what it wraps (vmap: the batch)
            for t in tensors:
                if not isinstance(t, torch.Tensor):
                    continue
                plain, _ = unwrap(t)
                if plain is not None and (plain.is_floating_point() or plain.is_complex()) and plain.numel() \
                        and plain.layout == torch.strided and not plain.is_meta \
                        and type(plain) in (torch.Tensor, torch.nn.Parameter):
                    a, b = torch.stack((torch.isnan(plain).any(), torch.isinf(plain).any())).tolist()
                    nan, inf = nan or bool(a), inf or bool(b)
        return nan, inf

    def _raise(self, trace: Trace) -> None:
        """Stop with the story so far: its headline is the value just met (the first of the step)."""
        rec = self._recorder
        rec.hasher.drain(wait=True)
        report = find_anomalies(trace, rec.stack_table.frames_of, open_block=True)
        if report.headline is not None:
            raise NonFiniteError(report.headline, report)

    def on_call(self, trace: Trace, call: Any, token: Any, outputs: list[torch.Tensor]) -> None:
        with torch._C.DisableTorchFunction():
            nan, inf = self._nonfinite(outputs)
        if inf and not nan and (has_inf_constant(call.args) or self._carries_intended(trace, call)):
            # An Inf from a constant, or carried on from one.
            self._intended.update([*call.outputs, *call.mutated])
            return
        if (nan or inf) and not self._recorder.function_depth:
            # Inside a custom Function's forward a NaN/Inf is the Function's business until its
            # own outputs show it (a fully masked row's softmax, selected away before it returns):
            # the outermost Function's outputs decide, as in the analysis; its report then names
            # the innermost op that made it.
            self._raise(trace)

    def _carries_intended(self, trace: Trace, call: Any) -> bool:
        """Whether the call's Infs only carry intended ones on, by the analysis's rule
        (``carries_intended_inf``), from the counts in the records' stats: read now (a wait for
        the checksums queued so far, paid only by a call that made an Inf)."""
        self._recorder.hasher.drain(wait=True)
        tensors = trace.tensors
        outs = [(r.stats.inf, numel(r)) for o in [*call.outputs, *call.mutated]
                if (r := tensors.get(o)) is not None and r.producer == call.name and r.stats is not None
                and r.stats.inf]
        if not outs:  # no stats for them (a kind that is not hashed): carried on from any intended input
            return any(i in self._intended for i in call.inputs)
        ins = [(r.stats.inf, numel(r), i in self._intended) for i in call.inputs
               if (r := tensors.get(i)) is not None and r.stats is not None and r.stats.inf]
        return carries_intended_inf(outs, ins)

    def on_node_end(self, trace: Trace, node: str, step: Any, grads: tuple[Any, ...]) -> None:
        with torch._C.DisableTorchFunction():
            nan, inf = self._nonfinite(grads)
        if nan or inf:
            self._raise(trace)
