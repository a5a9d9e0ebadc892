"""Trace chosen steps of a long training run: ``tracer.trace(steps="100,200-202")`` / ``every=500``.

    with tracer.trace(steps="10,40", out="run.gtrace"):
        for batch in loader:                     # the whole loop, unchanged
            loss = model(batch).loss
            loss.backward()
            opt.step()                           # each optimizer step ends a training step
            opt.zero_grad()

Step boundaries come from PyTorch's global optimizer step post-hook: the first
``optimizer.step()`` ends step 0, so step N is everything from the end of step N-1's
``optimizer.step()`` to the end of step N's. Loops without an optimizer count backward passes
(``step_on="backward"``: tracer.features.backward_ends) or mark boundaries with ``tracer.step()``.
Between chosen steps only that one global hook (or the two backward wrappers) is installed: no
mode, no module hooks, no ``Function.apply`` wrapper, so untraced steps run at plain speed
(``benchmarks/untraced_steps.py`` measures it).

Each chosen step is a complete trace whose header carries ``"step": N``. With ``out=`` the steps
are streamed one after another into that file (``tracer.load(path, step=N)`` and
``tracer.model.load_steps(path)`` read them back) or, with ``per_step_files=True``, into
``run.step10.gtrace``, ``run.step40.gtrace``; without ``out`` they stay in memory
(``StepTrace.traces``). ``max_calls`` / ``max_bytes`` bound the whole run, all steps together:
when a bound is reached, the step being recorded stops cleanly (its trace says so), a warning
says so on the console, and later chosen steps are not traced.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from torch.optim.optimizer import register_optimizer_step_post_hook

from tracer.features.backward_ends import BackwardEnds
from tracer.features.bounds import Bounds
from tracer.features.distributed import distributed_info, rank_path
from tracer.features.plugins import session_plugins
from tracer.model import Trace
from tracer.model.claims import OutputClaim, claim_output
from tracer.model.display import with_tag
from tracer.options import STEP_ON, StepOn, TraceError, TraceOptions
from tracer.record import recorder as _recorder
from tracer.record.session import TraceSession
from tracer.record.stacks import user_stacklevel

_ACTIVE: StepTrace | None = None


# ---- which steps -------------------------------------------------------------------------------
_RANGE = re.compile(r"^(\d+)\s*(?:-\s*(\d*))?$")


@dataclass(frozen=True)
class StepSelection:
    """The chosen step numbers: listed steps and ranges, an open range (``"100-"``), every k-th."""

    steps: frozenset[int] = frozenset()
    start_from: int | None = None  # every step from this one on
    every: int | None = None  # steps 0, every, 2*every, ...

    @classmethod
    def parse(cls, steps: str | int | Iterable[int] | None = None, every: int | None = None,
              first_by_default: bool = False) -> StepSelection:
        """``steps``: ``"100,200-202"``, ``"500-"``, an int or ints; ``every``: k for steps 0, k, 2k, ...
        ``first_by_default``: with neither, step 0 (a trainer's callback, as ``gradtrace run``),
        else that is an error."""
        if first_by_default and steps is None and every is None:
            steps = 0
        chosen: set[int] = set()
        start_from = None
        if isinstance(steps, bool):
            raise TraceError(f"steps must be step numbers like '10,40' or '100-105', got {steps!r}")
        if isinstance(steps, int):
            steps = [steps]
        if isinstance(steps, str):
            for part in steps.split(","):
                m = _RANGE.match(part.strip())
                if m is None:
                    raise TraceError(f"bad steps {steps!r}: {part.strip()!r} is not a step number or a range "
                                     "(write steps like '10,40' or '100-105' or '500-')")
                lo, hi = int(m.group(1)), m.group(2)
                if hi is None:
                    chosen.add(lo)
                elif hi == "":
                    start_from = lo if start_from is None else min(start_from, lo)
                elif int(hi) < lo:
                    raise TraceError(f"bad steps {steps!r}: the range {part.strip()!r} runs backwards")
                else:
                    chosen.update(range(lo, int(hi) + 1))
        elif steps is not None:
            for s in steps:
                if not isinstance(s, int) or isinstance(s, bool) or s < 0:
                    raise TraceError(f"steps must be step numbers (ints >= 0), got {s!r}")
                chosen.add(s)
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise TraceError(f"every must be a positive number of steps, got {every!r}")
        if not chosen and start_from is None and every is None:
            raise TraceError("no step chosen: give steps='10,40' (or a range '100-105') or every=N")
        return cls(frozenset(chosen), start_from, every)

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        return (step in self.steps or (self.start_from is not None and step >= self.start_from)
                or (self.every is not None and step >= 0 and step % self.every == 0))

    def __str__(self) -> str:
        parts = [str(s) for s in sorted(self.steps)]
        if self.start_from is not None:
            parts.append(f"{self.start_from}-")
        if self.every is not None:
            parts.append(f"every {self.every}")
        return ", ".join(parts)


class StepObserver:
    """What a progress display hears about traced steps (all no-ops here)."""

    def step_begin(self, step: int, trace: Trace) -> None:
        """Step ``step`` starts being recorded into ``trace`` (live: its lists grow)."""

    def step_finishing(self, step: int, trace: Trace) -> None:
        """Step ``step`` ended; its checksums are being waited for and its records written."""

    def step_end(self, step: int, trace: Trace, path: str | None) -> None:
        """Step ``step`` is complete (written to ``path`` when streaming)."""

    def step_skipped(self, step: int, reason: str) -> None:
        """A chosen step was not traced."""

    def step_discarded(self, step: int) -> None:
        """Step ``step`` had begun but the traced block ended before anything of it ran."""


def step_path(out: str, step: int) -> str:
    """The per-step file of ``out``: ``run.gtrace`` -> ``run.step10.gtrace``."""
    return with_tag(out, f"step{step}")


class StepRecorder:
    """Starts and ends the trace of one step at a time and writes each where it belongs.

    Shared by ``StepTrace`` (boundaries from optimizer steps) and the framework callbacks
    (boundaries from the trainer's own step events).
    """

    def __init__(self, options: TraceOptions, *, per_step_files: bool = False,
                 observer: StepObserver | None = None) -> None:
        if per_step_files and options.out is None:
            raise TraceError("per_step_files=True needs out= (the name the step files are made from)")
        self.options = options
        self.out = options.out
        self.per_step_files = per_step_files
        self.observer = observer or StepObserver()
        self.steps: list[int] = []  # the steps traced, in order
        self.paths: list[str] = []  # the files written, in order (one, or one per step)
        self.traces: dict[int, Trace] = {}  # kept only when nothing is written to a file
        self.skipped: list[int] = []  # chosen steps not traced (a bound was reached, a trace was active)
        self.exhausted: str | None = None  # why no more steps are traced
        self.calls_used = 0
        self.bytes_used = 0
        self._open: tuple[int, TraceSession, Bounds | None, str | None, int, bool] | None = None
        self._file_started = False
        self._pending_skip: tuple[int, str] | None = None
        self._claims: dict[str, OutputClaim] = {}  # the files written, claimed until close()

    @property
    def recording(self) -> int | None:
        """The step being recorded now, or None."""
        return self._open[0] if self._open is not None else None

    def begin(self, step: int, root_module: Any = None, *, after_update: bool = False) -> Trace | None:
        """Start recording step ``step``; None (and a warning) when it can't be traced.

        ``root_module``: the model whose module paths name the parameters (a trainer's
        LightningModule, whose forward may never be called itself); by default the first module
        called is the root. ``after_update``: the step begins inside the optimizer step (or
        backward) that ended the one before, so what the loop does next (EMA, ``zero_grad``,
        GradScaler's update) is of the optimizer phase (tracer.model.phases, rule 6)."""
        if self._open is not None:
            self.end(completed=False)
        self._pending_skip = None
        if self.exhausted is not None:
            # Reported when the step ends: a chosen step the loop never reaches is not "skipped".
            self._pending_skip = (step, self.exhausted)
            return None
        active = _recorder.active_recorder()
        if active is not None and not active.closed:
            self._pending_skip = (step, "another tracer.trace() block was active (traces do not nest)")
            warnings.warn(f"gradtrace: step {step} not traced: another tracer.trace() block is active",
                          RuntimeWarning, stacklevel=3)
            return None
        path: str | None = None
        append = False
        if self.out is not None:
            path = step_path(self.out, step) if self.per_step_files else self.out
            append = not self.per_step_files and self._file_started
        o = self.options
        bounds = None
        if o.max_calls is not None or o.max_bytes is not None:
            bounds = Bounds(o.max_calls, o.max_bytes, calls_before=self.calls_used, bytes_before=self.bytes_used)
        # The recorder's own max_calls would count this step alone: the bound covers all steps.
        options = o.replace(out=path, max_calls=None, listeners=(*o.listeners, *([bounds] if bounds else [])))
        session = TraceSession(options, plugins=session_plugins(options, bounds=False), append=append,
                               header_extra={"step": step})
        trace = session.__enter__()
        # Held from here on, so that whatever fails below, end() still closes the session.
        self._open = (step, session, bounds, session.out, session.offset, append)
        if session.out is not None:  # (claimed by the session; kept between steps, until close())
            self.hold(session.out)
        if path is not None and not self.per_step_files:
            self._file_started = True
        rec = session.recorder
        assert rec is not None
        if bounds is not None:
            bounds.recorder = rec
        # The recorder names parameters from the first module it sees; a trainer knows the model.
        if root_module is not None:
            rec.register_root_module(root_module)
        if after_update:
            rec.phases.open_window()
        self.observer.step_begin(step, trace)
        return trace

    def end(self, exc: BaseException | None = None, *, completed: bool = True) -> Trace | None:
        """End the step being recorded (``completed``: its boundary was reached; otherwise the
        traced block ended first, with ``exc`` if it raised). Returns its trace, or None when
        nothing was recording or the unfinished step recorded nothing (then nothing is kept)."""
        if self._open is None:
            if self._pending_skip is not None and completed:
                self._skip(*self._pending_skip)
            self._pending_skip = None
            return None
        step, session, bounds, path, offset, append = self._open
        self._open = None
        t = session.trace
        assert t is not None
        # sys.exit() is how a program ends, not something that happened to the step
        empty = not completed and (exc is None or isinstance(exc, SystemExit)) and not t.calls \
            and not t.backward_runs
        if not completed and not empty:
            t.notes.append(f"step {step} did not reach its end (optimizer.step() or tracer.step()): "
                           "the traced block ended first")
        self.observer.step_finishing(step, t)
        session.__exit__(type(exc) if exc is not None else None, exc,
                         exc.__traceback__ if exc is not None else None)
        if empty:  # the loop ended right after the step before: nothing of this step ran
            self._discard(path, offset, append)
            self.observer.step_discarded(step)
            return None
        self.calls_used += len(t.calls)
        if path is not None:
            self.bytes_used += max(0, os.path.getsize(path) - offset)
            if path not in self.paths:
                self.paths.append(path)
        else:
            self.bytes_used += bounds.estimate(t) if bounds is not None else Bounds().estimate(t)
            self.traces[step] = t
        self.steps.append(step)
        if bounds is not None and bounds.tripped is not None:
            self.exhausted = f"a bound was reached during step {step} ({bounds.tripped.split(':')[0]})"
        self.observer.step_end(step, t, path)
        return t

    def hold(self, path: str) -> None:
        """Claim ``path`` (``tracer.model.claims``) until ``close()``: between the steps of one file
        another process must not take it over. Raises ``OutputInUse`` where another process
        writes it."""
        if path not in self._claims:
            self._claims[path] = claim_output(path)

    def close(self, exc: BaseException | None = None) -> Trace | None:
        """The block is over: end the step being recorded (as ``end(exc, completed=False)``) and
        give the claimed files back."""
        try:
            return self.end(exc, completed=False)
        finally:
            while self._claims:
                self._claims.popitem()[1].release()

    def _discard(self, path: str | None, offset: int, append: bool) -> None:
        if path is None:
            return
        if append:
            os.truncate(path, offset)
        else:
            os.remove(path)
            if not self.per_step_files:
                self._file_started = False

    def _skip(self, step: int, reason: str) -> None:
        self.skipped.append(step)
        self.observer.step_skipped(step, reason)


# ---- around a whole loop ------------------------------------------------------------------------
class StepResults:
    """What a run traced at chosen steps produced; shared by StepTrace and the framework
    callbacks, which all keep a ``StepRecorder`` as ``self.recorder``."""

    recorder: StepRecorder

    @property
    def steps(self) -> list[int]:
        """The steps traced, in order."""
        return self.recorder.steps

    @property
    def traces(self) -> dict[int, Trace]:
        """The traces by step number, when nothing was written to a file (``out=None``)."""
        return self.recorder.traces

    @property
    def paths(self) -> list[str]:
        """The files written."""
        return self.recorder.paths

    @property
    def skipped(self) -> list[int]:
        """Chosen steps not traced (a bound was reached, or another trace was open)."""
        return self.recorder.skipped


class StepTrace(StepResults):
    """What ``tracer.trace(steps=..., every=...)`` returns: a context manager around a training
    loop that traces the chosen steps only. See the module docstring.

    ``options``: those of every traced step (``max_calls``/``max_bytes`` bound all of them
    together); ``per_step_files``, ``optimizer`` (count only this optimizer's steps, for loops
    with several), ``observer`` (a ``StepObserver``, e.g. a progress display).
    """

    def __init__(self, options: TraceOptions, *, steps: str | int | Iterable[int] | None = None,
                 every: int | None = None, per_step_files: bool = False, optimizer: Any = None,
                 observer: StepObserver | None = None, step_on: StepOn = "optimizer") -> None:
        if step_on not in STEP_ON:
            raise TraceError(f"step_on must be one of {', '.join(map(repr, STEP_ON))}, got {step_on!r}")
        if step_on == "backward" and optimizer is not None:
            raise TraceError("optimizer= picks which optimizer's steps count: it has no meaning with step_on='backward'")
        self.selection = StepSelection.parse(steps, every)
        self.recorder = StepRecorder(options, per_step_files=per_step_files, observer=observer)
        _check_directory(options.out)
        self.optimizer = optimizer
        self.step_on = step_on
        self.step = 0  # the step running now
        self.manual = False  # the user marks boundaries with tracer.step(); optimizer steps don't count
        self.hint: str | None = None  # said when the block ends: how the steps could have been counted
        self._owner: int | None = None
        self._hook: Any = None
        self._backward_ends: BackwardEnds | None = None

    def claim_output(self) -> None:
        """Claim the file this block writes (this rank's, under torchrun) now, until the block
        ends: ``gradtrace run`` does, before the program starts, so that a second run writing the
        same file refuses at once instead of both writing it. Raises ``OutputInUse`` (an
        ``OSError``) when another process writes it. Without it, each step's file is claimed as
        the step begins, and kept until the block ends."""
        out = self.recorder.out
        if out is not None:
            info = distributed_info()
            self.recorder.hold(rank_path(out, info["rank"]) if info is not None else out)

    def __enter__(self) -> StepTrace:
        global _ACTIVE
        if _ACTIVE is not None:
            raise TraceError("tracer.trace(steps=...) is already active in this process; step traces do not nest")
        active = _recorder.active_recorder()
        if active is not None and not active.closed:
            raise TraceError("tracer.trace() is already active in this process; traces do not nest. "
                             "Put tracer.trace(steps=...) around the whole loop instead of the inner block.")
        self._owner = threading.get_ident()
        self.step = 0
        self.manual = False
        self.hint = None
        _ACTIVE = self
        try:
            if self.step_on == "optimizer":
                self._hook = register_optimizer_step_post_hook(self._on_optimizer_step)
            else:
                self._backward_ends = BackwardEnds(self._on_backward_end, self._owner)
                self._backward_ends.install()
            if 0 in self.selection:
                self.recorder.begin(0)
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            exc = None  # sys.exit(0) is how scripts end, not a failure of the step
        try:
            last = self.recorder.close(exc)
        finally:
            self._release()
        self._say_how_steps_count(last)
        return False

    def _say_how_steps_count(self, last: Trace | None) -> None:
        """A loop whose optimizer never stepped ran entirely as step 0: say how to count its steps."""
        if self.step_on != "optimizer" or self.manual or self.step != 0 or last is None \
                or len(last.backward_runs) < 2:
            return
        self.hint = (f"no optimizer.step() ran, so the whole block was step 0 ({len(last.backward_runs)} backward "
                     "runs): to end a step at each backward pass, give step_on='backward' (gradtrace run "
                     "--step-on backward), or mark steps with tracer.step()")
        warnings.warn(f"gradtrace: {self.hint}", RuntimeWarning, stacklevel=3)

    def _release(self) -> None:
        global _ACTIVE
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._backward_ends is not None:
            self._backward_ends.remove()
            self._backward_ends = None
        if _ACTIVE is self:
            _ACTIVE = None

    # ---- boundaries ------------------------------------------------------------------------------
    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.manual or threading.get_ident() != self._owner:
            return
        if self.optimizer is not None and optimizer is not self.optimizer \
                and getattr(self.optimizer, "optimizer", None) is not optimizer:
            return
        self._boundary(self.step + 1)

    def _on_backward_end(self, roots: Any) -> None:
        if not self.manual:
            self._boundary(self.step + 1)

    def mark(self, n: int | None = None) -> None:
        """A step boundary set by the user (``tracer.step``); from then on optimizer steps don't count."""
        self.manual = True
        if n is None:
            self._boundary(self.step + 1)
        elif n != self.step:  # `tracer.step(i)` at the top of the loop: step i is already current at i=0
            self._boundary(int(n))

    def _boundary(self, nxt: int) -> None:
        # Runs inside optimizer.step() (a post-hook): a failure to write must not kill the
        # training run, so it stops tracing with a warning instead.
        try:
            self.recorder.end(completed=True)
            self.step = nxt
            if nxt in self.selection:
                self.recorder.begin(nxt, after_update=not self.manual)
        except Exception as exc:
            self.step = nxt
            self.recorder.exhausted = f"tracing failed at step {nxt}: {type(exc).__name__}: {exc}"
            warnings.warn(f"gradtrace: {self.recorder.exhausted}; later steps are not traced",
                          RuntimeWarning, stacklevel=user_stacklevel())

    def __repr__(self) -> str:
        return (f"<StepTrace steps={self.selection} at step {self.step}, traced {self.steps}"
                f"{', out=' + self.recorder.out if self.recorder.out else ''}>")


def _check_directory(out: str | None) -> None:
    """An output whose directory is missing fails now, as opening it would, not at the first
    chosen step (which may come hours later, inside ``optimizer.step()``)."""
    if out is None or "{rank}" in out:
        return
    folder = os.path.dirname(out) or "."
    if not os.path.isdir(folder):
        code = errno.ENOTDIR if os.path.exists(folder) else errno.ENOENT
        raise OSError(code, os.strerror(code), folder)


def step(n: int | None = None) -> int | None:
    """Mark a training-step boundary inside ``tracer.trace(steps=...)``.

    ``tracer.step()`` at the end of an iteration ends the current step and starts the next;
    ``tracer.step(i)`` at the top of iteration ``i`` starts step ``i`` (at the first iteration,
    when step ``i`` is already the current one, it changes nothing). Once called, it replaces
    the optimizer-step counting for the rest of the block. Outside a step trace (or on another
    thread) it does nothing, so the call can stay in the code. Returns the current step number,
    or None when no step trace is active.
    """
    st = _ACTIVE
    if st is None or threading.get_ident() != st._owner:
        return None
    st.mark(n)
    return st.step


__all__ = ["StepObserver", "StepRecorder", "StepSelection", "StepTrace", "step", "step_path"]
