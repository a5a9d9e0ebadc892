"""Finding the first NaN and the first Inf, forward and backward, from a trace's stats.

Every tensor's stats carry NaN and Inf counts computed on its own device and fetched in one batch
at the end of the block, so checking costs no synchronisation per op. The analysis here is a pure
function of the trace data: it works on a live trace and on a loaded file alike.

NaN and Inf are hunted separately, because ``-inf`` is ordinary data in attention
(``masked_fill(mask, -inf)``, ``where(m, x, -inf)``) while a NaN almost never is. An Inf written
from a constant argument (an ``inf`` among the call's non-tensor arguments) is **intended**, and
so is one that only carries intended Infs on (``carries_intended_inf``: no more of them than the
inputs bring, and not reduced into one element); intended Infs are counted, never reported, and
never hide a NaN. Every other Inf is reported like a NaN.

The **origin** of a NaN is the first record whose outputs hold NaN while none of its inputs did:
the op that made it (an intended Inf among its inputs is allowed: ``-inf - -inf``; an unintended
one is where the NaN came from). The origin of an Inf is the first record whose outputs hold an
unintended Inf while its inputs held none (an intended one beside it does not count). Of a
phase's first NaN and first Inf, the one made first is its headline. When the inputs
already held the bad value (they came from outside the block, or an earlier phase) the first
record is a **propagation** and the report says so. Later records holding the same kind of bad
value are counted as contaminated, per module.

Calls nest: the ops inside a custom ``autograd.Function``'s forward come before the Function
call itself, and in backward the ops a grad node's own code ran (a custom ``backward()``) come
before the node's outputs; so the innermost op, with its line, is the one named.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tracer.analysis import reprs
from tracer.model import BackwardRun, Call, Frame, GradNode, NodeRun, TensorRecord, Trace, install_view
from tracer.model.display import all_finite, plural
from tracer.model.frames import stack_lines
from tracer.options import RaisedOnPurpose

# An inf among a call's argument text: "-inf", "inf", "fill_value=-inf", "[0.0, inf]".
_INF_CONSTANT = re.compile(r"(?<![\w.])-?inf(?![\w])")
FramesOf = Callable[[int | None], tuple[Frame, ...]]


@dataclass
class Anomaly:
    """The first NaN (``kind="nan"``) or unintended Inf (``kind="inf"``) of one phase and what
    it contaminated."""

    phase: str  # "forward" or "backward"
    tensor: str
    producer: str  # call or grad node name
    producer_kind: str  # API name or PyTorch node class
    module: str
    origin: bool  # True: inputs were free of it, this op made the value non-finite
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
    kind: str = "nan"
    node: str | None = None  # backward: the grad node whose own code (or hook) ran the producing call
    # An optimizer step made it from finite parameters and gradients, and its state (exp_avg...)
    # was not checked (a trace whose header says optimizer_state: false): it may come from there.
    state_unchecked: bool = False
    # Position among the phase's non-finite records (which of the first NaN and the first Inf
    # came first); not in the JSON, the analysis computes it again from the trace.
    order: int = field(default=0, compare=False)

    @property
    def what(self) -> str:
        return "NaN" if self.kind == "nan" else "Inf"

    def describe(self, full: bool = False, all_frames: bool = False) -> str:
        """The anomaly in a few lines: what, where, its stack (the user's frames and the innermost
        one, the rest folded; ``all_frames``: every frame), then what it contaminated (the count
        and the first and last module; ``full``: every module with its count, one a line)."""
        role = "origin" if self.origin else f"propagated from input(s) {', '.join(self.bad_inputs)}"
        if self.from_forward:
            role += " (its forward call already saw non-finite values: see the forward report)"
        if self.state_unchecked:
            role += f" ({reprs.STATE_UNCHECKED})"
        where = f"{self.producer} [{self.producer_kind}]"
        if self.node is not None:
            where += f" in the backward of {self.node}"
        lines = [f"first {self.what} in {self.phase}: {self.tensor} ({self.nan} NaN, {self.inf} Inf) made by "
                 f"{where} in module {self.module or '<root>'} — {role}"]
        lines += stack_lines(self.stack, all_frames)
        if self.contaminated:
            lines += _contaminated_lines(self, full)
        return "\n".join(lines)

    # One line in a REPL, a card in a notebook (tracer/analysis/reprs.py).
    def __repr__(self) -> str:
        return reprs.anomaly_repr(self)

    def _repr_html_(self) -> str:
        return reprs.anomaly_html(self)

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "kind": self.kind, "tensor": self.tensor, "producer": self.producer,
                "producer_kind": self.producer_kind, "module": self.module, "origin": self.origin,
                "nan": self.nan, "inf": self.inf, "bad_inputs": self.bad_inputs, "node": self.node,
                "contaminated": self.contaminated, "contaminated_by_module": self.contaminated_by_module,
                "backward_run": self.backward_run, "from_forward": self.from_forward,
                "state_unchecked": self.state_unchecked,
                "stack": [[f.file, f.line, f.function, f.code] for f in self.stack]}


def _contaminated_lines(a: Anomaly, full: bool) -> list[str]:
    """``then 171 more records with NaN in 51 modules, h.7.mlp.c_proj … lm_head``; with ``full``
    every module follows, one a line with its count, in the order they were reached."""
    mods = [m or "<root>" for m in a.contaminated_by_module]
    head = f"  then {plural(a.contaminated, 'more record')} with {a.what} in {plural(len(mods), 'module')}"
    if full:
        return [head + ":", *(f"    {m}: {n}" for m, n in zip(mods, a.contaminated_by_module.values()))]
    if len(mods) <= 3:
        return [head + " (" + ", ".join(f"{m}: {n}" for m, n in zip(mods, a.contaminated_by_module.values())) + ")"]
    return [f"{head}, {mods[0]} … {mods[-1]}"]


@dataclass
class ScalerOverflow:
    """A GradScaler step that found NaN/Inf in the gradients it unscaled and so skipped the
    optimizer step (``torch.amp.GradScaler``'s dynamic loss scaling; found from the trace's
    ``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_`` calls and the
    stats of their outputs)."""

    check: str  # the unscale call that found them
    update: str | None  # the scale update after it (None: not in the trace)
    scale_before: float | None
    scale_after: float | None

    def describe(self) -> str:
        scale = ""
        if self.scale_before is not None and self.scale_after is not None:
            scale = f" (loss scale {self.scale_before:.4g} -> {self.scale_after:.4g})"
        return (f"GradScaler found NaN/Inf in the gradients at {self.check} and skipped the optimizer "
                f"step{scale}: NaN/Inf in the scaled loss, its backward and the unscaled gradients is "
                "what an overflow of the loss scale makes, and the scaler handles it. A NaN or Inf "
                "before the loss is scaled, or an overflow at every step while the scale keeps "
                "falling, comes from the model.")

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "update": self.update, "scale_before": self.scale_before,
                "scale_after": self.scale_after}


UNSCALE_API = "torch._amp_foreach_non_finite_check_and_unscale_"
UPDATE_SCALE_API = "torch._amp_update_scale_"


def scaler_overflows(trace: Trace) -> list[ScalerOverflow]:
    """The GradScaler steps of ``trace`` that found NaN/Inf (their ``found_inf`` written as
    non-zero), in order. Needs the stats of ``found_inf`` (check_numerics, checksums)."""
    found: list[ScalerOverflow] = []
    tensors = trace.tensors
    for i, c in enumerate(trace.calls):
        if c.api != UNSCALE_API or len(c.inputs) < 2:
            continue
        # (grads, found_inf, inv_scale): found_inf's new version is among what the call wrote.
        found_inf = c.inputs[-2]
        written = next((m for m in c.mutated if tensors.get(m) is not None
                        and tensors[m].previous == found_inf), None)
        rec = tensors.get(written) if written is not None else None
        if rec is None or rec.stats is None or not rec.stats.max:
            continue
        update = next((u for u in trace.calls[i + 1:] if u.api == UPDATE_SCALE_API and written in u.inputs), None)
        before = after = None
        if update is not None and update.inputs and update.outputs:
            old, new = tensors.get(update.inputs[0]), tensors.get(update.outputs[0])
            before = old.stats.max if old is not None and old.stats is not None else None
            after = new.stats.max if new is not None and new.stats is not None else None
        found.append(ScalerOverflow(c.name, update.name if update is not None else None, before, after))
    return found


@dataclass
class NumericsReport:
    """The first NaN and the first unintended Inf of forward and of backward (None where there
    was none); ``intended_inf``: records whose Inf came from a constant (attention masks)."""

    forward_nan: Anomaly | None
    forward_inf: Anomaly | None
    backward_nan: Anomaly | None
    backward_inf: Anomaly | None
    checked: int  # tensors whose stats were available
    unchecked: int  # tensors without stats (not hashed: meta, sparse, uninitialised...; or stats off)
    intended_inf: int = 0
    # Values with NaN/Inf that no later value keeps (``dropped_values``): not reported.
    dropped: int = 0
    # GradScaler steps that found NaN/Inf and skipped the optimizer step (what the anomalies
    # may be: an overflow of the loss scale, which the scaler handles).
    scaler_overflows: list[ScalerOverflow] = field(default_factory=list)

    @property
    def forward(self) -> Anomaly | None:
        """The forward anomaly that matters most: the first non-finite value made, NaN or Inf
        (an unintended Inf that later turns into NaN, ``inf - inf``, is where it started)."""
        return _first(self.forward_nan, self.forward_inf)

    @property
    def backward(self) -> Anomaly | None:
        return _first(self.backward_nan, self.backward_inf)

    def anomalies(self) -> list[Anomaly]:
        """Every anomaly found, forward first, each phase's in the order they were made."""
        return [a for pair in ((self.forward_nan, self.forward_inf), (self.backward_nan, self.backward_inf))
                for a in _in_order(*pair)]

    @property
    def clean(self) -> bool:
        return not self.anomalies()

    def describe(self, full: bool = False, all_frames: bool = False) -> str:
        """Each anomaly's ``describe`` (forward then backward, NaN before Inf) or a line saying
        that a phase was clean; ``full``/``all_frames`` as for ``Anomaly.describe``."""
        if self.checked == 0:
            return "numerics: no tensor stats in this trace (record with check_numerics=True)"
        notes = []
        if self.intended_inf:
            notes.append(f"{plural(self.intended_inf, 'record')} with an intended Inf, e.g. -inf attention masks")
        if self.dropped:
            notes.append(f"{plural(self.dropped, 'record')} with NaN/Inf that no later value keeps: "
                         "cast to integers, selected away or masked by a softmax")
        tail = f" ({'; '.join(notes)})" if notes else ""
        if self.clean:
            if self.dropped:
                return f"numerics: no NaN or Inf kept among {self.checked} checked tensors{tail}"
            return f"numerics: {all_finite(self.checked)}{tail}"
        parts = []
        for phase, found in (("forward", (self.forward_nan, self.forward_inf)),
                             ("backward", (self.backward_nan, self.backward_inf))):
            present = [a.describe(full, all_frames) for a in _in_order(*found)]
            parts += present or [f"{phase}: no NaN, no unintended Inf"]
        parts += notes
        parts += [o.describe() for o in self.scaler_overflows]
        return "\n".join(parts)

    # One line in a REPL, cards in a notebook (tracer/analysis/reprs.py).
    def __repr__(self) -> str:
        return reprs.numerics_repr(self)

    def _repr_html_(self) -> str:
        return reprs.numerics_html(self)

    def full(self) -> str:
        """The whole report: every contaminated module with its count, every frame of each stack."""
        return self.describe(full=True, all_frames=True)

    def __str__(self) -> str:
        return self.describe()

    def to_json(self) -> dict[str, Any]:
        def j(a: Anomaly | None) -> dict[str, Any] | None:
            return None if a is None else a.to_json()
        return {"forward": j(self.forward), "backward": j(self.backward),
                "forward_nan": j(self.forward_nan), "forward_inf": j(self.forward_inf),
                "backward_nan": j(self.backward_nan), "backward_inf": j(self.backward_inf),
                "intended_inf": self.intended_inf, "dropped": self.dropped, "checked": self.checked,
                "unchecked": self.unchecked,
                "scaler_overflows": [o.to_json() for o in self.scaler_overflows]}


def _in_order(nan: Anomaly | None, inf: Anomaly | None) -> list[Anomaly]:
    """A phase's first NaN and first Inf, the one made first before the other."""
    found = [a for a in (nan, inf) if a is not None]
    return sorted(found, key=lambda a: a.order)


def _first(nan: Anomaly | None, inf: Anomaly | None) -> Anomaly | None:
    found = _in_order(nan, inf)
    return found[0] if found else None


def has_inf_constant(args: str) -> bool:
    """Whether a call's argument text holds an infinite constant (``masked_fill(m, -inf)``)."""
    return "inf" in args and _INF_CONSTANT.search(args) is not None


def carries_intended_inf(outs: list[tuple[int, int]], ins: list[tuple[int, int, bool]]) -> bool:
    """Whether a call whose outputs hold Infs only carries intended Infs of its inputs on.

    ``outs``: (Inf count, elements) of each output holding an Inf; ``ins``: (Inf count, elements,
    intended) of each input holding one. Every such input must be intended, no output may hold
    more Infs than its inputs bring (each input's count times how many times the output is
    larger: broadcasting a mask over heads), and no output may be a single element made from a
    larger input: a reduction that yields Inf did not drop the masked values (a loss of +inf
    from a target whose logit was masked, ``-masked.sum()``). Shared by the analysis and the
    ``raise_on_nonfinite`` guard, so both call the same Infs intended."""
    if not ins or not all(intended for _, _, intended in ins):
        return False
    for inf, numel in outs:
        if numel == 1 and any(n > 1 for _, n, _ in ins):
            return False
        if inf > sum(count * max(1, numel // max(n, 1)) for count, n, _ in ins):
            return False
    return True


def numel(rec: TensorRecord) -> int:
    """The elements of a recorded tensor (its shape's product)."""
    return math.prod(rec.shape)


def _nan(rec: TensorRecord | None) -> int:
    return rec.stats.nan if rec is not None and rec.stats is not None else 0


def _inf(rec: TensorRecord | None) -> int:
    return rec.stats.inf if rec is not None and rec.stats is not None else 0


def _bad(rec: TensorRecord | None) -> bool:
    return rec is not None and rec.stats is not None and not rec.stats.finite


class _Hunt:
    """The first NaN and first unintended Inf of one phase, and what came after each."""

    def __init__(self, phase: str, frames_of: FramesOf | None, dropped: set[str]) -> None:
        self.phase = phase
        self.frames_of = frames_of
        self.dropped = dropped  # values no later value keeps (dropped_values): not anomalies
        self.first: dict[str, Anomaly] = {}
        self.counts: dict[str, Counter[str]] = {"nan": Counter(), "inf": Counter()}
        self.seen = 0  # non-finite records met so far

    def stack(self, stack_id: int | None, recorded: tuple[Frame, ...]) -> tuple[Frame, ...]:
        return self.frames_of(stack_id) if self.frames_of is not None and not recorded else recorded

    def see(self, kind: str, module: str, make: Callable[[], Anomaly]) -> None:
        self.seen += 1
        if kind in self.first:
            self.counts[kind][module] += 1
        else:
            a = self.first[kind] = make()
            a.order = self.seen

    def result(self) -> tuple[Anomaly | None, Anomaly | None]:
        for kind, a in self.first.items():
            a.contaminated = sum(self.counts[kind].values())
            a.contaminated_by_module = dict(self.counts[kind])
        return self.first.get("nan"), self.first.get("inf")


def find_anomalies(trace: Trace, frames_of: FramesOf | None = None) -> NumericsReport:
    """Locate the first NaN and the first unintended Inf in forward and in backward.
    ``frames_of``: symbolises a stack id (a live trace whose stacks are not resolved yet)."""
    tensors = trace.tensors
    checked = 0
    nonfinite = False
    for r in tensors.values():
        stats = r.stats
        if stats is not None:
            checked += 1
            if stats.nan or stats.inf:
                nonfinite = True
    if not nonfinite:
        # The usual step: no NaN or Inf anywhere, so no walk of the calls can find one (the walk
        # cost 8.8 ms at the end of each check_numerics step of tiny12 on a 2-core CPU).
        return NumericsReport(None, None, None, None, checked, len(tensors) - checked)
    calls = {c.name: c for c in trace.calls}
    children: dict[str, list[Call]] = {}
    for c in trace.calls:
        if c.parent is not None:
            children.setdefault(c.parent, []).append(c)
    intended: set[str] = set()
    dropped = dropped_values(trace)
    fwd = _forward(trace, calls, children, intended, frames_of, dropped)
    bwd = _backward(trace, calls, children, intended, frames_of, dropped)
    return NumericsReport(*fwd, *bwd, checked, len(tensors) - checked, intended_inf=len(intended),
                          scaler_overflows=scaler_overflows(trace), dropped=len(dropped - intended))


# Calls whose finite output leaves a NaN or Inf of their input behind: selections, which keep
# some elements and replace the others (``torch.where(x > 0, torch.log(x), 0)``), and softmax,
# which reads ``-inf`` as a masked position (0): a mask made by adding two ``finfo.min`` masks
# overflows to ``-inf`` there (GPT-Neo's attention), and softmax drops it.
_SELECTING = frozenset({"torch.where", "Tensor.where", "torch.nan_to_num", "Tensor.nan_to_num",
                        "Tensor.nan_to_num_", "torch.masked_fill", "Tensor.masked_fill", "Tensor.masked_fill_",
                        "torch.softmax", "Tensor.softmax", "torch.nn.functional.softmax", "torch.special.softmax"})
_FLOATING = ("float", "bfloat", "complex")
_MAX_DEPTH = 64  # calls a dropped value may pass through first (deeper chains are reported)


def dropped_values(trace: Trace) -> set[str]:
    """The NaN/Inf-holding values that no later value keeps: every call that reads one makes
    only integer or boolean values (a cast, a comparison), finite values by selection
    (``where``, ``nan_to_num``, ``masked_fill``) or by a softmax (``-inf`` a masked position),
    or values that are dropped in turn. T5's
    relative position buckets take ``log(0) = -inf`` and cast it to integers, which ``where``
    then discards: made, never used. A value nothing reads (a loss) is not dropped."""
    tensors = trace.tensors
    readers: dict[str, list[Call]] = {}
    for c in trace.calls:
        for i in c.inputs:
            readers.setdefault(i, []).append(c)
    memo: dict[str, bool] = {}

    def dropped(name: str, depth: int) -> bool:
        if name not in memo:
            memo[name] = False  # (while it is being decided)
            users = readers.get(name, [])
            memo[name] = bool(users) and depth < _MAX_DEPTH and all(drops(c, depth) for c in users)
        return memo[name]

    def drops(c: Call, depth: int) -> bool:
        for o in [*c.outputs, *c.mutated]:
            r = tensors.get(o)
            if r is None or r.stats is None:
                return False
            if not r.dtype.startswith(_FLOATING):
                continue
            if not (r.stats.nan or r.stats.inf):
                if c.api in _SELECTING:
                    continue
                return False
            if not dropped(o, depth + 1):
                return False
        return True

    return {name for name, r in tensors.items()
            if r.stats is not None and (r.stats.nan or r.stats.inf) and name in readers and dropped(name, 0)}


def _post_order(roots: list[Call], children: dict[str, list[Call]]) -> Iterator[Call]:
    """Calls with the calls nested in them first (a Function after the ops inside it)."""
    for c in roots:
        kids = children.get(c.name)
        if kids:
            yield from _post_order(kids, children)
        yield c


def _check_call(hunt: _Hunt, trace: Trace, call: Call, intended: set[str], node: str | None = None,
                backward_run: str | None = None) -> None:
    """Look at one call's own outputs (and the versions it wrote) for NaN and Inf."""
    tensors = trace.tensors
    outs = [o for o in [*call.outputs, *call.mutated] if (r := tensors.get(o)) is not None and r.producer == call.name]
    nan_out = [o for o in outs if _nan(tensors[o]) and o not in hunt.dropped]
    inf_out = [o for o in outs if _inf(tensors[o])]
    if inf_out:
        inf_in = [i for i in call.inputs if _inf(tensors.get(i))]
        if has_inf_constant(call.args) or carries_intended_inf(
                [(_inf(tensors[o]), numel(tensors[o])) for o in inf_out],
                [(_inf(tensors[i]), numel(tensors[i]), i in intended) for i in inf_in]):
            intended.update(inf_out)
            inf_out = []
        inf_out = [o for o in inf_out if o not in hunt.dropped]  # (an intended Inf counts as intended)
    for kind, bad_out, count in (("nan", nan_out, _nan), ("inf", inf_out, _inf)):
        if not bad_out:
            continue

        def make(bad_out: list[str] = bad_out, count: Callable[[TensorRecord | None], int] = count,
                 kind: str = kind) -> Anomaly:
            rec = tensors[bad_out[0]]
            assert rec.stats is not None
            # A NaN made from an unintended Inf (inf - inf, inf * 0) started with that Inf.
            # An intended Inf among the inputs of an unintended one (an overflow next to a -inf
            # mask, a loss that kept a masked logit) is not where it came from.
            bad_in = [i for i in call.inputs if (count(tensors.get(i)) and not (kind == "inf" and i in intended))
                      or (kind == "nan" and i not in intended and _inf(tensors.get(i)))]
            return Anomaly(hunt.phase, rec.name, call.name, call.api, call.module, not bad_in, rec.stats.nan,
                           rec.stats.inf, hunt.stack(call.stack_id, call.stack), bad_in, kind=kind, node=node,
                           backward_run=backward_run,
                           state_unchecked=not bad_in and call.kind == "optimizer"
                           and trace.header.get("optimizer_state") is False)
        hunt.see(kind, call.module, make)


def _forward(trace: Trace, calls: dict[str, Call], children: dict[str, list[Call]], intended: set[str],
             frames_of: FramesOf | None, dropped: set[str]) -> tuple[Anomaly | None, Anomaly | None]:
    tensors = trace.tensors
    hunt = _Hunt("forward", frames_of, dropped)
    # Inside a custom Function whose own outputs are finite, a non-finite intermediate is the
    # Function's business (it did not escape), not an anomaly.
    sealed = {c.name for c in trace.calls
              if c.kind == "function" and not any(_bad(tensors.get(o)) for o in c.outputs)}
    roots = [c for c in trace.calls if c.phase == "forward" and (c.parent is None or c.parent not in calls)]
    for call in _post_order(roots, children):
        if call.phase == "forward" and not _inside(call.parent, calls, sealed):
            _check_call(hunt, trace, call, intended)
    return hunt.result()


def _inside(parent: str | None, calls: dict[str, Call], sealed: set[str]) -> bool:
    while parent is not None:
        if parent in sealed:
            return True
        call = calls.get(parent)
        parent = call.parent if call is not None else None
    return False


def _backward(trace: Trace, calls: dict[str, Call], children: dict[str, list[Call]], intended: set[str],
              frames_of: FramesOf | None, dropped: set[str]) -> tuple[Anomaly | None, Anomaly | None]:
    nodes = {n.name: n for n in trace.grad_nodes}
    hunt = _Hunt("backward", frames_of, dropped)
    hooked: set[str] = set()  # nodes whose hooks' calls were checked
    # A run a node's own code started (autograd.grad in a custom backward) ran inside that
    # node's step: walked there, before the node's outputs, not after the run it ran in.
    nested: dict[str, list[BackwardRun]] = {}
    for run in trace.backward_runs:
        if run.parent is not None and run.parent in nodes:
            nested.setdefault(run.parent, []).append(run)
    walked: set[str] = set()

    def walk(run: BackwardRun) -> None:
        walked.add(run.name)
        for step in run.steps:
            for sub in nested.pop(step.node, ()):
                walk(sub)
            _walk_step(hunt, trace, calls, children, intended, nodes, hooked, run, step, frames_of)

    for run in trace.backward_runs:
        if run.name not in walked and (run.parent is None or run.parent not in nodes):
            walk(run)
    for run in trace.backward_runs:  # (a parent whose step was not recorded)
        if run.name not in walked:
            walk(run)
    return hunt.result()


def _walk_step(hunt: _Hunt, trace: Trace, calls: dict[str, Call], children: dict[str, list[Call]],
               intended: set[str], nodes: dict[str, GradNode], hooked: set[str], run: BackwardRun,
               step: NodeRun, frames_of: FramesOf | None) -> None:
    """One node's run: its hooks' calls, its own code's calls, then what it produced."""
    node = nodes.get(step.node)
    call = calls.get(node.call) if node is not None and node.call else None
    module = call.module if call is not None else ""
    # The node's hooks ran first (a tensor hook on its forward output, a hook on a leaf):
    # their calls belong to the node without being its own code. (A node that runs in
    # several backward runs has its hooks' calls checked at its first run.)
    inner = [calls[c] for c in step.calls if c in calls]
    if step.node not in hooked:
        hooked.add(step.node)
        own = set(step.calls)
        inner[:0] = [c for c in children.get(step.node, ()) if c.name not in own]
    # Then the node's own code (a custom backward): the innermost op is the origin.
    for c in _post_order(inner, children):
        _check_call(hunt, trace, c, intended, node=step.node, backward_run=run.name)
    _check_step(hunt, trace, run.name, step, node, call, module, frames_of, intended)


def _check_step(hunt: _Hunt, trace: Trace, run: str, step: NodeRun, node: GradNode | None, call: Call | None,
                module: str, frames_of: FramesOf | None, intended: set[str]) -> None:
    tensors = trace.tensors
    for kind, count in (("nan", _nan), ("inf", _inf)):
        bad_in = [g for g in step.grads_in if g is not None and (
            count(tensors.get(g)) or (kind == "nan" and g not in intended and _inf(tensors.get(g))))]
        bad_out = [g for g in step.grads_out if g is not None and count(tensors.get(g))]
        # An accumulator (no outputs) that received a bad gradient still shows where it ended.
        if not bad_out and not (bad_in and kind not in hunt.first and not step.grads_out):
            continue

        def make(bad_in: list[str] = bad_in, bad_out: list[str] = bad_out, kind: str = kind) -> Anomaly:
            rec = tensors[(bad_out or bad_in)[0]]
            assert rec.stats is not None
            stack = node.stack if node is not None else ()
            if not stack and frames_of is not None and node is not None:
                stack = frames_of(node.stack_id)
            return Anomaly("backward", rec.name, step.node, node.kind if node else "?", module,
                           bool(bad_out) and not bad_in, rec.stats.nan, rec.stats.inf, stack, bad_in,
                           backward_run=run, kind=kind,
                           from_forward=call is not None and any(
                               _bad(tensors.get(t)) for t in [*call.inputs, *call.outputs]))
        hunt.see(kind, module, make)


class NonFiniteError(FloatingPointError, RaisedOnPurpose):
    """Raised by ``raise_on_nonfinite=True`` at the first NaN/Inf; ``.anomaly`` holds the report."""

    def __init__(self, anomaly: Anomaly) -> None:
        super().__init__(anomaly.describe())
        self.anomaly = anomaly


install_view("anomalies", find_anomalies)  # Trace.anomalies
