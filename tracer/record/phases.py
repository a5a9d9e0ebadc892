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
_VERSIONS_BACK = 16  # versions looked back through for what made a written tensor (data has few)


class PhaseTracker:
    """Decides the phase of calls made outside backward (rules 2-7 of tracer.model.phases) and
    keeps what the rules need: whether the optimizer window is open, and the optimizer calls."""

    def __init__(self, tensors: dict[str, TensorRecord]) -> None:
        self._tensors = tensors
        self.window_open = False  # from the end of a backward run to the next module forward
        self._optimizer_calls: set[str] = set()
        # The forward calls made while the window is open (the next batch, made or prepared):
        # what they made is the step's data, also when the code then writes it in place.
        self._window_data: set[str] = set()

    def open_window(self) -> None:
        """An outermost backward run ended, or a step trace begins right after the optimizer step
        that ended the step before (what a loop does after ``step()``: EMA, ``zero_grad``,
        GradScaler's update): what follows may be optimizer work (rule 6)."""
        self.window_open = True
        self._window_data = set()

    def module_call(self) -> Phase:
        """Rule 3: a call inside a module's forward."""
        self.window_open = False
        return "forward"

    def outside_modules(self, name: str, kind: str, in_names: Sequence[str], produced: Sequence[Any],
                        writes: bool, api: str = "", written: Sequence[str] = ()) -> Phase:
        """The phase of call ``name`` (of ``api``), made outside every module's forward and outside
        backward; ``produced``: the tensors it returned or wrote; ``writes``: whether it wrote in
        place; ``written``: the new versions it made of what it wrote, where known."""
        phase = self._decide(kind, in_names, produced, writes, api, written)
        if phase == "optimizer":
            self._optimizer_calls.add(name)
        elif self.window_open:
            self._window_data.add(name)
        return phase

    def _decide(self, kind: str, in_names: Sequence[str], produced: Sequence[Any], writes: bool,
                api: str, written: Sequence[str] = ()) -> Phase:
        if kind == "optimizer":
            return "optimizer"
        # (a leaf that requires grad, written in place, builds no graph: a parameter updated
        # under no_grad, by hand, by LBFGS or by any optimizer whose ops are recorded one by one)
        if any(getattr(t, "requires_grad", False) and not (writes and _is_leaf(t)) for t in produced):
            return "forward"
        if reads_model_state(in_names, self._tensors, self._optimizer_calls, self.window_open, writes):
            return "optimizer"
        if self.window_open and ((writes and not replaces_whole(api) and not self._window_made(written))
                                 or _called_from_optimizer_code()):
            return "optimizer"
        return "forward"

    def _window_made(self, written: Sequence[str]) -> bool:
        """Whether everything a call wrote was made, since the window opened, by the step's data
        calls (``x = batch.clone(); x[0] = v``: data prepared in place, not an EMA's update of
        state the step found)."""
        if not written or not self._window_data:
            return False
        tensors = self._tensors
        for name in written:
            rec = tensors.get(name)
            for _ in range(_VERSIONS_BACK):  # back through the versions it wrote, to the one a call made
                if rec is None or rec.producer in self._window_data or rec.previous is None:
                    break
                rec = tensors.get(rec.previous)
            if rec is None or rec.producer not in self._window_data:
                return False
        return True


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
