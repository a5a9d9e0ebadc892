"""The options of a trace, validated once: ``TraceOptions``. Every layer takes this object; none
re-lists or re-checks the keywords. ``TraceError`` is the error for their misuse.

``tracer.trace(...)`` builds one from its keywords; ``TraceOptions.from_kwargs(**kw)`` does the
same for callers that pass options through (``record_memory``, the framework callbacks,
``gradtrace run``), refusing unknown keywords by name.

The keywords themselves are listed once too, as ``TypedDict``s (``TraceKwargs`` and the two
narrower ones below it): ``tracer.trace``'s overloads, ``record_memory``, ``tracer.watch`` and the
framework callbacks take ``**options: Unpack[...]`` of one of them, so a type checker refuses a
misspelled option wherever it is passed, and a new option is added here and in ``TraceOptions``
(a test compares the two).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

if TYPE_CHECKING:  # the listeners' class records, a layer above this one: annotations only
    from tracer.record.listeners import Listener

HashKind = Literal["md5", "fast", "none"]
HASH_ALGORITHMS: tuple[HashKind, ...] = ("md5", "fast", "none")
# What ends a step of a step trace (``tracer.trace(steps=..., step_on=...)``, ``gradtrace run --step-on``).
StepOn = Literal["optimizer", "backward"]
STEP_ON: tuple[StepOn, ...] = ("optimizer", "backward")
# Bytes of tensor values one trace keeps at most (``keep_values``) unless ``keep_values_bytes``
# says otherwise: enough for the weights of a few layers of a small model.
DEFAULT_KEEP_VALUES_BYTES = 64 << 20


class RaisedOnPurpose:
    """Marks an exception gradtrace raises into the user's program on purpose (a stop the user
    asked for: ``raise_on_nonfinite``, a watch that trips; a misuse of the tracer). Any other
    exception from gradtrace's own code while it records is a fault of gradtrace: the recorder
    stops and the program goes on (tracer.record.failsafe)."""


class TraceError(RuntimeError, RaisedOnPurpose):
    """Misuse of the tracer (an accidental nested trace, bad options)."""


def _positive(name: str, value: object, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{name} must be a positive integer, got {value!r}")


def _flag(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):
        allowed = "True, False or None" if optional else "True or False"
        raise TraceError(f"{name} must be {allowed}, got {value!r}")


def value_patterns(value: object) -> bool | tuple[str, ...]:
    """``keep_values`` normalised: False (keep nothing), True (parameters and buffers) or a tuple
    of non-empty glob patterns (one string is one pattern)."""
    if value is None or value is False:
        return False
    if value is True:
        return True
    out: tuple[object, ...] | None = None
    if isinstance(value, str):
        out = (value,)
    elif isinstance(value, Iterable):
        out = tuple(value)
    if out is None or not all(isinstance(p, str) and p for p in out):
        raise TraceError("keep_values must be True (parameters and buffers), a glob pattern or a list of "
                         f"glob patterns on tensor names and module paths, got {value!r}")
    return tuple(str(p) for p in out) or False


class ReplayKwargs(TypedDict, total=False):
    """What a trace records, as keywords (see ``tracer.trace`` for each): every option of
    ``tracer.trace`` but ``out`` and ``check_numerics``. ``tracer.watch`` takes these for the
    replay of a tripped step (it names the incident file itself, and the replay always checks)."""

    hash: HashKind
    stacks: bool
    stats: bool | None
    flush_every: int
    listeners: Iterable[Listener] | None
    memory: bool
    max_calls: int | None
    max_bytes: int | None
    raise_on_nonfinite: bool
    optimizer_ops: bool
    node_runs: bool | None
    optimizer_state: bool | None
    keep_values: bool | str | Iterable[str]
    keep_values_bytes: int


class RecordKwargs(ReplayKwargs, total=False):
    """Every option of ``tracer.trace`` but ``out``: what the framework callbacks'
    ``TraceCallback``s take beside their own ``out=`` (with a default of their own)."""

    check_numerics: bool


class TraceKwargs(RecordKwargs, total=False):
    """Every option of ``tracer.trace`` (``TraceOptions``' fields, in the types a caller may pass:
    a path-like ``out``, any iterable of ``listeners``, one glob or several for ``keep_values``)."""

    out: str | os.PathLike[str] | None


@dataclass(frozen=True)
class TraceOptions:
    """What a trace records and where it goes (see ``tracer.trace`` for each option).

    ``stats=None`` means: on when hashing or checking numerics (``effective_stats``);
    ``raise_on_nonfinite`` implies ``check_numerics`` (``numerics``).
    """

    hash: HashKind = "md5"
    stacks: bool = True
    stats: bool | None = None
    out: str | None = None
    flush_every: int = 256
    listeners: tuple[Any, ...] = ()
    memory: bool = False
    max_calls: int | None = None
    max_bytes: int | None = None
    check_numerics: bool = False
    raise_on_nonfinite: bool = False
    optimizer_ops: bool = False
    # Hooks on built-in grad nodes: None, when checksums or stats are taken (or a listener needs
    # them); True: always; False: only on accumulators and nodes that run Python.
    node_runs: bool | None = None
    # The optimizer step's state (AdamW's exp_avg, ...) as the step's inputs and outputs: None,
    # with checksums, stats asked for, kept values or memory (not for a NaN/Inf check alone);
    # True: always; False: never.
    optimizer_state: bool | None = None
    # True: every parameter and buffer; patterns: fnmatch globs on tensor names and module paths.
    keep_values: bool | tuple[str, ...] = False
    keep_values_bytes: int = DEFAULT_KEEP_VALUES_BYTES

    def __post_init__(self) -> None:
        if self.hash not in HASH_ALGORITHMS:
            raise TraceError(f"hash must be 'md5', 'fast' or 'none', got {self.hash!r}")
        for name in ("stacks", "memory", "check_numerics", "raise_on_nonfinite", "optimizer_ops"):
            _flag(name, getattr(self, name))
        _flag("stats", self.stats, optional=True)
        _flag("node_runs", self.node_runs, optional=True)
        _flag("optimizer_state", self.optimizer_state, optional=True)
        _positive("flush_every", self.flush_every, optional=False)
        _positive("max_calls", self.max_calls)
        _positive("max_bytes", self.max_bytes)
        if self.out is not None:
            if not isinstance(self.out, str | os.PathLike):
                raise TraceError(f"out must be a path, got {self.out!r}")
            object.__setattr__(self, "out", os.fspath(self.out))
        object.__setattr__(self, "keep_values", value_patterns(self.keep_values))
        _positive("keep_values_bytes", self.keep_values_bytes, optional=False)
        if not isinstance(self.listeners, tuple):
            object.__setattr__(self, "listeners", tuple(self.listeners or ()))

    @property
    def keeps_values(self) -> bool:
        """Whether some tensors' values are kept (``keep_values``)."""
        return self.keep_values is not False

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> TraceOptions:
        """Options from keywords, refusing unknown ones (``TraceError`` naming them)."""
        unknown = sorted(set(kwargs) - OPTION_NAMES)
        if unknown:
            raise TraceError(f"unknown option(s) for tracer.trace(): {', '.join(unknown)}")
        return cls(**kwargs)

    def replace(self, **changes: Any) -> TraceOptions:
        return dataclasses.replace(self, **changes)

    @property
    def numerics(self) -> bool:
        """Whether NaN/Inf are looked for (``check_numerics`` or ``raise_on_nonfinite``)."""
        return self.check_numerics or self.raise_on_nonfinite

    @property
    def every_node_run(self) -> bool:
        """Whether every grad node's run is recorded from the start (``node_runs``): else only
        accumulators' and custom Functions', and others' when a backward starts that needs them."""
        if self.node_runs is not None:
            return self.node_runs
        # (Kept values may be gradients': every gradient is then named.)
        return self.reads_values

    @property
    def records_optimizer_state(self) -> bool:
        """Whether an optimizer step's state tensors are among its inputs and outputs
        (``optimizer_state``): by default when something reads what they hold (checksums,
        stats asked for, kept values) or where memory goes (the state's allocations get its
        names). A names + links + stacks trace leaves them out: on ResNet-50 they are half its
        tensor values, and without checksums they add no more than their names and shapes. So
        does a NaN/Inf check alone (``check_numerics`` without checksums or ``stats=True``): a
        NaN the step makes in its state reaches the parameters it updates in the same step,
        where the check finds it (the anomaly then says the state was not checked)."""
        if self.optimizer_state is not None:
            return self.optimizer_state
        return self.hash != "none" or self.stats is True or self.keeps_values or self.memory

    @property
    def reads_values(self) -> bool:
        """Whether tensor values are read at all: checksums, stats or kept values (what the
        default of ``node_runs`` turns on for; ``optimizer_state``'s leaves out stats that only
        a NaN/Inf check turned on: see records_optimizer_state)."""
        return self.hash != "none" or self.effective_stats or self.keeps_values

    @property
    def effective_stats(self) -> bool:
        """Whether every tensor's stats are computed."""
        if self.numerics:
            return True
        return self.hash != "none" if self.stats is None else self.stats


# The names of the options (TraceOptions' fields: TraceKwargs' keys, as a test checks).
OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(TraceOptions))
