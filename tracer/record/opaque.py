"""Opaque regions: code that ``torch.compile`` runs is one call of the trace (kind ``compiled``),
with the recorder out of its way while it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tracer.record.calls import PendingCall
from tracer.record.mode import put_back, take_off_top


class ModeOff:
    """The recording mode taken off the torch-function stack while compiled code runs.

    Dynamo guards compiled code on the mode stack and on whether torch functions are enabled.
    With the mode popped, both are as they are outside a trace: code compiled outside the block
    runs inside it without recompiling, and code compiled inside it is reused outside. The
    fallback, where torch lacks the stack functions or another mode sits above ours, is
    ``DisableTorchFunction``: the region is still opaque, but Dynamo recompiles for it.
    """

    __slots__ = ("_disabled", "_mode")

    def __init__(self, mode: TorchFunctionMode) -> None:
        self._mode: TorchFunctionMode | None = None
        self._disabled: Any = None
        if take_off_top(mode):
            self._mode = mode
        else:
            self._disabled = torch._C.DisableTorchFunction()
            self._disabled.__enter__()

    def restore(self) -> None:
        """Put the mode back where it was (once; later calls do nothing)."""
        if self._mode is not None:
            put_back(self._mode)
            self._mode = None
        elif self._disabled is not None:
            self._disabled.__exit__(None, None, None)
            self._disabled = None


@dataclass(slots=True)
class OpaqueRegion:
    """A compiled region running now: who runs it (a compiled module, or the frame of the wrapper
    ``torch.compile`` puts around a function), the mode taken off for it, the one-shot hook that
    ends a module's region (None for a function) and its call, to finish when it returns."""

    owner: object
    mode_off: ModeOff
    hook: Any
    pending: PendingCall


COMPILED_NOTE = "torch.compile regions are recorded as one opaque call each; the calls inside them were not seen"


__all__ = ["COMPILED_NOTE", "ModeOff", "OpaqueRegion"]
