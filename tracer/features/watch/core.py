"""``Watch``: run a training step untraced with a snapshot and a sentinel; when the sentinel
trips, rewind and replay that step under a full trace (what ``tracer.watch()`` returns).

One watched step, ``K``:

1. ``begin_step``: copy what the step changes into a reused ``StateSnapshot``.
2. The step runs untraced. The ``Sentinel`` keeps the loss and the gradient and parameter norms
   on the device; at the end the trigger is evaluated there too and the flag starts its way to
   the host (``tracer.features.watch.sentinel``).
3. The flag of step K is read at the end of step ``K + lag``. ``lag=1`` (the default on GPUs)
   reads it once step K+1 is queued behind it, so the host waits for step K only, while the
   device has work; ``lag=0`` (the default on the CPU, where reading costs nothing) reads it at
   once. Until then step K's snapshot is kept: ``lag + 1`` snapshots exist at most.
4. When it tripped: restore step K's snapshot, replay step K (the same function and arguments,
   the same random state) under ``TraceSession(check_numerics=True, ...)``, save the incident
   trace with what the replay showed (``meta["watch"]``: did it reproduce the trigger, with the
   same loss bits?) and follow the policy: ``"raise"`` restores the state from before step K and
   raises (``NonFiniteStepError``, a ``tracer.NonFiniteError``, when the replay found the first
   NaN/Inf; ``WatchTripped`` otherwise) from the caller's frame; ``"skip"`` restores the state
   from before step K and goes on; ``"continue"`` puts back the state the run had reached and goes
   on. Steps after K that ran before its flag was read (``lag`` of them at most) are undone by
   ``raise`` and ``skip``: ``incident.undone``.
5. The state is put in place first; then the incident trace is saved and its HTML report written
   beside it (the report by the ``gradtrace.report_writers`` plug-in: tracer does not import
   export; ``report=False`` skips it). A save that fails (a missing directory, a full disk) is said
   in a warning naming the path, and the run goes on as the policy says.
6. One message per incident, the numerics report's story with what was restored and what to run
   next: the exception's under ``"raise"``, a warning of the ``gradtrace.watch`` logger otherwise.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import struct
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
import torch.distributed as dist

from tracer.analysis.numerics import Anomaly, NonFiniteError, NumericsReport
from tracer.features import logs as _logs  # noqa: F401  (installs the gradtrace console handler)
from tracer.features.distributed import rank_path
from tracer.features.plugins import session_plugins
from tracer.features.steplog import StepLog, paused
from tracer.features.watch import registry
from tracer.features.watch.sentinel import Flag, FlagValues, Sentinel
from tracer.features.watch.snapshot import Layout, Placement, StateSnapshot, real_optimizer, state_bytes
from tracer.features.watch.triggers import Trigger, make_trigger
from tracer.model import Trace
from tracer.model.display import format_size, plural, sibling, with_tag
from tracer.options import RaisedOnPurpose, ReplayKwargs, TraceError, TraceOptions
from tracer.record.recorder import active_recorder
from tracer.record.session import NumericsWarning, TraceSession

if TYPE_CHECKING:  # annotations only (typing.Unpack is Python 3.11's; typing_extensions comes with torch)
    from typing_extensions import Unpack

# Status lines at INFO (logging.getLogger("gradtrace.watch").setLevel("INFO") shows them),
# incidents at WARNING. Not a log component of traces: set_log_level() leaves it alone.
LOG = logging.getLogger("gradtrace.watch")

Policy = Literal["raise", "skip", "continue"]
POLICIES: tuple[Policy, ...] = ("raise", "skip", "continue")
SnapshotPlacement = Literal["auto", "device", "host"]
F = TypeVar("F", bound=Callable[..., Any])
# Snapshots go on the device when all of them take at most this share of its free memory.
DEVICE_SHARE = 0.5


@dataclass
class Incident:
    """One tripped step: what fired, what the replay showed, what state the run is in, where its
    trace went."""

    step: int
    trigger: str
    reason: str
    policy: Policy
    path: str | None  # the incident trace (None: kept in memory only, ``trace``)
    report: str | None  # the HTML report, when one was written
    reproduced: bool  # the replay tripped the same trigger (and, where a loss was returned, with the same bits)
    same_loss_bits: bool | None  # None: the step returned no loss
    original: dict[str, float | None]
    replay: dict[str, float | None]
    anomaly: Anomaly | None  # the headline of the replay's numerics report (its first NaN/Inf)
    undone: list[int] = field(default_factory=list)
    rank: int | None = None
    replay_error: str | None = None
    trace: Trace | None = None
    numerics: NumericsReport | None = None  # the replay's story, the one every surface renders
    save_error: str | None = None  # why the incident trace (or its report) could not be written

    def restored(self) -> str:
        """What state the run is in now, by the policy."""
        undone = f" (steps {', '.join(map(str, self.undone))} undone with it: they ran before its flag was read)" \
            if self.undone else ""
        if self.policy == "continue":
            return "the run keeps the state it had reached (policy continue): the bad step's update stays"
        after = "the run goes on from there (policy skip)" if self.policy == "skip" else "raised (policy raise)"
        return (f"parameters, buffers, optimizer state and random state restored to before step {self.step}"
                f"{undone}; {after}")

    def overflowed_norm(self) -> bool:
        """A norm tripped as +Inf while the replay found every checked value finite: the norm of
        finite values overflowed (a diverging run), no tensor holds an Inf."""
        norms = [self.original.get("grad_norm"), self.original.get("param_norm")]
        return (self.numerics is not None and self.numerics.clean and self.numerics.checked > 0
                and any(v is not None and v == math.inf for v in norms))

    def next_command(self) -> str | None:
        """What to run next to look at the incident."""
        if self.path is None:
            return "the replayed step is kept in memory: incident.trace (give out= to save it)"
        show = f"gradtrace show {self.path} {self.anomaly.producer}" if self.anomaly is not None else \
            f"gradtrace summary {self.path}"
        return f"next: {show}; open {self.report}" if self.report else f"next: {show}; gradtrace report {self.path}"

    def describe(self) -> str:
        """The incident's one message: the trigger, the replay's story, the state, the files, next."""
        lines = [f"gradtrace watch: step {self.step} tripped: {self.reason}"]
        if self.numerics is not None and not self.numerics.clean:
            lines.append(self.numerics.describe())
        elif self.anomaly is not None:
            lines.append(self.anomaly.describe())
        elif self.overflowed_norm():
            lines.append("no value of the replayed step holds a NaN or Inf: the norm itself overflowed float32 (its "
                         "squares summed past ~3.4e38, values above ~1.8e19): the run diverges")
        if not self.reproduced:
            lines.append("the replay did not reproduce it (" + _replay_words(self) + "); the trace holds the replayed "
                         "step anyway")
        if self.replay_error is not None:
            lines.append(f"the replay raised {self.replay_error}")
        lines.append(self.restored())
        if self.path is not None:
            lines.append(f"incident trace: {self.path}" + (f", report: {self.report}" if self.report else ""))
        if self.save_error is not None:
            lines.append(self.save_error)
        nxt = self.next_command()
        if nxt is not None:
            lines.append(nxt)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "trigger": self.trigger, "reason": self.reason, "policy": self.policy,
                "reproduced": self.reproduced, "same_loss_bits": self.same_loss_bits, "original": self.original,
                "replay": self.replay, "undone": self.undone, "rank": self.rank, "replay_error": self.replay_error,
                "headline": None if self.numerics is None else self.numerics.headline_text()}


def _replay_words(i: Incident) -> str:
    o, r = i.original, i.replay
    return ", ".join(f"{k}: {o.get(k)!r} then {r.get(k)!r}" for k in ("loss", "grad_norm", "param_norm")
                     if o.get(k) is not None or r.get(k) is not None)


class WatchTripped(RuntimeError, RaisedOnPurpose):
    """A watched step tripped under ``policy="raise"``; ``.incident`` says what and where."""

    def __init__(self, incident: Incident) -> None:
        super().__init__(incident.describe())
        self.incident = incident


class NonFiniteStepError(NonFiniteError, WatchTripped):
    """A watched step tripped and its replay found the first NaN/Inf: a ``tracer.NonFiniteError``
    (``.anomaly``: the op and the user's line; ``.report``: the replay's story) that is also a
    ``WatchTripped`` (``.incident``)."""

    def __init__(self, incident: Incident) -> None:
        assert incident.anomaly is not None
        FloatingPointError.__init__(self, incident.describe())
        self.anomaly = incident.anomaly
        self.report = incident.numerics
        self.incident = incident


def check_options(*, model: Any = None, on: Any = "nonfinite", out: Any = None, policy: Any = "raise",
                  snapshots: Any = "auto", lag: Any = None, grads: Any = None, report: Any = None,
                  status_every: Any = None, log: Any = None, **trace_options: Any) -> TraceOptions:
    """The replay's trace options, after checking every option ``tracer.watch`` takes (a
    ``TraceError`` naming the first bad one); the framework callbacks check theirs at once."""
    if policy not in POLICIES:
        raise TraceError(f"policy must be 'raise', 'skip' or 'continue', got {policy!r}")
    if snapshots not in ("auto", "device", "host"):
        raise TraceError(f"snapshots must be 'auto', 'device' or 'host', got {snapshots!r}")
    if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
        raise TraceError(f"lag must be a number of steps >= 0, got {lag!r}")
    if status_every is not None and (isinstance(status_every, bool) or not isinstance(status_every, int)
                                     or status_every < 1):
        raise TraceError(f"status_every must be a positive number of steps, got {status_every!r}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TraceError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if out is not None and not isinstance(out, str | os.PathLike):
        raise TraceError(f"out must be a path or None, got {out!r}")
    if log is not None and not isinstance(log, str | os.PathLike):
        raise TraceError(f"log must be a path (the step log) or None, got {log!r}")
    for name in ("steps", "every", "check_numerics"):
        if name in trace_options:
            raise TraceError(f"tracer.watch() does not take {name}= (the replay is one step, with check_numerics on)")
    options = TraceOptions.from_kwargs(**{**trace_options, "check_numerics": True})
    if options.out is not None:
        raise TraceError("tracer.watch() takes out= for the incident trace (not as a trace option)")
    if not isinstance(on, Trigger):
        make_trigger(on)
    return options


@dataclass
class _Pending:
    step: int
    snapshot: StateSnapshot
    replay: Callable[[], Any]
    flag: Flag
    context: Any


ReportWriter = Callable[[Trace, str], object]
# report=: None or True, the HTML report by the gradtrace.report_writers plug-in; False, none.
ReportOption = ReportWriter | bool | None


class Watch:
    """See ``tracer.watch`` (``tracer.features.watch``) and the module docstring."""

    def __init__(self, model: torch.nn.Module | None, optimizer: Any, *, on: Any = "nonfinite",
                 out: str | os.PathLike[str] | None = "incident.gtrace", policy: Policy = "raise",
                 snapshots: SnapshotPlacement = "auto", lag: int | None = None, grads: bool | None = None,
                 report: ReportOption = None, status_every: int | None = None,
                 log: str | os.PathLike[str] | None = None, **trace_options: Unpack[ReplayKwargs]) -> None:
        self.options = check_options(model=model, on=on, out=out, policy=policy, snapshots=snapshots, lag=lag,
                                     status_every=status_every, log=log, **trace_options)
        try:
            self.optimizer = real_optimizer(optimizer) if optimizer is not None else None
        except TypeError as exc:
            raise TraceError(f"optimizer: {exc}") from None
        self.model = model
        self.trigger: Trigger = make_trigger(on)
        self.out = os.fspath(out) if out is not None else None
        self.policy: Policy = policy
        self.placement_choice: SnapshotPlacement = snapshots
        self.placement: Placement | None = None
        self.lag = lag
        self.grads = grads
        self.report = report
        self.status_every = status_every
        self.step = 0  # steps watched so far (the next step's number)
        self.incidents: list[Incident] = []
        self.last_checked: int | None = None  # the last step whose flag was read
        self.name = "step"
        self.closed = False
        self._slots: list[StateSnapshot] = []
        self._pending: deque[_Pending] = deque()
        self._sentinel: Sentinel | None = None
        self._layout: Layout | None = None
        self._current: StateSnapshot | None = None
        self._distributed = False
        # The step log of every optimizer step (tracer.features.steplog), when asked for.
        self.log = StepLog(log, model=model, optimizer=self.optimizer, source="tracer.watch").start() \
            if log is not None else None
        registry.add(self)
        _OPEN.add(self)

    # ---- as a decorator ------------------------------------------------------------------------
    def __call__(self, fn: F) -> F:
        """``@tracer.watch(model, opt)`` on a step function: every call is a watched step."""
        if not callable(fn):
            raise TraceError(f"tracer.watch(...) decorates a step function, got {fn!r}")
        self.name = getattr(fn, "__name__", self.name)

        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            try:
                return self.run(fn, *args, **kwargs)
            except WatchTripped as exc:  # raised from here, the frame the program called
                raise exc.with_traceback(None) from exc.__cause__

        watched.watch = self  # type: ignore[attr-defined]
        return watched  # type: ignore[return-value]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One watched call of ``fn(*args, **kwargs)``: its return value."""
        if self._current is not None:  # called from inside a watched step (or its replay): plain
            return fn(*args, **kwargs)
        self.begin_step()
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self.abort_step()
            raise
        __tracebackhide__ = True
        try:
            self.end_step(result, functools.partial(fn, *args, **kwargs))
        except WatchTripped as exc:  # from the caller's frame: the watch's own frames say nothing
            raise exc.with_traceback(None) from exc.__cause__
        return result

    # ---- the protocol the framework callbacks use ------------------------------------------------
    def begin_step(self) -> None:
        """A step starts: snapshot the state and arm the sentinel."""
        if self.closed:
            raise TraceError("this watch is closed")
        if self._current is not None:
            raise TraceError("a watched step is already running (watched steps do not nest)")
        if self._sentinel is None:
            self._start()
        snap = self._free_slot()
        self._layout = snap.capture(self.model, self.optimizer, self.step, grads=self.grads, layout=self._layout)
        self._current = snap
        assert self._sentinel is not None
        self._sentinel.begin()

    def add_loss(self, loss: torch.Tensor) -> None:
        """A loss of the running step (each micro-batch's, when the step returns none)."""
        if self._sentinel is not None:
            self._sentinel.add_loss(loss)

    def abort_step(self) -> None:
        """The running step raised: forget it (its snapshot is free again)."""
        if self._sentinel is not None:
            self._sentinel.abort()
        self._current = None

    def end_step(self, result: Any, replay: Callable[[], Any]) -> None:
        """The running step ended with ``result``; ``replay()`` runs it again from its snapshot.
        Reads the flags that are due and handles an incident (may raise, by the policy)."""
        snap, sentinel = self._current, self._sentinel
        if snap is None or sentinel is None:
            raise TraceError("end_step() without begin_step()")
        self._current = None
        context = self.trigger.context()
        flag = sentinel.end(result, lambda v, r: self.trigger.check(v, r, context), self._distributed)
        self._pending.append(_Pending(self.step, snap, replay, flag, context))
        self.step += 1
        lag = self.lag if self.lag is not None else 0
        while len(self._pending) > lag:
            self._resolve(self._pending.popleft())
        if self.status_every is not None and self.step % self.status_every == 0:
            LOG.info(self.status())

    def refresh(self) -> None:
        """Read the model's parameters and buffers afresh at the next step (after a module
        replaced a buffer or parameter tensor; optimizer changes are noticed by themselves)."""
        self._layout = None

    def flush(self) -> None:
        """Read every pending flag now (waits for the device) and handle what tripped."""
        while self._pending:
            self._resolve(self._pending.popleft())

    def close(self) -> None:
        """Read the last flags (handling a trip), remove the hooks and log the status line."""
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            _OPEN.discard(self)
            if self._sentinel is not None:
                self._sentinel.remove()
            if self.log is not None:
                self.log.close()
            LOG.info(self.status())

    # ---- status ----------------------------------------------------------------------------------
    @property
    def snapshot_count(self) -> int:
        """Snapshots allocated (``lag + 1`` at most)."""
        return len(self._slots)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes the snapshots hold."""
        return sum(s.nbytes for s in self._slots)

    def status(self) -> str:
        """One line: steps watched, the snapshots' memory, the last check, incidents."""
        where = self.placement or "not yet allocated"
        n = len(self._slots)
        last = "no check yet" if self.last_checked is None else f"last check: step {self.last_checked}"
        found = f"{plural(len(self.incidents), 'incident')} (first at step {self.incidents[0].step})" if self.incidents \
            else "no incident"
        return (f"gradtrace watch {self.name}: {plural(self.step, 'step')} watched, {plural(n, 'snapshot')} of "
                f"{format_size(self.snapshot_bytes // max(n, 1))} ({where}), {last}, {found}")

    # ---- internals --------------------------------------------------------------------------------
    def _start(self) -> None:
        self._sentinel = Sentinel(self.model, self.optimizer)
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        devices = {p.device.type for p in self._params()}
        on_gpu = "cuda" in devices
        if self.lag is None:
            self.lag = 1 if on_gpu else 0
        if self.placement_choice != "auto":
            self.placement = self.placement_choice
        elif not on_gpu:
            self.placement = "device"  # CPU tensors: copies on the CPU either way
        else:
            device = next(p.device for p in self._params() if p.device.type == "cuda")
            free, _ = torch.cuda.mem_get_info(device)
            need = (self.lag + 1) * state_bytes(self.model, self.optimizer)
            self.placement = "device" if need <= DEVICE_SHARE * free else "host"
        LOG.info(f"gradtrace watch {self.name}: trigger {self.trigger.name}, policy {self.policy}, "
                 f"snapshots on the {self.placement}, flags read {plural(self.lag, 'step')} late")

    def _params(self) -> list[torch.Tensor]:
        from_model = list(self.model.parameters()) if self.model is not None else []
        from_opt = [p for g in self.optimizer.param_groups for p in g["params"]] if self.optimizer is not None else []
        return from_model + from_opt

    def _free_slot(self) -> StateSnapshot:
        used = {id(p.snapshot) for p in self._pending}
        for s in self._slots:
            if id(s) not in used:
                return s
        assert self.placement is not None
        s = StateSnapshot(self.placement)
        self._slots.append(s)
        return s

    def _resolve(self, entry: _Pending) -> None:
        values = entry.flag.read()
        self.last_checked = entry.step
        if not values.bad_anywhere:
            self.trigger.observe(values)
            return
        self._incident(entry, values)

    def _incident(self, entry: _Pending, values: FlagValues) -> None:
        later = [p.step for p in self._pending]
        reached: StateSnapshot | None = None
        if self.policy == "continue":  # the state the run reached, to put back after the replay
            assert self.placement is not None
            reached = StateSnapshot(self.placement)
            reached.capture(self.model, self.optimizer, self.step)
        entry.snapshot.restore(self.model, self.optimizer)
        trace, replayed, error = self._replay(entry)
        incident = self._record(entry, values, replayed, trace, error, later)
        # The policy's state first: whatever happens to the files, the run goes on from it.
        if self.policy == "continue":
            assert reached is not None
            reached.restore(self.model, self.optimizer)
        else:
            entry.snapshot.restore(self.model, self.optimizer)
            self._pending.clear()
        self.incidents.append(incident)
        self._write(incident)
        if self.policy == "raise":  # the exception is the incident's one message
            raise NonFiniteStepError(incident) if incident.anomaly is not None else WatchTripped(incident)
        LOG.warning(incident.describe())

    def _write(self, incident: Incident) -> None:
        """Save the incident trace and write its HTML report beside it; a failure is said (a
        warning naming the path, and in the incident's message), never raised."""
        trace = incident.trace
        if trace is None or self.out is None:
            return
        path = with_tag(self.out, f"step{incident.step}")
        if incident.rank is not None:
            path = rank_path(path, incident.rank)
        try:
            trace.save(path)
        except Exception as exc:  # a missing directory, a full disk, no permission
            incident.save_error = (f"the incident trace could not be saved to {path} ({type(exc).__name__}: {exc}); "
                                   "the replayed step is kept in memory: incident.trace")
            warnings.warn(f"gradtrace watch: {incident.save_error}", RuntimeWarning, stacklevel=2)
            return
        incident.path = path
        writer = self.report if callable(self.report) else registry.html_writer() if self.report is not False else None
        if writer is None:
            return
        page = sibling(path, ".html")
        try:
            writer(trace, page)
            incident.report = page
        except Exception as exc:  # the trace is saved; the report is a convenience
            incident.save_error = f"the report {page} could not be written ({type(exc).__name__}: {exc})"
            warnings.warn(f"gradtrace watch: {incident.save_error}", RuntimeWarning, stacklevel=2)

    def _replay(self, entry: _Pending) -> tuple[Trace | None, FlagValues | None, BaseException | None]:
        sentinel = self._sentinel
        assert sentinel is not None
        active = active_recorder()
        if active is not None and not active.closed:
            return None, None, TraceError("another tracer.trace() block is active: the step was not replayed")
        session = TraceSession(self.options, plugins=session_plugins(self.options), header_extra={"step": entry.step})
        result: Any = None
        error: BaseException | None = None
        self._current = entry.snapshot  # a watched call inside the replay runs plainly
        sentinel.begin()
        try:
            # The incident says what the replay found; the trace's own warning would repeat it.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NumericsWarning)
                with session, paused():  # the step is in the step log already
                    result = entry.replay()
        except Exception as exc:  # the trace says "failed"; the incident says what was raised
            error = exc
        finally:
            self._current = None
        flag = sentinel.end(result, lambda v, r: self.trigger.check(v, r, entry.context), self._distributed)
        return session.trace, flag.read(), error

    def _record(self, entry: _Pending, values: FlagValues, replayed: FlagValues | None, trace: Trace | None,
                error: BaseException | None, later: list[int]) -> Incident:
        original = _numbers(values)
        replay = _numbers(replayed) if replayed is not None else {}
        same_bits = None if values.loss is None or replayed is None or replayed.loss is None \
            else _bits(values.loss) == _bits(replayed.loss)
        reproduced = replayed is not None and replayed.bad_anywhere and same_bits is not False
        numerics = trace.anomalies if trace is not None else None
        anomaly = numerics.headline if numerics is not None else None
        rank = dist.get_rank() if self._distributed else None
        incident = Incident(entry.step, self.trigger.name, self.trigger.explain(values, entry.context), self.policy,
                            None, None, reproduced, same_bits, original, replay, anomaly, later, rank,
                            None if error is None else f"{type(error).__name__}: {error}", trace, numerics)
        if trace is not None:
            trace.meta["watch"] = incident.to_json()
            trace.notes.append(f"watch: step {entry.step} tripped ({incident.reason}); "
                               + ("the replay reproduced it" + (" with the same loss bits" if same_bits else "")
                                  if reproduced else "the replay did NOT reproduce it: " + _replay_words(incident)))
        return incident


def _numbers(v: FlagValues) -> dict[str, float | None]:
    return {"loss": v.loss, "grad_norm": v.grad_norm, "param_norm": v.param_norm}


def _bits(x: float) -> bytes:
    return struct.pack("<f", x)  # the loss as the float32 the device held


_OPEN: weakref.WeakSet[Watch] = weakref.WeakSet()


@atexit.register
def _close_open_watches() -> None:
    """A decorated step function has no end: read its last flags when the program ends."""
    for w in list(_OPEN):
        try:
            w.close()
        except Exception as exc:  # at exit there is no caller to raise to
            LOG.error(f"gradtrace watch {w.name}: {exc}")
