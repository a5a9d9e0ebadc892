"""Finding the first non-finite value (NaN or Inf), forward and backward, from a trace's stats.

Every tensor's stats carry NaN and Inf counts computed on its own device and fetched in one batch
at the end of the block, so checking costs no synchronisation per op. The analysis here is a pure
function of the trace data: it works on a live trace and on a loaded file alike.

The **origin** is the first record whose outputs are non-finite while all of its inputs were
finite: the op that made the bad value. When the inputs were already non-finite (they came from
outside the block, or an earlier phase) the first record is a **propagation** and the report says
so. Everything non-finite after the first one is counted as contaminated, per module.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.listeners import Listener
from tracer.model import Frame, TensorRecord, Trace


@dataclass
class Anomaly:
    """The first non-finite tensor of one phase and what it contaminated."""

    phase: str  # "forward" or "backward"
    tensor: str
    producer: str  # call or grad node name
    producer_kind: str  # API name or PyTorch node class
    module: str
    origin: bool  # True: inputs were finite, this op made the value non-finite
    nan: int
    inf: int
    stack: tuple[Frame, ...] = ()
    bad_inputs: list[str] = field(default_factory=list)
    contaminated: int = 0
    contaminated_by_module: dict[str, int] = field(default_factory=dict)
    backward_run: str | None = None
    # backward only: the node's forward call already had non-finite inputs or outputs, so the
    # backward values follow from the forward anomaly rather than from a faulty backward.
    from_forward: bool = False

    def describe(self) -> str:
        what = "NaN" if self.nan and not self.inf else "Inf" if self.inf and not self.nan else "NaN/Inf"
        role = "origin" if self.origin else f"propagated from non-finite input(s) {', '.join(self.bad_inputs)}"
        if self.from_forward:
            role += " (its forward call already saw non-finite values: see the forward report)"
        lines = [f"first {what} in {self.phase}: {self.tensor} ({self.nan} NaN, {self.inf} Inf) made by "
                 f"{self.producer} [{self.producer_kind}] in module {self.module or '<root>'} — {role}"]
        if self.stack:
            f = self.stack[-1]
            lines.append(f'  File "{f.file}", line {f.line}, in {f.function}')
            lines.append(f"    {f.code}")
        if self.contaminated:
            per = ", ".join(f"{m or '<root>'}: {n}" for m, n in sorted(self.contaminated_by_module.items()))
            lines.append(f"  then {self.contaminated} more non-finite record(s) ({per})")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "tensor": self.tensor, "producer": self.producer,
                "producer_kind": self.producer_kind, "module": self.module, "origin": self.origin,
                "nan": self.nan, "inf": self.inf, "bad_inputs": self.bad_inputs,
                "contaminated": self.contaminated, "contaminated_by_module": self.contaminated_by_module,
                "backward_run": self.backward_run, "from_forward": self.from_forward,
                "stack": [[f.file, f.line, f.function, f.code] for f in self.stack]}


@dataclass
class NumericsReport:
    """The first non-finite tensor in forward and in backward (None where all was finite)."""

    forward: Anomaly | None
    backward: Anomaly | None
    checked: int  # tensors whose stats were available
    unchecked: int  # tensors without stats (not hashed: meta, sparse, ...; or stats off)

    @property
    def clean(self) -> bool:
        return self.forward is None and self.backward is None

    def __str__(self) -> str:
        if self.checked == 0:
            return "numerics: no tensor stats in this trace (record with check_numerics=True)"
        if self.clean:
            return f"numerics: all {self.checked} checked tensors finite"
        parts = [a.describe() for a in (self.forward, self.backward) if a is not None]
        if self.forward is None:
            parts.insert(0, "forward: all finite")
        if self.backward is None:
            parts.append("backward: all finite")
        return "\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"forward": None if self.forward is None else self.forward.to_json(),
                "backward": None if self.backward is None else self.backward.to_json(),
                "checked": self.checked, "unchecked": self.unchecked}


def _bad(rec: TensorRecord | None) -> bool:
    return rec is not None and rec.stats is not None and not rec.stats.finite


def find_anomalies(trace: Trace) -> NumericsReport:
    """Locate the first non-finite tensor in forward and in backward."""
    tensors = trace.tensors
    checked = sum(1 for r in tensors.values() if r.stats is not None)
    forward = _first_forward(trace)
    backward = _first_backward(trace)
    return NumericsReport(forward, backward, checked, len(tensors) - checked)


def _first_forward(trace: Trace) -> Anomaly | None:
    tensors = trace.tensors
    first: Anomaly | None = None
    counts: Counter[str] = Counter()
    # Inside a custom Function whose own outputs are finite, a non-finite intermediate (the -inf
    # of an attention mask before softmax) is the Function's business, not an anomaly.
    by_name = {c.name: c for c in trace.calls}
    sealed: set[str] = set()
    for call in trace.calls:
        if call.kind == "function" and not any(_bad(tensors.get(o)) for o in call.outputs):
            sealed.add(call.name)
    for call in trace.calls:
        if call.phase != "forward" or _inside(call.parent, by_name, sealed):
            continue
        bad_out = [o for o in call.outputs if tensors.get(o) is not None and tensors[o].producer == call.name
                   and _bad(tensors[o])]
        if not bad_out:
            continue
        if first is None:
            rec = tensors[bad_out[0]]
            assert rec.stats is not None
            bad_in = [i for i in call.inputs if _bad(tensors.get(i))]
            first = Anomaly("forward", rec.name, call.name, call.api, call.module, not bad_in, rec.stats.nan,
                            rec.stats.inf, call.stack, bad_in)
        else:
            counts[call.module] += 1
    if first is not None:
        first.contaminated = sum(counts.values())
        first.contaminated_by_module = dict(counts)
    return first


def _inside(parent: str | None, calls: dict[str, Any], sealed: set[str]) -> bool:
    while parent is not None:
        if parent in sealed:
            return True
        call = calls.get(parent)
        parent = call.parent if call is not None else None
    return False


def _first_backward(trace: Trace) -> Anomaly | None:
    tensors = trace.tensors
    nodes = {n.name: n for n in trace.grad_nodes}
    calls = {c.name: c for c in trace.calls}
    first: Anomaly | None = None
    counts: Counter[str] = Counter()
    for run in trace.backward_runs:
        for step in run.steps:
            node = nodes.get(step.node)
            call = calls.get(node.call) if node is not None and node.call else None
            module = call.module if call is not None else ""
            bad_in = [g for g in step.grads_in if g is not None and _bad(tensors.get(g))]
            bad_out = [g for g in step.grads_out if g is not None and _bad(tensors.get(g))]
            if not bad_out and not (bad_in and first is None and not step.grads_out):
                continue
            if first is None:
                name = (bad_out or bad_in)[0]
                rec = tensors[name]
                assert rec.stats is not None
                origin = bool(bad_out) and not bad_in
                first = Anomaly("backward", name, step.node, node.kind if node else "?", module, origin,
                                rec.stats.nan, rec.stats.inf, node.stack if node else (), bad_in,
                                backward_run=run.name,
                                from_forward=call is not None and any(
                                    _bad(tensors.get(t)) for t in [*call.inputs, *call.outputs]))
            else:
                counts[module] += 1
    if first is not None:
        first.contaminated = sum(counts.values())
        first.contaminated_by_module = dict(counts)
    return first


class NonFiniteError(FloatingPointError):
    """Raised by ``raise_on_nonfinite=True`` at the first NaN/Inf; ``.anomaly`` holds the report."""

    def __init__(self, anomaly: Anomaly) -> None:
        super().__init__(anomaly.describe())
        self.anomaly = anomaly


class NonFiniteGuard(Listener):
    """Listener behind ``raise_on_nonfinite``: checks each output and gradient as it is made.

    Reading whether a tensor is finite synchronises with the device once per call: this mode is
    for hunting a NaN, not for routine runs (``check_numerics`` alone costs no sync per op).
    """

    def __init__(self, recorder: Any) -> None:
        self._recorder = recorder

    @staticmethod
    def _finite(tensors: Any) -> bool:
        for t in tensors:
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() \
                    and t.layout == torch.strided and not t.is_meta and not bool(torch.isfinite(t).all()):
                return False
        return True

    def _raise(self, trace: Trace, phase: str) -> None:
        self._recorder.hasher.drain(wait=True)
        report = find_anomalies(trace)
        anomaly = report.forward if phase == "forward" else report.backward
        if anomaly is not None:
            raise NonFiniteError(anomaly)

    def on_call(self, trace: Trace, call: Any, token: Any, outputs: list[torch.Tensor]) -> None:
        with torch._C.DisableTorchFunction():
            if not self._finite(outputs):
                self._raise(trace, "forward")

    def on_node_end(self, trace: Trace, node: str, step: Any, grads: tuple[Any, ...]) -> None:
        with torch._C.DisableTorchFunction():
            if not self._finite(grads):
                self._raise(trace, "backward")
