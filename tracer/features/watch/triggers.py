"""What makes a watched step an incident: ``on="nonfinite"`` (default), ``on="spike"`` /
``Spike(...)``, or a callable on the step's return value.

A trigger decides on the device (``check`` returns a 0-dim bool tensor and reads nothing back),
so a step costs no synchronisation; ``explain`` puts the decision into words once the flag has
been read, and ``observe`` hears every step read as fine (the spike trigger's running median).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.features.watch.sentinel import GRAD_NORM, LOSS, FlagValues
from tracer.options import TraceError


class Trigger:
    """Fires on a non-finite loss, gradient norm or parameter norm (``on="nonfinite"``)."""

    name = "nonfinite"

    def context(self) -> Any:
        """What ``check`` and ``explain`` need of this step (thresholds), fixed when it ends."""
        return None

    def check(self, values: torch.Tensor, result: Any, context: Any) -> torch.Tensor:
        return ~torch.isfinite(values).all()

    def explain(self, flag: FlagValues, context: Any) -> str:
        return flag.reason() or "a value was not finite on another rank"

    def observe(self, flag: FlagValues) -> None:
        pass


@dataclass
class Spike(Trigger):
    """Fires when the loss or the global gradient norm exceeds ``factor`` times its running median
    over the last ``window`` steps read as fine, once ``warmup`` such steps are known; also on
    anything non-finite. Meant for positive losses (a median at or below 0 never fires).

    The median covers steps whose flags were read, so with ``lag=1`` the step just before is not
    in it yet; a step that fired is never added to it."""

    factor: float = 10.0
    window: int = 100
    warmup: int = 10
    losses: deque[float] = field(init=False, repr=False, default_factory=deque)
    grad_norms: deque[float] = field(init=False, repr=False, default_factory=deque)

    name = "spike"

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, int | float) and self.factor > 1):
            raise TraceError(f"Spike factor must be a number above 1, got {self.factor!r}")
        for what in ("window", "warmup"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TraceError(f"Spike {what} must be a positive number of steps, got {v!r}")
        if self.warmup > self.window:
            raise TraceError(f"Spike warmup ({self.warmup}) cannot exceed window ({self.window})")
        self.losses = deque(maxlen=self.window)
        self.grad_norms = deque(maxlen=self.window)

    def _median(self, history: deque[float]) -> float | None:
        if len(history) < self.warmup:
            return None
        m = statistics.median(history)
        return m if m > 0 else None

    def context(self) -> tuple[float | None, float | None, int]:
        return self._median(self.losses), self._median(self.grad_norms), len(self.losses)

    def check(self, values: torch.Tensor, result: Any, context: Any) -> torch.Tensor:
        bad = ~torch.isfinite(values).all()
        loss_median, grad_median, _ = context
        if loss_median is not None:
            bad = bad | (values[LOSS] > self.factor * loss_median)
        if grad_median is not None:
            bad = bad | (values[GRAD_NORM] > self.factor * grad_median)
        return bad

    def explain(self, flag: FlagValues, context: Any) -> str:
        if flag.nonfinite:
            return flag.reason()
        loss_median, grad_median, n = context
        parts = []
        for what, v, m in (("loss", flag.loss, loss_median), ("gradient norm", flag.grad_norm, grad_median)):
            if v is not None and m is not None and v > self.factor * m:
                parts.append(f"the {what} {v:.6g} is above {self.factor:g} x its running median {m:.6g} "
                             f"(last {n} steps)")
        return ", ".join(parts) or "a spike on another rank"

    def observe(self, flag: FlagValues) -> None:
        if flag.loss is not None and math.isfinite(flag.loss):
            self.losses.append(flag.loss)
        if flag.grad_norm is not None and math.isfinite(flag.grad_norm):
            self.grad_norms.append(flag.grad_norm)


class CallableTrigger(Trigger):
    """``on=fn``: fires when ``fn(step_result)`` is true. ``fn`` may return a Python bool or a
    bool tensor; a tensor stays on the device (no synchronisation), a Python bool computed from
    a device tensor has already synchronised inside ``fn``."""

    name = "callable"

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def check(self, values: torch.Tensor, result: Any, context: Any) -> torch.Tensor:
        verdict = self.fn(result)
        if isinstance(verdict, torch.Tensor):
            return verdict.detach().reshape(-1).any()
        return torch.tensor(bool(verdict))

    def explain(self, flag: FlagValues, context: Any) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"on={name} fired" if flag.bad else f"on={name} fired on another rank"


def make_trigger(on: str | Trigger | Callable[[Any], Any]) -> Trigger:
    if isinstance(on, Trigger):
        return on
    if on == "nonfinite":
        return Trigger()
    if on == "spike":
        return Spike()
    if callable(on) and not isinstance(on, str):
        return CallableTrigger(on)
    raise TraceError(f"on must be 'nonfinite', 'spike', a tracer.Spike(...) or a callable, got {on!r}")
