"""PyTorch Lightning ``Callback``s: ``TraceCallback`` traces chosen training steps,
``WatchCallback`` watches every step and replays the first bad one under a full trace.

    from tracer.integrations.lightning import TraceCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[TraceCallback(steps="100,200", out="pl.gtrace")])
    trainer.fit(model, loader)

Step N is ``trainer.global_step`` (optimizer steps taken so far) when its first batch starts; the
trace runs from ``on_train_batch_start`` until the batch after which ``global_step`` has moved
on, so it holds every accumulated micro-batch, the optimizer step and its closure. Only the
global-zero process traces. Built on ``lightning.pytorch`` where that package is installed,
else on ``pytorch_lightning``.

    from tracer.integrations.lightning import WatchCallback

    trainer = L.Trainer(max_steps=100_000, callbacks=[WatchCallback(out="incident.gtrace", policy="skip")])

``WatchCallback`` is ``tracer.watch`` for Lightning's automatic optimization: a step runs from its
first micro-batch's ``on_train_batch_start`` to the batch after which ``global_step`` moved on.
The replay of a tripped step runs its batches again: ``optimizer.zero_grad()``, then per batch
``training_step`` (through the strategy, so precision contexts apply) and ``backward`` of the loss
divided by ``accumulate_grad_batches``, then gradient clipping as the Trainer is configured and
``optimizer.step()``. Manual optimization is not replayed this way: use ``tracer.watch`` on your
own step function there. Every process watches (each rank writes its own incident file).

    from tracer.integrations.lightning import StepLogCallback

    trainer = L.Trainer(max_steps=100_000, callbacks=[StepLogCallback("run.gtsteps")])

``StepLogCallback`` writes the step log of every optimizer step (``tracer.step_log``; for
``gradtrace bisect``); ``WatchCallback(log="run.gtsteps")`` does the same beside the watch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from tracer.features.steplog import StepLog
from tracer.features.watch import Watch, WatchKwargs, check_options
from tracer.loops.steps import StepRecorder, StepResults, StepSelection
from tracer.options import RecordKwargs, TraceOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11's; typing_extensions comes with torch

    class Callback:
        """Lightning's ``Callback`` as the type checker sees it: a plain base, so that mypy's verdict on
        this module is the same whether lightning, pytorch_lightning or neither is installed (the hooks
        below take ``Any``: Lightning's own signatures add nothing gradtrace relies on)."""
else:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:  # pragma: no cover - depends on the environment
        try:
            from pytorch_lightning.callbacks import Callback
        except ImportError as exc:
            raise ImportError("tracer.integrations.lightning needs lightning (or pytorch_lightning)") from exc


class TraceCallback(Callback, StepResults):
    """Trace the chosen steps (``steps="1,3"``, ``"100-"`` or ``every=N``; neither: step 0, as
    ``gradtrace run``) into ``out``; the ``trace_options`` are those of ``tracer.trace`` (``hash``, ``max_calls``, ``max_bytes``, ...);
    ``per_step_files`` writes one file per step."""

    def __init__(self, steps: str | int | Iterable[int] | None = None, *, every: int | None = None,
                 out: str | os.PathLike[str] | None = "lightning.gtrace", per_step_files: bool = False,
                 **trace_options: Unpack[RecordKwargs]) -> None:
        super().__init__()
        self.selection = StepSelection.parse(steps, every, first_by_default=True)
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
        self.recorder.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._started = None
        self.recorder.close(exception)


class WatchCallback(Callback):
    """``tracer.watch`` for a Lightning Trainer (see the module docstring). ``watch_options`` are
    ``tracer.watch``'s; ``.watch`` is the ``Watch`` once training started (its ``incidents``)."""

    def __init__(self, **watch_options: Unpack[WatchKwargs]) -> None:
        super().__init__()
        check_options(**watch_options)
        self.watch_options = watch_options
        self.watch: Watch | None = None
        self._started: int | None = None  # global_step of the step whose batches are running
        self._batches: list[tuple[Any, int]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.optimizers:
            return
        self.watch = Watch(pl_module, trainer.optimizers[0], **self.watch_options)
        self.watch.name = f"{type(pl_module).__name__}.training_step"

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.watch is None or not pl_module.automatic_optimization:
            return
        if self._started is None:
            self._started = trainer.global_step
            self._batches = []
            self.watch.begin_step()
        self._batches.append((batch, batch_idx))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.watch is None or self._started is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self.watch.add_loss(loss)
        if trainer.global_step != self._started:  # the optimizer stepped: the step is complete
            self._started = None
            self.watch.end_step(None, _LightningReplay(trainer, pl_module, self._batches))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close(abort=True)

    def _close(self, abort: bool = False) -> None:
        if self.watch is None:
            return
        if self._started is not None:
            self.watch.abort_step()
            self._started = None
        if abort:  # the training already failed: read nothing more
            self.watch.closed = True
        else:
            self.watch.close()


class StepLogCallback(Callback):
    """The step log of the Trainer's optimizer steps into ``path`` (the LightningModule names the
    parameters; with one optimizer only its steps count, with several every one's); ``.log`` is
    the ``StepLog`` once training started."""

    def __init__(self, path: str | os.PathLike[str] = "lightning.gtsteps") -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.log: StepLog | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        self.log = StepLog(self.path, model=pl_module, optimizer=optimizer,
                           source="tracer.integrations.lightning.StepLogCallback").start()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.log is not None:
            self.log.close()


class _LightningReplay:
    """One automatic-optimization step again; returns the sum of its normalised batch losses
    (what Lightning reports per batch, so the sentinel compares like with like)."""

    def __init__(self, trainer: Any, module: Any, batches: list[tuple[Any, int]]) -> None:
        self.trainer, self.module, self.batches = trainer, module, list(batches)

    def __call__(self) -> torch.Tensor | None:
        trainer, module = self.trainer, self.module
        optimizer = trainer.optimizers[0]
        optimizer.zero_grad()
        losses = []
        for batch, batch_idx in self.batches:
            out = trainer.strategy.training_step(batch, batch_idx)
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor):
                continue
            loss = loss / trainer.accumulate_grad_batches
            loss.backward()
            losses.append(loss.detach().float())
        if trainer.gradient_clip_val:
            if trainer.gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(module.parameters(), trainer.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(module.parameters(), trainer.gradient_clip_val)
        optimizer.step()
        return torch.stack(losses).sum() if losses else None


__all__ = ["StepLogCallback", "TraceCallback", "WatchCallback"]
