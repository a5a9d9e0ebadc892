"""The TorchFunctionMode that sees every torch call the user's code makes, and hands the ones
that make or change tensors to the recorder."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from tracer.record.recorder import Recorder


class RecordingMode(TorchFunctionMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder: Recorder | None = recorder  # None once the recorder is uninstalled

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
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
