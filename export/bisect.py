"""Where two runs part: ``bisect(a, b)`` compares two step logs (``.gtsteps``) step by step and
finds the first step whose results differ, and what differed first.

For each step both logs hold, in order:

1. the parameters as the step begins: when they differ, the previous step's update differed (or,
   at step 0, the runs started from different parameters);
2. what goes into the step: the batch (the tensors given to the model's outermost calls: the
   labels a loop hands to the loss function are not among them), the random states, the learning
   rates and the other optimizer settings;
3. what the step computed: its losses and the gradients the optimizer read (as ``step()`` began:
   after any clipping or scaling of ``.grad``; the log holds no gradient as backward ends).

The runs part at the first step whose results (its loss, its gradients, or the update seen as
the next step begins) differ; the verdict names the input that already differed there (the
batch, the random state, a learning rate), or says that everything going in agreed and the
computation itself changed, or an input the log does not digest (labels). An input that differs
without changing any result (a generator the runs seeded or drew from differently, whose state no
step's result depends on) is noted and the comparison goes on.

A random generator that starts to differ at the step where the runs part is blamed only on
evidence that the step used it. Its state moved before the next step in either run: blamed (the
step, or what runs before the next step, drew from it or seeded it); it stayed put in both: not
blamed. With no next step to tell, it is blamed where it differs first after step 0 (the runs
seeded or drew from it differently since the step before) or is torch's (CPU or CUDA: their
states start alike in every process), and not where it is Python's ``random`` or NumPy's global
generator at step 0 (seeded differently in every process unless the program seeds them). One
not blamed is mentioned beside the step's computation.

Comparisons are bit-exact (fingerprints, the loss's exact value) by default. With ``rtol`` /
``atol`` (for runs on different hardware or dtypes), losses, learning rates and the parameters'
and gradients' L2 norms are compared within ``|a - b| <= atol + rtol * max(|a|, |b|)``, and
fingerprints are not compared; batch digests stay exact.

Both logs are streamed, one step of each at a time (and the next one, at the step where the runs
part). Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from export.diff import Tolerance
from export.errors import UserError
from tracer.model.display import plural
from tracer.model.steplog import StepEntry, StepLogFormatError, StepLogReader

TOP_NAMED = 3  # parameters named in the verdict before "..."
SEEDED_ALIKE = frozenset({"torch", "cuda"})  # generators whose state is the same in every process until used

Pair = tuple[StepEntry | None, StepEntry | None]


@dataclass
class Parting:
    """Where the runs part. ``kind``: what differed first:

    - ``start``: the parameters as step 0 begins (the runs were initialised differently);
    - ``layout``: the parameters' names, shapes or dtypes (not the same model);
    - ``batch``, ``rng``: an input of the step, and its results with it;
    - ``lr``, ``hyper``: a learning rate or another optimizer setting, seen in the update;
    - ``loss``: the step's computation, or an input the log does not digest (the labels given
      to the loss), with every input it digests equal;
    - ``grads``: the gradients the optimizer read, with the inputs and the loss equal (the
      backward pass, or a change to ``.grad`` between backward and ``step()``: clipping);
    - ``update``: the update, with the loss, gradients and settings equal;
    - ``length``: one log ends while the other goes on, every step both hold agreeing.
    """

    step: int
    kind: str
    words: str  # what differed, as a clause of the verdict
    params: list[str] = field(default_factory=list)  # differing parameters (or gradients), execution order
    total: int = 0  # parameters in the layout
    what: str = "gradients"  # what of the parameters ``params`` names


@dataclass
class BisectResult:
    """What ``bisect`` found; ``describe()`` says it in one paragraph, ``commands()`` how to
    trace the step in both runs."""

    a: str
    b: str
    a_meta: dict[str, Any]
    b_meta: dict[str, Any]
    compared: int  # steps compared
    a_steps: int
    b_steps: int
    parting: Parting | None
    tolerance: Tolerance | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 0 if self.parting is None else 1

    def describe(self) -> str:
        """The verdict in one paragraph."""
        p = self.parting
        basis = f" within {self.tolerance}" if self.tolerance is not None else " bit for bit"
        if p is None:
            # No step in either log is bad input (``bisect`` refuses it): "agree" here means
            # steps were compared. The batch is the model's inputs only (not the labels).
            text = (f"The logs agree on all {plural(self.compared, 'step')}{basis}: every loss, model input, learning "
                    "rate, gradient and parameter, and the parameters after the last step.")
        elif p.kind == "length" and self.compared == 0:
            text = f"{p.words[0].upper()}{p.words[1:]}: no step to compare."  # no "agree on the 0 steps"
        elif p.kind == "length":
            text = f"The logs agree on the {plural(self.compared, 'step')} both hold{basis}, but {p.words}."
        elif p.kind == "start":
            text = f"The runs part before step 0: {p.words}{_named(p)}."
        else:
            before = "" if p.step == 0 else f" Step 0 agrees{basis}." if p.step == 1 else \
                f" Steps 0-{p.step - 1} agree{basis}."
            text = f"The runs part at step {p.step}: {p.words}{_named(p)}.{before}"
        notes = " ".join(self.notes)
        return text + (" " + notes if notes else "")

    def commands(self) -> list[str]:
        """Shell commands that trace the step where the runs part in both programs, then diff the
        two traces (empty when they agree, or a log does not say how its program was run)."""
        p = self.parting
        if p is None or p.kind in ("length", "layout"):
            return []
        step = 0 if p.kind == "start" else p.step
        outs = _trace_names(self.a, self.b, step)
        cmds = [trace_command(meta, step, out) for meta, out in ((self.a_meta, outs[0]), (self.b_meta, outs[1]))]
        if any(c is None for c in cmds):
            return []
        return [c for c in cmds if c is not None] + [f"gradtrace diff {shlex.quote(outs[0])} {shlex.quote(outs[1])}"]

    def to_json(self) -> dict[str, Any]:
        p = self.parting
        return {"a": self.a, "b": self.b, "agree": p is None, "compared": self.compared,
                "steps": {"a": self.a_steps, "b": self.b_steps},
                "step": None if p is None else p.step, "kind": None if p is None else p.kind,
                "params": [] if p is None else p.params, "verdict": self.describe(), "commands": self.commands(),
                "rtol": None if self.tolerance is None else self.tolerance.rtol,
                "atol": None if self.tolerance is None else self.tolerance.atol}


def _named(p: Parting) -> str:
    if not p.params:
        return ""
    more = len(p.params) - TOP_NAMED
    shown = ", ".join(p.params[:TOP_NAMED]) + (f" and {more:,} more" if more > 0 else "")
    return (f"; the {p.what} of {len(p.params):,} of {plural(p.total, 'parameter')} differ, first in execution "
            f"order: {shown}")


# ---- the command that traces one step of a logged run -----------------------------------------------
def trace_command(meta: dict[str, Any], step: int, out: str) -> str | None:
    """``gradtrace run --steps K -o OUT <the program's command line>``, run where the program ran;
    None when the log does not say how its program was started (an interactive session)."""
    argv = meta.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv) \
            or argv[0] in ("", "-", "-c"):
        return None
    program = (["-m"] if meta.get("module") is True else []) + list(argv)
    cwd = meta.get("cwd")
    here = isinstance(cwd, str) and os.path.realpath(cwd) != os.path.realpath(os.getcwd())
    out_path = os.path.abspath(out) if here else out
    cmd = shlex.join(["gradtrace", "run", "--steps", str(step), "-o", out_path, *program])
    return f"cd {shlex.quote(str(cwd))} && {cmd}" if here else cmd


def _trace_names(a: str, b: str, step: int) -> tuple[str, str]:
    sa, sb = (os.path.splitext(os.path.basename(p))[0] or "run" for p in (a, b))
    if sa == sb:
        sa, sb = sa + ".a", sb + ".b"
    return f"{sa}.step{step}.gtrace", f"{sb}.step{step}.gtrace"


# ---- comparing ----------------------------------------------------------------------------------
def bisect(a: str | os.PathLike[str], b: str | os.PathLike[str], *, rtol: float | None = None,
           atol: float | None = None) -> BisectResult:
    """Compare the step logs ``a`` and ``b`` (see the module docstring). A missing file is a
    ``UserError``; a file that is not a readable step log a ``StepLogFormatError``."""
    pa, pb = os.fspath(a), os.fspath(b)
    for path in (pa, pb):
        if not os.path.exists(path):
            raise UserError(f"no such step log: {path}")
        if os.path.isdir(path):
            raise UserError(f"{path} is a directory, not a step log")
    tol = None if rtol is None and atol is None else Tolerance(rtol or 0.0, atol or 0.0)
    if tol is not None and (not (tol.rtol >= 0 and tol.atol >= 0) or not all(map(math.isfinite, (tol.rtol, tol.atol)))):
        raise UserError("--rtol and --atol must be finite numbers >= 0")
    with StepLogReader(pa) as ra, StepLogReader(pb) as rb:
        result = _Bisection(ra, rb, tol).run()
    if result.a_steps == 0 and result.b_steps == 0:
        # "The logs agree on all 0 steps" would pass two empty logs (programs that stopped
        # before their first optimizer step) as a match: bad input, as a missing file is.
        raise UserError(f"neither step log holds a step ({pa}, {pb}): no optimizer step was logged in either run, "
                        "nothing to compare")
    return result


class _Bisection:
    def __init__(self, ra: StepLogReader, rb: StepLogReader, tol: Tolerance | None) -> None:
        self.ra, self.rb, self.tol = ra, rb, tol
        self.notes: list[str] = []
        self._noted: set[str] = set()
        self._rng_differs: set[str] = set()  # generators that differed at an earlier step
        self.compared = 0

    def run(self) -> BisectResult:
        pairs = _Lookahead(_pairs(iter(self.ra), iter(self.rb)))
        prev: tuple[StepEntry, StepEntry] | None = None
        parting: Parting | None = None
        a_steps = b_steps = 0
        for ea, eb in pairs:
            if ea is None or eb is None:
                a_steps += ea is not None
                b_steps += eb is not None
                continue  # one log goes on: counted, said below
            a_steps += 1
            b_steps += 1
            parting = self._step(prev, ea, eb, pairs.peek)
            if parting is not None:
                break
            self.compared += 1
            prev = (ea, eb)
        if parting is None:
            if a_steps != b_steps:
                parting = self._length(a_steps, b_steps)
            elif prev is not None:
                parting = self._finals(prev)
        return BisectResult(self.ra.path, self.rb.path, self.ra.meta, self.rb.meta, self.compared, a_steps, b_steps,
                            parting, self.tol, self.notes)

    # ---- one step -------------------------------------------------------------------------------
    def _step(self, prev: tuple[StepEntry, StepEntry] | None, ea: StepEntry, eb: StepEntry,
              ahead: Callable[[], Pair | None] = lambda: None) -> Parting | None:
        step = ea.step
        if ea.layout.params != eb.layout.params:
            return Parting(step, "layout", _layout_words(ea, eb))
        names = [p.name for p in ea.layout.params]
        total = len(names)
        moved = self._differing(ea.params, eb.params, ea.param_norms, eb.param_norms)
        if moved:
            if prev is None:
                return Parting(step, "start", f"the parameters differ as step {step} begins (the runs were "
                                              "initialised differently: a seed, or how the model is built)",
                               [names[i] for i in moved], total, "values")
            return self._update(prev, [names[i] for i in moved], total)
        inputs = self._inputs(ea, eb)
        loss_differs = self._losses_differ(ea, eb)
        grads = self._differing(ea.grads, eb.grads, ea.grad_norms, eb.grad_norms)
        if not loss_differs and not grads:
            self._note(step, inputs)
            return None
        results = self._results_words(ea, eb, loss_differs, grads, total)
        # A generator that differed already, without changing anything (one the programs seeded
        # or drew from differently, and no step's result depended on until now), is not blamed;
        # nor is one the log shows unused by the step, or an unseeded one at step 0 the log
        # cannot tell about: it is said beside (see the module docstring).
        fresh = [g for k, w in inputs if k == "rng" for g in w.split(",") if g not in self._rng_differs]
        cause = next((w for k, w in inputs if k == "batch"), None)
        if cause is None and fresh:
            fresh, beside = self._used(step, fresh, ea, eb, ahead())
            self.notes.extend(beside)
        if cause is None and fresh:
            cause = f"the random state of {_generators(fresh)} differs as its first forward begins"
        if cause is not None:
            kind = "batch" if any(k == "batch" for k, _ in inputs) else "rng"
            return Parting(step, kind, f"{cause}, and {results}", [names[i] for i in grads], total)
        rng = "" if any(k == "rng" for k, _ in inputs) else ", the random state"
        # The batch digest covers the model's inputs only: labels handed to the loss function
        # outside the model are not in the log, so a loss that differs may be theirs.
        going_in = f"every input the log compares agrees (the parameters, the model's inputs, the learning rates{rng})"
        if loss_differs:
            return Parting(step, "loss", f"{going_in}, yet {results}: the step's computation changed, or an input "
                                         "the log does not compare (the labels or targets the loss reads beside the "
                                         "model's output)", [names[i] for i in grads], total)
        # The gradients are read as ``step()`` begins, not as backward ends: clipping, scaling or
        # anything else that rewrites ``.grad`` in between looks the same as another backward.
        return Parting(step, "grads", f"{going_in} and so does its loss, yet the gradients the optimizer read "
                                      "differ: the backward pass changed, or something changed the gradients between "
                                      "backward and optimizer.step() (clipping, scaling, a hook)",
                       [names[i] for i in grads], total)

    def _used(self, step: int, fresh: list[str], ea: StepEntry, eb: StepEntry,
              nxt: Pair | None) -> tuple[list[str], list[str]]:
        """Of the generators in ``fresh`` (differing at a step whose results differ, and at no
        earlier step), those the log shows the step may have used, and notes on the others."""
        na, nb = nxt if nxt is not None else (None, None)
        used: list[str] = []
        idle: list[str] = []
        unknown: list[str] = []
        for g in fresh:
            moves = [e.rng.get(g) != n.rng.get(g) for e, n in ((ea, na), (eb, nb)) if n is not None]
            if any(moves):
                used.append(g)  # drawn from (or seeded) between this step and the next
            elif len(moves) == 2:
                idle.append(g)  # neither run touched it before the next step
            elif step > 0 or g in SEEDED_ALIKE:
                used.append(g)  # alike until now (or in every process): the programs made it differ
            else:
                unknown.append(g)
        notes = []
        if idle:
            state, verb, it = ("states", "differ", "them") if len(idle) > 1 else ("state", "differs", "it")
            after = f"step {na.step}" if na is not None else "the next step"
            notes.append(f"(The random {state} of {_generators(idle)} {verb} as step {step} begins, but neither run "
                         f"draws from {it} before {after}: not what changed the step.)")
        if unknown:
            state, verb, it = ("states", "differ", "them") if len(unknown) > 1 else ("state", "differs", "it")
            notes.append(f"(The random {state} of {_generators(unknown)} {verb} as step {step} begins, as an "
                         f"unseeded generator's does in every process; the log cannot tell whether the step draws "
                         f"from {it}.)")
        return used, notes

    def _note(self, step: int, inputs: list[tuple[str, str]]) -> None:
        """Inputs that differ at a step whose results agree: said once each, and remembered."""
        for kind, what in inputs:
            if kind == "rng":
                fresh = [g for g in what.split(",") if g not in self._rng_differs]
                if fresh:
                    self._rng_differs.update(fresh)
                    state, verb = ("states", "differ") if len(fresh) > 1 else ("state", "differs")
                    # All the log knows: the state moved differently (another seed, an extra
                    # draw outside the steps, no seed at all), and no result has shown it.
                    it = "them" if len(fresh) > 1 else "it"
                    self.notes.append(f"(The random {state} of {_generators(fresh)} {verb} from step {step} on "
                                      f"without changing any result: the runs seeded {it} or drew from {it} "
                                      f"differently, and no step's result depended on {it} so far.)")
            elif kind == "batch" and kind not in self._noted:
                self._noted.add(kind)
                self.notes.append(f"(At step {step} the batch differs, yet the loss and gradients agree.)")

    def _update(self, prev: tuple[StepEntry, StepEntry], moved: list[str], total: int) -> Parting:
        pa, pb = prev
        step = pa.step
        lrs = self._lr_words(pa, pb)
        if lrs:
            return Parting(step, "lr", f"its {lrs}, while its loss and gradients agree, so its update differs (seen "
                                       f"as step {step + 1} begins)", moved, total, "values")
        if pa.hyper != pb.hyper:
            return Parting(step, "hyper", "an optimizer setting other than the learning rate differs (betas, weight "
                                          "decay, momentum, ...), while its loss and gradients agree, so its update "
                                          f"differs (seen as step {step + 1} begins)", moved, total, "values")
        return Parting(step, "update", "its loss, gradients and optimizer settings agree, yet a parameter's update "
                                       f"differs (seen as step {step + 1} begins: the optimizer's state or code, or "
                                       "something that changed the parameters between the steps)", moved, total,
                       "values")

    def _finals(self, last: tuple[StepEntry, StepEntry]) -> Parting | None:
        fa, fb = self.ra.finals.get(last[0].opt), self.rb.finals.get(last[1].opt)
        if fa is None or fb is None:
            return None
        moved = self._differing(fa.params, fb.params, fa.param_norms, fb.param_norms)
        if not moved:
            return None
        names = [p.name for p in fa.layout.params]
        return self._update(last, [names[i] for i in moved], len(names))

    def _length(self, a_steps: int, b_steps: int) -> Parting:
        short, long_, n, m = ("B", "A", b_steps, a_steps) if b_steps < a_steps else ("A", "B", a_steps, b_steps)
        reader = self.rb if short == "B" else self.ra
        cut = reader.truncated or not reader.ended
        if n == 0:
            how = "was cut off before its first step" if cut else "holds no step"
        else:
            how = f"{'was cut off' if cut else 'ends'} after {plural(n, 'step')}"
        return Parting(n, "length", f"{short}'s log {how} while {long_}'s holds {m:,} "
                                     f"({short}'s program stopped early, failed or was killed)")

    # ---- comparisons ------------------------------------------------------------------------------
    def _close(self, x: float | None, y: float | None) -> bool:
        if x is None or y is None:
            return x is None and y is None
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        if self.tol is None:
            return x == y
        if math.isinf(x) or math.isinf(y):
            return x == y
        return abs(x - y) <= self.tol.atol + self.tol.rtol * max(abs(x), abs(y))

    def _differing(self, fa: Sequence[str | None], fb: Sequence[str | None], na: Sequence[float | None],
                   nb: Sequence[float | None]) -> list[int]:
        """Indices of the tensors that differ: by fingerprint, or by norm within the tolerance."""
        if self.tol is None:
            return [i for i, (x, y) in enumerate(zip(fa, fb)) if x != y]
        return [i for i, (x, y) in enumerate(zip(na, nb)) if not self._close(x, y)]

    def _losses_differ(self, ea: StepEntry, eb: StepEntry) -> bool:
        return len(ea.loss) != len(eb.loss) or not all(self._close(x, y) for x, y in zip(ea.loss, eb.loss))

    def _lr_words(self, ea: StepEntry, eb: StepEntry) -> str:
        if len(ea.lr) != len(eb.lr):
            return f"param groups differ ({len(ea.lr)} in A, {len(eb.lr)} in B)"
        for g, (x, y) in enumerate(zip(ea.lr, eb.lr)):
            if not self._close(x, y):
                group = f" (param group {g})" if len(ea.lr) > 1 else ""
                return f"learning rate differs: {_num(x)} in A, {_num(y)} in B{group}"
        return ""

    def _inputs(self, ea: StepEntry, eb: StepEntry) -> list[tuple[str, str]]:
        """What goes into the step that differs: (kind, words), the batch first."""
        out: list[tuple[str, str]] = []
        if ea.batch != eb.batch or ea.batch_tensors != eb.batch_tensors:
            count = "" if ea.batch_tensors == eb.batch_tensors else \
                f"; {plural(ea.batch_tensors, 'tensor')} in A, {eb.batch_tensors:,} in B"
            out.append(("batch", f"its batch differs (the tensors given to the model: digest {ea.batch} in A, "
                                 f"{eb.batch} in B{count})"))
        gens = [g for g in sorted(set(ea.rng) | set(eb.rng)) if ea.rng.get(g) != eb.rng.get(g)]
        if gens and not (self.tol is not None and set(ea.rng) != set(eb.rng)):
            out.append(("rng", ",".join(gens)))
        lrs = self._lr_words(ea, eb)
        if lrs:
            out.append(("lr", f"its {lrs}"))
        if ea.hyper != eb.hyper:
            out.append(("hyper", "an optimizer setting other than the learning rate differs"))
        return out

    def _results_words(self, ea: StepEntry, eb: StepEntry, loss_differs: bool, grads: list[int], total: int) -> str:
        parts = []
        if loss_differs:
            if len(ea.loss) != len(eb.loss):
                parts.append(f"it ran {plural(ea.backward, 'backward pass', 'backward passes')} in A and "
                             f"{eb.backward:,} in B")
            else:
                i = next(i for i, (x, y) in enumerate(zip(ea.loss, eb.loss)) if not self._close(x, y))
                which = f" (micro-batch {i})" if len(ea.loss) > 1 else ""
                parts.append(f"its loss differs{which}: {_num(ea.loss[i])} in A, {_num(eb.loss[i])} in B"
                             + _by(ea.loss[i], eb.loss[i]))
        else:
            parts.append("its loss agrees but the gradients the optimizer read differ")
        return ", ".join(parts)


def _pairs(ia: Iterator[StepEntry], ib: Iterator[StepEntry]) -> Iterator[Pair]:
    """The steps of both logs side by side, then what is left of the longer one."""
    while True:
        ea, eb = next(ia, None), next(ib, None)
        if ea is None and eb is None:
            return
        yield ea, eb


class _Lookahead:
    """``_pairs`` with the next pair readable before it is taken (``peek``: None at the end). A log
    unreadable past the step being compared says so when that step is taken, not when peeked."""

    def __init__(self, pairs: Iterator[Pair]) -> None:
        self._pairs = pairs
        self._ahead: list[Pair | None] = []  # the peeked pair, once peeked
        self._error: StepLogFormatError | None = None

    def __iter__(self) -> _Lookahead:
        return self

    def __next__(self) -> Pair:
        if self._error is not None:
            raise self._error
        if self._ahead:
            pair = self._ahead.pop()
            if pair is None:
                raise StopIteration
            return pair
        return next(self._pairs)

    def peek(self) -> Pair | None:
        if not self._ahead and self._error is None:
            try:
                self._ahead.append(next(self._pairs, None))
            except StepLogFormatError as e:
                self._error = e
        return self._ahead[0] if self._ahead else None


GENERATORS = {"torch": "torch's CPU generator", "cuda": "the CUDA generators", "python": "Python's random",
              "numpy": "NumPy's global generator"}


def _generators(names: list[str]) -> str:
    words = [GENERATORS.get(n, n) for n in names]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _layout_words(ea: StepEntry, eb: StepEntry) -> str:
    a, b = ea.layout.params, eb.layout.params
    if len(a) != len(b):
        return f"the runs train different parameters ({len(a):,} tensors in A, {len(b):,} in B)"
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return (f"the runs train different parameters: {a[i].name} {list(a[i].shape)} {a[i].dtype} in A, "
            f"{b[i].name} {list(b[i].shape)} {b[i].dtype} in B")


def _by(x: float, y: float) -> str:
    """`` (by 8.7e-05, 2.1e-05 relative)``: how far two finite numbers are apart."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return ""
    d = abs(x - y)
    scale = max(abs(x), abs(y))
    return f" (by {d:.2g}" + (f", {d / scale:.2g} relative)" if scale > 0 else ")")


def _num(x: float | None) -> str:
    return "none" if x is None else repr(x)


__all__ = ["BisectResult", "Parting", "bisect", "trace_command"]
