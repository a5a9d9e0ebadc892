"""The story of a step's NaN or Inf: where it was made, what it reached, and what is not a fault.

Every tensor's stats carry NaN and Inf counts computed on its own device and fetched in one batch
at the end of the block, so checking costs no synchronisation per op. The analysis here is a pure
function of the trace data: it works on a live trace and on a loaded file alike, and it is the
one place a headline is decided: ``t.anomalies``, ``NonFiniteError``, the ``NumericsWarning``,
``gradtrace summary``/``show``, the HTML report, the notebook card, the watch and the memory and
diff headlines all render the ``NumericsReport`` made here.

The step is walked in execution order across its three phases (tracer.model.phases): the forward
and optimizer calls by their place in the step, each backward run where it began, its nodes in
the order the engine ran them (the calls a node's own code made first: the innermost op, with
its line, is the one named). The **headline** is the first non-finite value met:

- an **origin** when the call or node made it from finite inputs (an intended Inf among its
  inputs is allowed: ``-inf - -inf``; a NaN made from an unintended Inf started with that Inf);
- an **arrival** when its inputs already held it and came from outside the step (a NaN in the
  data batch, a parameter loaded with NaN): nothing in the step made it.

What came after it is **propagation**: a count and a range (phases and modules), never a list.
NaN and Inf are hunted separately, because ``-inf`` is ordinary data in attention. Which Infs are
**intended** (counted, never a headline) and which values are **dropped** (no later value keeps
them: counted, not reported) is decided by the named rules of ``tracer.analysis.rules``. A
GradScaler step that found the scaled gradients overflowed makes the story "skipped step, not a
bug" when the headline is where such an overflow shows.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any

from tracer.analysis import reprs
from tracer.analysis.rules import (
    FLOATING_DTYPES,
    MAX_DROP_DEPTH,
    carries_intended_inf,
    has_inf_constant,
    keeps_finite_by_selection,
)
from tracer.model import BackwardRun, Call, Frame, GradNode, NodeRun, TensorRecord, Trace, install_view
from tracer.model.display import all_finite, clip, phase_key, plural
from tracer.model.frames import short_line, stack_lines, user_frame
from tracer.model.phases import stepped_with_closure
from tracer.model.records import OWNED_ROLES
from tracer.options import RaisedOnPurpose

FramesOf = Callable[[int | None], tuple[Frame, ...]]
PHASE_NAMES = ("forward", "backward", "optimizer")
_LISTED_INPUTS = 2  # bad inputs named in a line; the rest counted ("… and 40 more")


@dataclass
class Anomaly:
    """The first NaN (``kind="nan"``) or unintended Inf (``kind="inf"``) of one phase."""

    phase: str  # "forward", "backward" or "optimizer"
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
    # Not made in the step: the inputs that held it came from outside the traced block (data, a
    # parameter that held it already).
    arrived: bool = False
    # Gradient accumulation: which micro-batch (1-based) of ``micro_batches`` it was met in (None
    # when the step ran one backward, and in the optimizer phase).
    micro_batch: int | None = None
    micro_batches: int = 1
    # A block that holds several optimizer steps: which step (1-based) of ``steps`` it was met in
    # (None when it holds one); its micro-batches are counted within that step. ``steps`` and
    # ``micro_batches`` are 0 where the block had not ended (``raise_on_nonfinite`` stops it at
    # the value: the count so far is known, the total is not).
    step: int | None = None
    steps: int = 1
    # Met after the block's last optimizer step (``step`` of ``steps``) and before any backward of
    # another: an evaluation or logging after the training step.
    after_step: bool = False
    # Position in the step's execution order among the non-finite values (1: the first met); not
    # in the JSON, the analysis computes it again from the trace.
    order: int = field(default=0, compare=False)

    @property
    def what(self) -> str:
        return "NaN" if self.kind == "nan" else "Inf"

    @property
    def line(self) -> Frame | None:
        """The user's line that made it (the innermost user frame of its stack)."""
        return user_frame(self.stack)

    def where(self) -> str:
        """``backward (micro-batch 2 of 3), in the backward of Attn0/AttnBackward, module h.0.attn``
        (no module for an optimizer-phase call outside every module)."""
        text = self.phase
        where = []
        if self.step is not None:
            where.append(("after " if self.after_step else "") + f"step {self.step}"
                         + (f" of {self.steps}" if self.steps else ""))
        if self.micro_batch is not None:
            where.append(f"micro-batch {self.micro_batch}" + (f" of {self.micro_batches}" if self.micro_batches else ""))
        if where:
            text += f" ({', '.join(where)})"
        if self.node is not None:
            text += f", in the backward of {self.node}"
        if not self.module and self.phase == "optimizer":  # (outside every module, as optimizers are)
            return text
        return f"{text}, module {self.module or '<root>'}"

    def headline(self) -> str:
        """The anomaly in one line, in the words every surface uses:
        ``NaN made by div4 (torch.div) in backward, …, module h.0.attn — attn.py:42: w = a / b``."""
        by = f"{self.producer} ({self.producer_kind})"
        if self.origin:
            text = f"{self.what} made by {by} in {self.where()}"
        elif self.arrived:
            text = (f"{self.what} arrived from outside the step in {_inputs_text(self.bad_inputs)}, first read by "
                    f"{by} in {self.where()}")
        else:
            source = _inputs_text(self.bad_inputs) if self.bad_inputs or not self.from_forward \
                else "the values of its forward call"
            text = f"{self.what} in {self.phase} first at {by}, carried from {source}"
            if self.node is not None or self.module:
                text = f"{text}; {self.where().split(', ', 1)[-1]}"
        line = self.line
        return f"{text} — {short_line(line)}" if line is not None else text

    def notes(self) -> list[str]:
        """What qualifies the headline (said under it)."""
        notes = []
        if self.from_forward:
            notes.append("its forward call already saw non-finite values: the backward follows from the forward")
        if self.state_unchecked:
            notes.append(reprs.STATE_UNCHECKED)
        return notes

    def describe(self, full: bool = False, all_frames: bool = False) -> str:
        """The headline, its notes and its stack (the user's frames and the innermost one, the rest
        folded; ``all_frames``: every frame); with ``full``, what its phase's same kind reached,
        module by module."""
        lines = [self.headline(), *(f"  ({n})" for n in self.notes())]
        lines += stack_lines(self.stack, all_frames)
        if full and self.contaminated:
            lines.append(f"  then {plural(self.contaminated, 'more value')} with {self.what} in {self.phase}, in "
                         f"{plural(len(self.contaminated_by_module), 'module')}:")
            lines += [f"    {m or '<root>'}: {n}" for m, n in self.contaminated_by_module.items()]
        return "\n".join(lines)

    # One line in a REPL, a card in a notebook (tracer/analysis/reprs.py).
    def __repr__(self) -> str:
        return reprs.anomaly_repr(self)

    def _repr_html_(self) -> str:
        return reprs.anomaly_html(self)

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "kind": self.kind, "tensor": self.tensor, "producer": self.producer,
                "producer_kind": self.producer_kind, "module": self.module, "origin": self.origin,
                "arrived": self.arrived, "nan": self.nan, "inf": self.inf, "bad_inputs": self.bad_inputs,
                "node": self.node, "contaminated": self.contaminated,
                "contaminated_by_module": self.contaminated_by_module, "backward_run": self.backward_run,
                "from_forward": self.from_forward, "state_unchecked": self.state_unchecked,
                "micro_batch": self.micro_batch, "micro_batches": self.micro_batches,
                "step": self.step, "steps": self.steps, "after_step": self.after_step,
                "headline": self.headline(),
                "stack": [[f.file, f.line, f.function, f.code] for f in self.stack]}


def _inputs_text(names: list[str]) -> str:
    """``x@grad``, ``a and b``, ``42 inputs (h.0.w@grad, h.0.b@grad, … lm_head.w@grad)``."""
    shown = [clip(n, 60) for n in names]
    if len(shown) <= _LISTED_INPUTS:
        return " and ".join(shown) or "its inputs"
    return f"{len(shown)} inputs ({', '.join(shown[:_LISTED_INPUTS])}, … {shown[-1]})"


@dataclass
class Spread:
    """What the headline's value reached after it: how many values, per phase, in which modules
    (in the order they were reached)."""

    count: int = 0
    by_phase: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)  # "phase:module" -> count, in order met
    nan: bool = False
    inf: bool = False

    def add(self, phase: str, module: str, nan: bool, inf: bool) -> None:
        self.count += 1
        self.by_phase[phase] = self.by_phase.get(phase, 0) + 1
        key = f"{phase}:{module}"
        self.by_module[key] = self.by_module.get(key, 0) + 1
        self.nan = self.nan or nan
        self.inf = self.inf or inf

    @property
    def what(self) -> str:
        return "NaN or Inf" if self.nan and self.inf else "NaN" if self.nan else "Inf"

    def line(self) -> str:
        """``then 862 more values with NaN (forward 171, backward 691), in 140 modules, from
        transformer.h.7.mlp.c_proj (forward) to transformer.wte (backward)``."""
        phases = ""
        if len(self.by_phase) > 1:
            ordered = sorted(self.by_phase.items(), key=lambda kv: phase_key(kv[0]))
            phases = " (" + ", ".join(f"{p} {n:,}" for p, n in ordered) + ")"
        modules = {k.split(":", 1)[1] for k in self.by_module}
        keys = list(self.by_module)
        first, last = _module_at(keys[0]), _module_at(keys[-1])
        where = f"in {first}" if len(keys) == 1 else \
            f"in {plural(len(modules), 'module')}, from {first} to {last}"
        return f"then {plural(self.count, 'more value')} with {self.what}{phases}, {where}"

    def full_lines(self) -> list[str]:
        return [f"    {_module_at(k)}: {n}" for k, n in self.by_module.items()]

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "by_phase": self.by_phase, "by_module": self.by_module}


def _module_at(key: str) -> str:
    phase, module = key.split(":", 1)
    if not module and phase == "optimizer":
        return "the optimizer phase"
    return f"{module or '<root>'} ({phase})"


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
    scale: str | None = None  # the scale tensor's name (the loss was multiplied by it)

    def headline(self) -> str:
        """``GradScaler skipped the optimizer step: … (loss scale 65536 -> 32768)``."""
        scale = ""
        if self.scale_before is not None and self.scale_after is not None:
            scale = f" (loss scale {self.scale_before:.4g} -> {self.scale_after:.4g})"
        return (f"GradScaler skipped the optimizer step: the scaled gradients overflowed, found at "
                f"{self.check}{scale}. Not a bug: the scaler lowers the scale and goes on")

    def describe(self) -> str:
        return (f"{self.headline()}. NaN/Inf in the scaled loss, its backward and the unscaled gradients is "
                "what an overflow of the loss scale makes; a NaN or Inf before the loss is scaled, or an "
                "overflow at every step while the scale keeps falling, comes from the model.")

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
        scale = None
        if update is not None and update.inputs and update.outputs:
            scale = update.inputs[0]
            old, new = tensors.get(update.inputs[0]), tensors.get(update.outputs[0])
            before = old.stats.max if old is not None and old.stats is not None else None
            after = new.stats.max if new is not None and new.stats is not None else None
        found.append(ScalerOverflow(c.name, update.name if update is not None else None, before, after, scale))
    return found


@dataclass
class NumericsReport:
    """The story of a step's NaN/Inf (see the module docstring): ``headline`` (the first value
    made non-finite, or that arrived so), what it reached (``spread``), and per phase the first NaN
    and the first unintended Inf (``forward_nan`` … ``optimizer_inf``; None where there was none)."""

    forward_nan: Anomaly | None
    forward_inf: Anomaly | None
    backward_nan: Anomaly | None
    backward_inf: Anomaly | None
    checked: int  # tensors whose stats were available
    unchecked: int  # tensors without stats (not hashed: meta, sparse, uninitialised...; or stats off)
    intended_inf: int = 0
    # Values with NaN/Inf that no later value keeps (``dropped_values``): not reported.
    dropped: int = 0
    # GradScaler steps that found NaN/Inf and skipped the optimizer step.
    scaler_overflows: list[ScalerOverflow] = field(default_factory=list)
    optimizer_nan: Anomaly | None = None
    optimizer_inf: Anomaly | None = None
    spread: Spread = field(default_factory=Spread)
    # Which values hold an unintended NaN/Inf the report counts (reported or reached), so that
    # every surface marks the same ones (the report's badges); and which an intended Inf only.
    nonfinite_values: list[str] = field(default_factory=list, repr=False)
    intended_values: list[str] = field(default_factory=list, repr=False)
    # The GradScaler overflow that explains the headline, when one does (the headline is in the
    # backward or the optimizer phase, where the scaled gradients are, or is the loss's scaling):
    # the story is then a skipped step, not a fault.
    skipped_step: ScalerOverflow | None = None

    # ---- the story -----------------------------------------------------------------------------
    @property
    def headline(self) -> Anomaly | None:
        """The first value made non-finite (an origin), or that arrived non-finite from outside the
        step, in execution order across the phases; None when the step is clean."""
        found = self.anomalies()
        return min(found, key=lambda a: a.order) if found else None

    @property
    def origin(self) -> Anomaly | None:
        """The headline when the step made it (None when it arrived from outside, or none)."""
        h = self.headline
        return h if h is not None and h.origin else None


    def headline_text(self) -> str:
        """The verdict in one line, the words every surface uses."""
        if self.checked == 0:
            return "numerics: no tensor stats in this trace (record with check_numerics=True)"
        skipped = self.skipped_step
        if skipped is not None:
            return skipped.headline()
        h = self.headline
        if h is not None:
            return h.headline()
        if self.dropped or self.intended_inf:
            return f"numerics: no NaN or unintended Inf kept among {plural(self.checked, 'checked tensor')}"
        return f"numerics: {all_finite(self.checked)}"

    # ---- per phase -----------------------------------------------------------------------------
    @property
    def forward(self) -> Anomaly | None:
        """The forward anomaly that matters most: the first non-finite value made, NaN or Inf
        (an unintended Inf that later turns into NaN, ``inf - inf``, is where it started)."""
        return _first(self.forward_nan, self.forward_inf)

    @property
    def backward(self) -> Anomaly | None:
        return _first(self.backward_nan, self.backward_inf)

    @property
    def optimizer(self) -> Anomaly | None:
        return _first(self.optimizer_nan, self.optimizer_inf)

    def phase(self, name: str) -> Anomaly | None:
        """The first anomaly of phase ``name`` (``forward``, ``backward``, ``optimizer``)."""
        return {"forward": self.forward, "backward": self.backward, "optimizer": self.optimizer}.get(name)

    def anomalies(self) -> list[Anomaly]:
        """Every phase's first NaN and first unintended Inf, in the order they were met."""
        found = [a for a in (self.forward_nan, self.forward_inf, self.backward_nan, self.backward_inf,
                             self.optimizer_nan, self.optimizer_inf) if a is not None]
        return sorted(found, key=lambda a: a.order)

    @property
    def clean(self) -> bool:
        return not self.anomalies()

    # ---- text ----------------------------------------------------------------------------------
    def notes(self) -> list[str]:
        """What the step holds that is not a fault: intended Infs, dropped values."""
        notes = []
        if self.intended_inf:
            notes.append(f"{plural(self.intended_inf, 'value')} with an intended Inf (-inf masks), not a fault")
        if self.dropped:
            notes.append(f"{plural(self.dropped, 'value')} with NaN/Inf that no later value keeps: "
                         "cast to integers, selected away or masked by a softmax")
        return notes

    def describe(self, full: bool = False, all_frames: bool = False) -> str:
        """The story: the headline, its stack (folded unless ``all_frames``), what it reached (a
        count and a range; ``full``: every module, then every phase's first NaN/Inf), then what is
        not a fault."""
        if self.checked == 0:
            return self.headline_text()
        h = self.headline
        if h is None:
            tail = "; ".join(self.notes())
            return self.headline_text() + (f" ({tail})" if tail else "")
        lines = []
        skipped = self.skipped_step
        if skipped is not None:
            lines.append(skipped.describe())
        lines.append(h.describe(all_frames=all_frames))
        if self.spread.count:
            lines.append("  " + self.spread.line() + (":" if full else ""))
            if full:
                lines += self.spread.full_lines()
        if full:
            for a in self.anomalies():
                if a is not h:
                    lines.append(f"first in {a.phase}: {a.describe(all_frames=all_frames)}")
        lines += self.notes()
        lines += [o.describe() for o in self.scaler_overflows if o is not skipped]
        return "\n".join(lines)

    # One line in a REPL, cards in a notebook (tracer/analysis/reprs.py).
    def __repr__(self) -> str:
        return reprs.numerics_repr(self)

    def _repr_html_(self) -> str:
        return reprs.numerics_html(self)

    def full(self) -> str:
        """The whole report: every module reached, every phase's first NaN/Inf, every frame."""
        return self.describe(full=True, all_frames=True)

    def __str__(self) -> str:
        return self.describe()

    def to_json(self) -> dict[str, Any]:
        def j(a: Anomaly | None) -> dict[str, Any] | None:
            return None if a is None else a.to_json()
        skipped = self.skipped_step
        return {"headline": j(self.headline), "headline_text": self.headline_text(),
                "skipped_step": None if skipped is None else skipped.to_json(),
                "spread": self.spread.to_json(),
                "forward": j(self.forward), "backward": j(self.backward), "optimizer": j(self.optimizer),
                "forward_nan": j(self.forward_nan), "forward_inf": j(self.forward_inf),
                "backward_nan": j(self.backward_nan), "backward_inf": j(self.backward_inf),
                "optimizer_nan": j(self.optimizer_nan), "optimizer_inf": j(self.optimizer_inf),
                "intended_inf": self.intended_inf, "dropped": self.dropped, "checked": self.checked,
                "unchecked": self.unchecked,
                "scaler_overflows": [o.to_json() for o in self.scaler_overflows]}


def _first(nan: Anomaly | None, inf: Anomaly | None) -> Anomaly | None:
    found = [a for a in (nan, inf) if a is not None]
    return min(found, key=lambda a: a.order) if found else None


def numel(rec: TensorRecord) -> int:
    """The elements of a recorded tensor (its shape's product)."""
    return math.prod(rec.shape)


def _nan(rec: TensorRecord | None) -> int:
    return rec.stats.nan if rec is not None and rec.stats is not None else 0


def _inf(rec: TensorRecord | None) -> int:
    return rec.stats.inf if rec is not None and rec.stats is not None else 0


def _bad(rec: TensorRecord | None) -> bool:
    return rec is not None and rec.stats is not None and not rec.stats.finite


# ---- dropped values (rules integer-output, selection, softmax-of-mask, dropped-in-turn) ---------------
def dropped_values(trace: Trace) -> set[str]:
    """The NaN/Inf-holding values that no later value keeps: every call that reads one makes
    only integer or boolean values, finite values by selection or by a softmax, or values that
    are dropped in turn (tracer.analysis.rules). A value nothing reads (a loss) is not dropped,
    nor one the program keeps past the block (``outliving_values``), nor what only those keep."""
    tensors = trace.tensors
    readers: dict[str, list[Call | NodeRun]] = {}
    for c in trace.calls:
        for i in c.inputs:
            readers.setdefault(i, []).append(c)
    # A gradient is read by the grad nodes it flows into (rule selection-in-backward):
    # ReluBackward0 zeroes the +Inf that SqrtBackward0 made at sqrt(0), as where does in forward.
    for run in trace.backward_runs:
        for step in run.steps:
            for g in step.grads_in:
                if g is not None:
                    readers.setdefault(g, []).append(step)
    # The program keeps the last value of each parameter, buffer and optimizer state past the
    # step (the next step reads it): never dropped, whoever reads it here (a NaN written into a
    # buffer that this step reads only through nan_to_num is still in the model).
    kept = outliving_values(trace)
    memo: dict[str, bool] = {name: False for name in kept}

    def dropped(name: str, depth: int) -> bool:
        if name not in memo:
            memo[name] = False  # (while it is being decided)
            users = readers.get(name, [])
            memo[name] = bool(users) and depth < MAX_DROP_DEPTH and all(drops(c, depth) for c in users)
        return memo[name]

    def drops(c: Call | NodeRun, depth: int) -> bool:
        if isinstance(c, NodeRun):
            made = [g for g in c.grads_out if g is not None]
            if not made:  # an accumulator: it keeps what it read in .grad
                return False
            for g in made:
                r = tensors.get(g)
                if r is None or r.stats is None:
                    return False
                # A node's finite gradient out of a non-finite one in: a selection (a product with
                # an Inf is Inf or NaN, never finite); a non-finite one is dropped or not in turn.
                if (r.stats.nan or r.stats.inf) and not dropped(g, depth + 1):
                    return False
            return True
        for o in [*c.outputs, *c.mutated]:
            r = tensors.get(o)
            if r is None or r.stats is None:
                return False
            if not r.dtype.startswith(FLOATING_DTYPES):
                continue  # rule integer-output
            if not (r.stats.nan or r.stats.inf):
                if keeps_finite_by_selection(c.api):
                    continue  # rules selection, softmax-of-mask
                return False
            if not dropped(o, depth + 1):  # rule dropped-in-turn
                return False
        return True

    return {name for name, r in tensors.items()
            if r.stats is not None and (r.stats.nan or r.stats.inf) and name in readers and dropped(name, 0)}


def outliving_values(trace: Trace) -> set[str]:
    """The values the block wrote that the program keeps after it: the last version of every
    parameter, buffer and optimizer state tensor (one no later record replaced) that a call in
    the block made. (One that came from before the block, a -inf mask kept as a buffer, is data
    the step read, dropped or not as any other.)"""
    replaced = {r.previous for r in trace.tensors.values() if r.previous is not None}
    return {name for name, r in trace.tensors.items()
            if r.role in OWNED_ROLES and r.producer is not None and name not in replaced}


# ---- the walk -----------------------------------------------------------------------------------------
def _post_order(roots: list[Call], children: dict[str, list[Call]]) -> Iterator[Call]:
    """Calls with the calls nested in them first (a Function after the ops inside it)."""
    for c in roots:
        kids = children.get(c.name)
        if kids:
            yield from _post_order(kids, children)
        yield c


class _Walk:
    """One pass over the step in execution order, collecting the first NaN and Inf of each phase
    and what came after the first of all."""

    def __init__(self, trace: Trace, frames_of: FramesOf | None, open_block: bool = False) -> None:
        self.trace = trace
        self.tensors = trace.tensors
        self.frames_of = frames_of
        self.calls = {c.name: c for c in trace.calls}
        self.nodes = {n.name: n for n in trace.grad_nodes}
        self.children: dict[str, list[Call]] = {}
        for c in trace.calls:
            if c.parent is not None:
                self.children.setdefault(c.parent, []).append(c)
        self.dropped = dropped_values(trace)
        self.intended: set[str] = set()
        self.first: dict[tuple[str, str], Anomaly] = {}
        self.counts: dict[tuple[str, str], Counter[str]] = {}
        self.seen = 0
        self.met: dict[str, None] = {}  # every unintended non-finite value met, in order
        self.spread = Spread()
        self.hooked: set[str] = set()  # nodes whose hooks' calls were checked
        # Inside a custom Function whose own outputs are finite, a non-finite intermediate is the
        # Function's business (it did not escape), not an anomaly.
        self.sealed = {c.name for c in trace.calls
                       if c.kind == "function" and not any(_bad(self.tensors.get(o)) for o in c.outputs)}
        # Where the timeline is (see run): the optimizer step and the micro-batch within it, and
        # the accumulating backward runs of each optimizer step (a step ends at its optimizer call).
        self.step = 0
        self.micro_batch = 1
        self.step_runs: list[int] = [0]
        # A step with a closure (LBFGS) evaluates it several times: its runs are no micro-batches.
        self.closure = stepped_with_closure(trace)
        self.open_block = open_block  # the block is still running: no totals (see Anomaly.steps)
        self._made_by_nodes: dict[str, dict[str, str]] | None = None  # see _accumulated
        self._grad_now: dict[str, str | None] = {}  # accumulator -> the .grad after its last run walked

    def stack(self, stack_id: int | None, recorded: tuple[Frame, ...]) -> tuple[Frame, ...]:
        return self.frames_of(stack_id) if self.frames_of is not None and not recorded else recorded

    # ---- what a value is, once met -------------------------------------------------------------
    def see(self, phase: str, kind: str, module: str, values: list[str], make: Callable[[], Anomaly]) -> None:
        """Non-finite ``values`` of ``kind`` met in ``phase``: the phase's first, or one more."""
        key = (phase, kind)
        self.seen += 1
        if key in self.first:
            self.counts[key][module] += 1
        else:
            a = self.first[key] = make()
            a.order = self.seen
            if phase != "optimizer" and not self.closure:
                self._place(a)
            self.counts[key] = Counter()
        for v in values:
            if v in self.met:
                continue
            self.met[v] = None
            if len(self.met) > 1:
                self.spread.add(phase, module, bool(_nan(self.tensors.get(v))), bool(_inf(self.tensors.get(v))))

    def _place(self, a: Anomaly) -> None:
        """Which step and micro-batch ``a`` was met in (see Anomaly.step)."""
        steps = len(self.step_runs)
        if self.step >= steps:  # after the last step, before any backward of another
            if self.open_block:  # the next step's forward, so far
                a.step, a.steps = (self.step + 1, 0) if self.step else (None, 1)
                if max(self.step_runs, default=0) > 1:  # (its steps accumulate micro-batches)
                    a.micro_batch, a.micro_batches = 1, 0
            elif self.step:
                a.step, a.steps, a.after_step = self.step, steps, True
            return
        runs = self.step_runs[self.step]
        last = self.step == steps - 1
        if self.open_block and last:
            if self.micro_batch > 1 or max(self.step_runs, default=0) > 1:
                a.micro_batch, a.micro_batches = self.micro_batch, 0
            if steps > 1:
                a.step, a.steps = self.step + 1, 0
            return
        if runs > 1:
            a.micro_batch, a.micro_batches = min(self.micro_batch, runs), runs
        if steps > 1:
            a.step, a.steps = self.step + 1, steps

    # ---- the timeline --------------------------------------------------------------------------
    def run(self) -> None:
        nodes = self.nodes
        nested: dict[str, list[BackwardRun]] = {}
        for r in self.trace.backward_runs:
            if r.parent is not None and r.parent in nodes:
                nested.setdefault(r.parent, []).append(r)
        events = _timeline(self.trace, self.calls, nodes)
        # The block's optimizer steps, each with its accumulating runs (micro-batches): a step
        # ends at an optimizer call (or a GradScaler step that skipped it) that follows a run.
        # Two steps in one block are two steps, not two micro-batches of one.
        closed, tail, step_of = _split_steps(events)
        self.step_runs[:] = [len(s.runs) for s in closed]
        if tail or not closed:
            self.step_runs.append(len(tail))
        walked: set[str] = set()
        for (_, _, ev), step in zip(events, step_of):
            if step != self.step:
                self.step, self.micro_batch = step, 1
            if isinstance(ev, Call):
                for call in _post_order([ev], self.children):
                    if not self._inside_sealed(call.parent):
                        self.check_call(call.phase, call)
            else:
                self.walk_run(ev, nested, walked)
                if _accumulates(ev):
                    self.micro_batch += 1
        for r in self.trace.backward_runs:  # (a parent whose step was not recorded)
            if r.name not in walked:
                self.walk_run(r, nested, walked)

    def _inside_sealed(self, parent: str | None) -> bool:
        while parent is not None:
            if parent in self.sealed:
                return True
            call = self.calls.get(parent)
            parent = call.parent if call is not None else None
        return False

    def walk_run(self, run: BackwardRun, nested: dict[str, list[BackwardRun]], walked: set[str]) -> None:
        walked.add(run.name)
        for step in run.steps:
            self.walk_step(run, step, nested, walked)

    def walk_step(self, run: BackwardRun, step: NodeRun, nested: dict[str, list[BackwardRun]],
                  walked: set[str]) -> None:
        """One node's run: its hooks' calls, its own code's calls and the backward runs its code
        started (``autograd.grad`` in a custom backward, reentrant checkpointing), in the order
        they ran, then what it produced."""
        subs = nested.pop(step.node, [])
        node = self.nodes.get(step.node)
        call = self.calls.get(node.call) if node is not None and node.call else None
        module = call.module if call is not None else ""
        # The node's hooks ran first (a tensor hook on its forward output, a hook on a leaf): their
        # calls belong to the node without being its own code. (A node that runs in several
        # backward runs has its hooks' calls checked at its first run.)
        inner = [self.calls[c] for c in step.calls if c in self.calls]
        if step.node not in self.hooked:
            self.hooked.add(step.node)
            own = set(step.calls)
            inner[:0] = [c for c in self.children.get(step.node, ()) if c.name not in own]
        # Then the node's own code (a custom backward): the innermost op is the origin. A run it
        # started is met where it began among the calls (``at``; before them in files that lack it).
        subs.sort(key=lambda r: -1 if r.at is None else r.at)
        for c in _post_order(inner, self.children):
            while subs and (subs[0].at is None or subs[0].at <= c.seq):
                self.walk_run(subs.pop(0), nested, walked)
            self.check_call("backward", c, node=step.node, backward_run=run.name)
        for sub in subs:
            self.walk_run(sub, nested, walked)
        self.check_step(run.name, step, node, call, module)

    # ---- one call, one node run ----------------------------------------------------------------
    def check_call(self, phase: str, call: Call, node: str | None = None, backward_run: str | None = None) -> None:
        """Look at one call's own outputs (and the versions it wrote) for NaN and Inf."""
        tensors, intended = self.tensors, self.intended
        outs = [o for o in [*call.outputs, *call.mutated]
                if (r := tensors.get(o)) is not None and r.producer == call.name]
        nan_out = [o for o in outs if _nan(tensors[o]) and o not in self.dropped]
        inf_out = [o for o in outs if _inf(tensors[o])]
        if inf_out:
            inf_in = [i for i in call.inputs if _inf(tensors.get(i))]
            if has_inf_constant(call.args) or carries_intended_inf(
                    [(_inf(tensors[o]), numel(tensors[o])) for o in inf_out],
                    [(_inf(tensors[i]), numel(tensors[i]), i in intended) for i in inf_in]):
                intended.update(inf_out)  # rules inf-constant, carries-intended-inf
                inf_out = []
            inf_out = [o for o in inf_out if o not in self.dropped]  # (an intended Inf counts as intended)
        for kind, bad_out in (("nan", nan_out), ("inf", inf_out)):
            if bad_out:
                self.see(phase, kind, call.module, bad_out,
                         functools.partial(self._call_anomaly, phase, call, kind, bad_out, node, backward_run))

    def _call_anomaly(self, phase: str, call: Call, kind: str, bad_out: list[str], node: str | None,
                      backward_run: str | None) -> Anomaly:
        tensors = self.tensors
        rec = tensors[bad_out[0]]
        assert rec.stats is not None
        count = _nan if kind == "nan" else _inf
        # A NaN made from an unintended Inf (inf - inf, inf * 0) started with that Inf. An intended
        # Inf among the inputs of an unintended one (an overflow next to a -inf mask, a loss that
        # kept a masked logit) is not where it came from.
        bad_in = [i for i in call.inputs if (count(tensors.get(i)) and not (kind == "inf" and i in self.intended))
                  or (kind == "nan" and i not in self.intended and _inf(tensors.get(i)))]
        arrived = bool(bad_in) and all(i not in self.met and (r := tensors.get(i)) is not None and r.producer is None
                                       for i in bad_in)
        return Anomaly(phase, rec.name, call.name, call.api, call.module, not bad_in, rec.stats.nan,
                       rec.stats.inf, self.stack(call.stack_id, call.stack), bad_in, kind=kind, node=node,
                       backward_run=backward_run, arrived=arrived,
                       state_unchecked=not bad_in and call.kind == "optimizer"
                       and self.trace.header.get("optimizer_state") is False)

    def _accumulated(self, step: NodeRun) -> str | None:
        """The version of a ``.grad`` that this run of an accumulator made (it added the gradient
        it received into the ``.grad`` there was), followed run by run: a run with no ``.grad``
        before it makes none (the gradient it received becomes the ``.grad``); one with a
        ``.grad`` makes the version whose ``previous`` that ``.grad`` is. The first run may add
        into a ``.grad`` from before the block (a version whose ``previous`` no call made). Where
        the chain is lost (``.grad`` changed by a call in between), None: not checked."""
        if self._made_by_nodes is None:
            self._made_by_nodes = {}
            for name, rec in self.tensors.items():
                if rec.producer is not None and rec.producer not in self.calls and rec.previous is not None:
                    self._made_by_nodes.setdefault(rec.producer, {})[rec.previous] = name
        made = self._made_by_nodes.get(step.node)
        received = next((g for g in step.grads_in if g is not None), None)
        now = self._grad_now.get(step.node)
        version = None
        if made:
            if now is not None:
                version = made.get(now)
            else:  # the first run seen: a .grad from before the block, if one was there
                version = next((v for prev, v in made.items()
                                if (r := self.tensors.get(prev)) is not None and r.producer is None), None)
        self._grad_now[step.node] = version if version is not None else received
        return version

    def check_step(self, run: str, step: NodeRun, node: GradNode | None, call: Call | None, module: str) -> None:
        tensors = self.tensors
        # An accumulator's output is the .grad it added into: a NaN there that neither gradient
        # brought came with the .grad there was (left from before the block: it arrived).
        summed = self._accumulated(step) if not step.grads_out else None
        for kind, count in (("nan", _nan), ("inf", _inf)):
            bad_in = [g for g in step.grads_in if g is not None and (
                count(tensors.get(g)) or (kind == "nan" and g not in self.intended and _inf(tensors.get(g))))]
            bad_out = [g for g in step.grads_out if g is not None and count(tensors.get(g)) and g not in self.dropped]
            arrived = False
            if summed is not None and count(tensors.get(summed)):
                bad_out = [summed]
                before = tensors[summed].previous
                if before is not None and count(tensors.get(before)):
                    bad_in.append(before)
                    arrived = all(i not in self.met and (r := tensors.get(i)) is not None and r.producer is None
                                  for i in bad_in)
            # An accumulator (no outputs) that received a bad gradient still shows where it ended.
            if not bad_out and not (bad_in and ("backward", kind) not in self.first and not step.grads_out):
                continue

            def make(bad_in: list[str] = bad_in, bad_out: list[str] = bad_out, kind: str = kind,
                     arrived: bool = arrived) -> Anomaly:
                rec = tensors[(bad_out or bad_in)[0]]
                assert rec.stats is not None
                stack = node.stack if node is not None else ()
                if not stack and self.frames_of is not None and node is not None:
                    stack = self.frames_of(node.stack_id)
                from_forward = call is not None and any(_bad(tensors.get(t)) for t in [*call.inputs, *call.outputs])
                # A node whose forward call saw NaN/Inf did not make its own: it follows from them.
                return Anomaly("backward", rec.name, step.node, node.kind if node else "?", module,
                               bool(bad_out) and not bad_in and not from_forward, rec.stats.nan, rec.stats.inf,
                               stack or self._run_stack(run), bad_in, backward_run=run, kind=kind,
                               from_forward=from_forward, arrived=arrived)
            self.see("backward", kind, module, bad_out or bad_in, make)

    def _run_stack(self, run: str) -> tuple[Frame, ...]:
        """The line that started the backward run ``run`` (for a node with no line of its own: a
        leaf's accumulator)."""
        r = next((r for r in self.trace.backward_runs if r.name == run), None)
        if r is None:
            return ()
        if not r.stack and self.frames_of is not None:
            return self.frames_of(r.stack_id)
        return r.stack

    # ---- the result ----------------------------------------------------------------------------
    def report(self, checked: int, unchecked: int) -> NumericsReport:
        for key, a in self.first.items():
            a.contaminated = sum(self.counts[key].values())
            a.contaminated_by_module = dict(self.counts[key])
        f = self.first.get
        intended_only = [n for n in self.intended if n not in self.met]
        overflows = scaler_overflows(self.trace)
        firsts = sorted(self.first.values(), key=lambda a: a.order)
        return NumericsReport(f(("forward", "nan")), f(("forward", "inf")), f(("backward", "nan")),
                              f(("backward", "inf")), checked, unchecked, intended_inf=len(self.intended),
                              dropped=len(self.dropped - self.intended), scaler_overflows=overflows,
                              optimizer_nan=f(("optimizer", "nan")), optimizer_inf=f(("optimizer", "inf")),
                              spread=self.spread, nonfinite_values=list(self.met), intended_values=intended_only,
                              skipped_step=self._skipped(firsts[0], overflows) if firsts else None)

    def _skipped(self, headline: Anomaly, overflows: list[ScalerOverflow]) -> ScalerOverflow | None:
        """The overflow that explains ``headline``: it is where the scaled gradients are (backward,
        optimizer) and could be an overflow (``_could_overflow``), or the call that scaled the
        loss (it read the scale)."""
        call = self.calls.get(headline.producer)
        for o in overflows:
            if (headline.phase in ("backward", "optimizer") and self._could_overflow(headline)) or (
                    call is not None and o.scale is not None and o.scale in call.inputs):
                return o
        return None

    def _could_overflow(self, a: Anomaly) -> bool:
        """Whether the value ``a`` headlines could come from scaled gradients that overflowed.
        An overflow makes an Inf, or a NaN inside one kernel (an Inf it made and used): from values
        so large that a product of two of them leaves the dtype's range. A NaN made from values far
        below that (``g * nan``, ``0 / 0`` on gradients of everyday size) is the model's, whatever
        the scaler then finds. Unknown sizes or dtypes: it could."""
        if a.kind != "nan" or not a.origin:
            return True
        call = self.calls.get(a.producer)
        if call is not None:
            inputs: list[str | None] = list(call.inputs)
        else:
            inputs = next((list(s.grads_in) for r in self.trace.backward_runs for s in r.steps
                           if s.node == a.producer), [])
        made = self.tensors.get(a.tensor)
        limit = DTYPE_MAX.get(made.dtype) if made is not None else None
        if limit is None:
            return True
        largest = 0.0
        for name in inputs:
            rec = self.tensors.get(name) if name is not None else None
            if rec is None:
                continue
            top = DTYPE_MAX.get(rec.dtype)
            if top is None or rec.stats is None or rec.stats.absmax is None:
                return True
            limit, largest = min(limit, top), max(largest, rec.stats.absmax)
        return largest * largest >= limit


# The largest finite value of each floating dtype by its name in the trace (the analysis does not
# import torch); a dtype not here is not asked (see _Walk._could_overflow).
DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895e38, "float32": 3.4028e38, "float64": 1.7977e308,
             "float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0, "float8_e5m2": 57344.0, "float8_e5m2fnuz": 57344.0}


Event = tuple[float, int, Call | BackwardRun]


def _timeline(trace: Trace, calls: dict[str, Call], nodes: Container[str]) -> list[Event]:
    """The step in execution order: each call where it began, each backward run where it began
    among the calls (runs and calls a grad node's own code made are met inside that node's run)."""
    events: list[Event] = []
    for c in trace.calls:
        # (a backward-phase call of no grad node, DDP's all-reduce at the end of a run, is met
        # where it was made too; those of a node are met in the node's step)
        if c.parent is None or (c.parent not in calls and c.parent not in nodes):
            events.append((c.seq, 1, c))
    for r in trace.backward_runs:
        if r.parent is None or r.parent not in nodes:
            events.append((_run_position(trace, calls, r), 0, r))
    events.sort(key=lambda e: (e[0], e[1]))
    return events


def _run_position(trace: Trace, calls: dict[str, Call], run: BackwardRun) -> float:
    """Where a run began among the calls: recorded (``at``), else (files of version 2) just after
    the call that made its first root (the loss), else after the calls its nodes made."""
    if run.at is not None:
        return run.at - 0.5
    for root in run.roots:
        rec = trace.tensors.get(root)
        call = calls.get(rec.producer) if rec is not None and rec.producer else None
        if call is not None:
            return call.seq + 0.5
    inner = [calls[c].seq for s in run.steps for c in s.calls if c in calls]
    return min(inner) - 0.5 if inner else float(len(trace.calls)) + run.seq


@dataclass
class OptimizerStep:
    """One optimizer step of a block: the backward runs that added into ``.grad`` before it
    (its micro-batches under gradient accumulation) and the call that ended it."""

    runs: list[BackwardRun]
    end: Call  # the optimizer call, or GradScaler's unscale when it skipped the optimizer step


def _split_steps(events: list[Event]) -> tuple[list[OptimizerStep], list[BackwardRun], list[int]]:
    """The optimizer steps of a timeline (each ends at an optimizer call that follows an
    accumulating run), the accumulating runs after the last one, and per event the index of the
    step it belongs to (``len(steps)``: after the last step). A step GradScaler skipped (its
    gradients overflowed) records no optimizer call: it ends at its unscale of the gradients when
    the next run comes, or the block ends, before any optimizer call."""
    closed: list[OptimizerStep] = []
    runs: list[BackwardRun] = []
    unscaled: Call | None = None  # GradScaler's unscale after the runs, until an optimizer call
    step_of: list[int] = []
    for _, _, ev in events:
        if isinstance(ev, BackwardRun):
            if _accumulates(ev):
                if unscaled is not None:  # the step before was skipped
                    closed.append(OptimizerStep(runs, unscaled))
                    runs, unscaled = [], None
                runs.append(ev)
        elif runs and ev.kind == "optimizer":
            closed.append(OptimizerStep(runs, ev))
            runs, unscaled = [], None
        elif runs and ev.api == UNSCALE_API:
            unscaled = ev
        step_of.append(len(closed))
    if unscaled is not None:
        closed.append(OptimizerStep(runs, unscaled))
        runs = []
    return closed, runs, step_of


def optimizer_steps(trace: Trace) -> tuple[list[OptimizerStep], list[BackwardRun]]:
    """The optimizer steps of ``trace`` in order, each with the accumulating backward runs before
    it, and the accumulating runs after the last step (none when the block ends with a step). The
    numerics headline counts steps and micro-batches the same way."""
    calls = {c.name: c for c in trace.calls}
    closed, tail, _ = _split_steps(_timeline(trace, calls, {n.name for n in trace.grad_nodes}))
    return closed, tail


def _accumulates(run: BackwardRun) -> bool:
    """A run that adds into ``.grad`` (``backward``), as a micro-batch's does; ``autograd.grad``
    returns its gradients instead."""
    return not run.api.endswith(".grad")


def find_anomalies(trace: Trace, frames_of: FramesOf | None = None, open_block: bool = False) -> NumericsReport:
    """The story of the step's NaN/Inf (see the module docstring). ``frames_of``: symbolises a
    stack id (a live trace whose stacks are not resolved yet). ``open_block``: the block is still
    running (``raise_on_nonfinite`` stops it): a step or micro-batch is counted so far, with no
    total, and what follows the last step is the next step's."""
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
    walk = _Walk(trace, frames_of, open_block)
    walk.run()
    return walk.report(checked, len(tensors) - checked)


class NonFiniteError(FloatingPointError, RaisedOnPurpose):
    """Raised by ``raise_on_nonfinite=True`` at the first NaN/Inf; ``.anomaly`` holds the report's
    headline and ``.report`` the report (the message is its story)."""

    def __init__(self, anomaly: Anomaly, report: NumericsReport | None = None) -> None:
        super().__init__(report.describe() if report is not None else anomaly.describe())
        self.anomaly = anomaly
        self.report = report


install_view("anomalies", find_anomalies)  # Trace.anomalies
