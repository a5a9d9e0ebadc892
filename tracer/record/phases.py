"""Which phase of a step a call belongs to, decided as it is recorded: the rules of
``tracer.model.phases`` (forward, backward, optimizer) applied with what the recorder sees live."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from tracer.model import TensorRecord
from tracer.model.phases import is_optimizer_code, reads_model_state, replaces_whole
from tracer.model.records import Phase

_CALLER_DEPTH = 16  # frames looked at for rule 6's code test (torch's own call chains are short)


class PhaseTracker:
    """Decides the phase of calls made outside backward (rules 2-7 of tracer.model.phases) and
    keeps what the rules need: whether the optimizer window is open, and the optimizer calls."""

    def __init__(self, tensors: dict[str, TensorRecord]) -> None:
        self._tensors = tensors
        self.window_open = False  # from the end of a backward run to the next module forward
        self._optimizer_calls: set[str] = set()

    def open_window(self) -> None:
        """An outermost backward run ended, or a step trace begins right after the optimizer step
        that ended the step before (what a loop does after ``step()``: EMA, ``zero_grad``,
        GradScaler's update): what follows may be optimizer work (rule 6)."""
        self.window_open = True

    def module_call(self) -> Phase:
        """Rule 3: a call inside a module's forward."""
        self.window_open = False
        return "forward"

    def outside_modules(self, name: str, kind: str, in_names: Sequence[str], produced: Sequence[Any],
                        writes: bool, api: str = "") -> Phase:
        """The phase of call ``name`` (of ``api``), made outside every module's forward and outside
        backward; ``produced``: the tensors it returned or wrote; ``writes``: whether it wrote in
        place."""
        phase = self._decide(kind, in_names, produced, writes, api)
        if phase == "optimizer":
            self._optimizer_calls.add(name)
        return phase

    def _decide(self, kind: str, in_names: Sequence[str], produced: Sequence[Any], writes: bool,
                api: str) -> Phase:
        if kind == "optimizer":
            return "optimizer"
        # (a leaf that requires grad, written in place, builds no graph: a parameter updated
        # under no_grad, by hand, by LBFGS or by any optimizer whose ops are recorded one by one)
        if any(getattr(t, "requires_grad", False) and not (writes and _is_leaf(t)) for t in produced):
            return "forward"
        if reads_model_state(in_names, self._tensors, self._optimizer_calls, self.window_open, writes):
            return "optimizer"
        if self.window_open and ((writes and not replaces_whole(api)) or _called_from_optimizer_code()):
            return "optimizer"
        return "forward"


def _is_leaf(t: Any) -> bool:
    try:
        return bool(t.is_leaf)
    except RuntimeError:  # a view made under no_grad whose base changed in place refuses it
        return False


def _called_from_optimizer_code() -> bool:
    """Whether torch's optimizer, AMP or clipping code is among the callers (rule 6)."""
    f: FrameType | None = sys._getframe(2)
    for _ in range(_CALLER_DEPTH):
        if f is None:
            return False
        if is_optimizer_code(f.f_code.co_filename):
            return True
        f = f.f_back
    return False


__all__ = ["PhaseTracker"]
