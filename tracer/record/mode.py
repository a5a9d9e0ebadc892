"""The TorchFunctionMode that sees every torch call the user's code makes, and hands the ones
that make or change tensors to the recorder."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder


# True only while Dynamo traces Python (torch.compile of a function called inside the block):
# then the handler is compiled into the graph as the op itself, nothing recorded, so the mode
# causes no graph break and no recompilation. Its ops run untraced (one opaque region).
_dynamo_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", None) \
    or getattr(torch.compiler, "is_compiling", None) or (lambda: False)


class CompiledRegions:
    """Set from inside compiled code (Dynamo replays the attribute store after each run of the
    compiled graph): whether a compiled function ran while a trace was active."""

    ran = False


COMPILED = CompiledRegions()


class RecordingMode(TorchFunctionMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder: Recorder | None = recorder  # None once the recorder is uninstalled

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if _dynamo_compiling():
            COMPILED.ran = True
            return func(*args, **kwargs)
        rec = self.recorder
        if rec is None:
            return func(*args, **kwargs)
        try:  # ApiNames.describe, its cache hit inlined: this runs for every torch call
            hit = rec.api.cache.get(func)
        except TypeError:  # an unhashable callable
            hit = None
        api, short, kind, writes = hit if hit is not None else rec.api.describe(func)
        if rec.open_step is not None and kind != "skip" and not rec.step_running():
            rec.close_step("optimizer.step() raised; its changes up to there are recorded")
        if kind == "skip" or rec.paused or rec.stopped:
            return func(*args, **kwargs)
        if kind == "backward":
            return rec.record_backward(func, api, args, kwargs)
        if kind == "collective":
            # References to collectives taken before the trace land here, not in the wrappers
            # (tracer.features.distributed sets the hook while a process group is traced).
            hook = rec.collective_hook
            wrapped = hook(rec, func) if hook is not None else None
            if wrapped is not None:
                return wrapped(*args, **kwargs)
            kind = "op"
        return rec.record_call(func, api, short, kind, args, kwargs, writes)
