"""A PyTorch Lightning ``Callback`` that traces chosen training steps.

    from tracer.integrations.lightning import TraceCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[TraceCallback(steps="100,200", out="pl.gtrace")])
    trainer.fit(model, loader)

Step N is ``trainer.global_step`` (optimizer steps taken so far) when its first batch starts; the
trace runs from ``on_train_batch_start`` until the batch after which ``global_step`` has moved
on, so it holds every accumulated micro-batch, the optimizer step and its closure. Only the
global-zero process traces. Built on ``lightning.pytorch`` where that package is installed,
else on ``pytorch_lightning``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]
    except ImportError as exc:
        raise ImportError("tracer.integrations.lightning needs lightning (or pytorch_lightning)") from exc

from tracer.loops.steps import StepRecorder, StepResults, StepSelection
from tracer.options import TraceOptions


class TraceCallback(Callback, StepResults):
    """Trace the chosen steps (``steps="1,3"``, ``"100-"`` or ``every=N``) into ``out``; the
    ``trace_options`` are those of ``tracer.trace`` (``hash``, ``max_calls``, ``max_bytes``, ...);
    ``per_step_files`` writes one file per step."""

    def __init__(self, steps: str | int | Iterable[int] | None = None, *, every: int | None = None,
                 out: str | os.PathLike[str] | None = "lightning.gtrace", per_step_files: bool = False,
                 **trace_options: Any) -> None:
        super().__init__()
        self.selection = StepSelection.parse(steps, every)
        self.recorder = StepRecorder(TraceOptions.from_kwargs(out=out, **trace_options),
                                     per_step_files=per_step_files)
        self._started: int | None = None  # the chosen step whose batches are running

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._started is None and trainer.is_global_zero and step in self.selection:
            self._started = step
            # Name parameters from the LightningModule (`net.0.weight`): training_step often
            # calls a submodule, never the LightningModule itself.
            self.recorder.begin(step, root_module=pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # With gradient accumulation a step spans several batches: it ends when the optimizer stepped.
        if self._started is not None and trainer.global_step != self._started:
            self._started = None
            self.recorder.end(completed=True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._started = None
        self.recorder.end(completed=False)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._started = None
        self.recorder.end(exception, completed=False)


__all__ = ["TraceCallback"]
