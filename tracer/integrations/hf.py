"""Hugging Face ``transformers`` ``TrainerCallback``s: ``TraceCallback`` traces chosen training
steps, ``WatchCallback`` watches every step and replays the first bad one under a full trace.

    from tracer.integrations.hf import TraceCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[TraceCallback(steps="100,200", out="hf.gtrace")])
    trainer.train()
    # hf.gtrace holds steps 100 and 200: tracer.load("hf.gtrace", step=200)

Step N is the Trainer's ``state.global_step`` when the step begins (0 for the first one): the
trace runs from ``on_step_begin`` to ``on_step_end``, so it holds every micro-batch of a
gradient-accumulation step, gradient clipping, the optimizer step, the scheduler step and
``zero_grad``. Only the main process (``state.is_world_process_zero``) traces. If ``train()``
raises inside a traced step no callback event follows: use the callback as a context manager
(``with TraceCallback(...) as cb:``) or call ``cb.close()`` so the step's trace is finished.

    from tracer.integrations.hf import WatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[WatchCallback(out="incident.gtrace", policy="skip")])
    trainer.train()

``WatchCallback`` is ``tracer.watch`` for the Trainer: a step is everything from
``on_step_begin`` to ``on_step_end`` (every micro-batch of a gradient-accumulation step, the
clipping, the optimizer step). It wraps the Trainer's ``training_step`` to keep each micro-batch's
inputs and loss; the replay of a tripped step runs those micro-batches again through the
original ``training_step``, clips as ``max_grad_norm`` says, steps the optimizer and zeroes the
gradients (the learning-rate scheduler is not stepped again: it only sets the next step's rate).
The callback finds its Trainer when training begins; ``cb.attach(trainer)`` names it explicitly.
Every process watches (each rank writes its own incident file).

    from tracer.integrations.hf import StepLogCallback

    trainer = Trainer(..., callbacks=[StepLogCallback("run.gtsteps")])

``StepLogCallback`` writes the step log of every optimizer step (``tracer.step_log``; for
``gradtrace bisect``): a step is an optimizer step, so a gradient-accumulation step is one step
whose record holds every micro-batch's loss and batch. ``WatchCallback(log="run.gtsteps")`` does
the same beside the watch.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import torch

from tracer.features.steplog import StepLog
from tracer.features.watch import Watch, WatchKwargs, check_options
from tracer.loops.steps import StepRecorder, StepResults, StepSelection
from tracer.options import RecordKwargs, TraceError, TraceOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11's; typing_extensions comes with torch

    class TrainerCallback:
        """transformers' ``TrainerCallback`` as the type checker sees it: a plain base, so that mypy's
        verdict on this module is the same with or without transformers installed (the events below
        take ``Any``: the Trainer's own signatures add nothing gradtrace relies on)."""
else:
    try:
        from transformers import TrainerCallback
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("tracer.integrations.hf needs the transformers package (pip install transformers)") from exc


class TraceCallback(TrainerCallback, StepResults):
    """Trace the chosen steps (``steps="1,3"``, ``"100-"`` or ``every=N``; neither: step 0, as
    ``gradtrace run``) into ``out``.

    ``trace_options`` are those of ``tracer.trace`` (``hash``, ``stacks``, ``stats``,
    ``max_calls``, ``max_bytes``, ``listeners``, ``flush_every``, ...); ``per_step_files``
    writes one file per step.
    """

    def __init__(self, steps: str | int | Iterable[int] | None = None, *, every: int | None = None,
                 out: str | os.PathLike[str] | None = "hf.gtrace", per_step_files: bool = False,
                 **trace_options: Unpack[RecordKwargs]) -> None:
        self.selection = StepSelection.parse(steps, every, first_by_default=True)
        self.recorder = StepRecorder(TraceOptions.from_kwargs(out=out, **trace_options),
                                     per_step_files=per_step_files)

    # Trainer events
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and state.global_step in self.selection:
            # Parameters are named from the Trainer's model even if a custom compute_loss
            # calls only parts of it.
            self.recorder.begin(state.global_step, root_module=kwargs.get("model"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.end(completed=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self, exc: BaseException | None = None) -> None:
        """Finish a step still being traced (``train()`` raised or stopped in the middle of it)
        and give the trace file's claim back."""
        self.recorder.close(exc)

    def __enter__(self) -> TraceCallback:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        self.close(exc)
        return False


class WatchCallback(TrainerCallback):
    """``tracer.watch`` for the Trainer (see the module docstring). ``watch_options`` are
    ``tracer.watch``'s: ``on``, ``out``, ``policy``, ``snapshots``, ``lag``, ``report``, and the
    replay's trace options. ``.watch`` is the ``Watch`` once training began (its ``incidents``)."""

    def __init__(self, **watch_options: Unpack[WatchKwargs]) -> None:
        self.watch_options = watch_options
        check_options(**watch_options)
        self.watch: Watch | None = None
        self.trainer: Any = None
        self.original_training_step: Callable[..., Any] | None = None
        self._micro: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._losses: list[torch.Tensor] = []
        self._open = False

    def attach(self, trainer: Any) -> WatchCallback:
        """Watch this Trainer (found by itself when training begins otherwise)."""
        if self.trainer is trainer and trainer.__dict__.get("training_step") == self._training_step:
            return self
        if self.trainer is not None and self.trainer is not trainer:
            raise TraceError("this WatchCallback already watches another Trainer")
        self.trainer = trainer
        self.original_training_step = trainer.training_step
        trainer.training_step = self._training_step  # the instance attribute shadows the method
        return self

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.original_training_step is not None
        loss = self.original_training_step(*args, **kwargs)
        if self._open and self.watch is not None:
            self._micro.append((args, kwargs))
            if isinstance(loss, torch.Tensor):
                self._losses.append(loss)
                self.watch.add_loss(loss)
        return loss

    # Trainer events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is not None:
            self.attach(self.trainer)  # again after a closed run
        else:
            trainer = _calling_trainer(self)
            if trainer is None:
                raise TraceError("WatchCallback could not find its Trainer: call cb.attach(trainer) before train()")
            self.attach(trainer)
        if self.watch is None or self.watch.closed:
            self.watch = Watch(kwargs.get("model"), kwargs.get("optimizer") or self.trainer.optimizer,
                               **self.watch_options)
            self.watch.name = "Trainer.training_step"

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is None:
            return
        self._micro, self._losses = [], []
        self.watch.begin_step()
        self._open = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is None or not self._open:
            return
        self._open = False
        self.watch.end_step(None, _HFReplay(self, list(self._micro), kwargs.get("model")))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Read the last flags, stop watching and give the Trainer its ``training_step`` back."""
        if self._open and self.watch is not None:
            self.watch.abort_step()
            self._open = False
        if self.trainer is not None and self.trainer.__dict__.get("training_step") == self._training_step:
            del self.trainer.training_step
        if self.watch is not None:
            self.watch.close()


class StepLogCallback(TrainerCallback):
    """The step log of the Trainer's optimizer steps into ``path`` (see the module docstring);
    ``.log`` is the ``StepLog`` once training began. ``model``/``optimizer`` come from the Trainer."""

    def __init__(self, path: str | os.PathLike[str] = "hf.gtsteps") -> None:
        self.path = os.fspath(path)
        self.log: StepLog | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.log is None or self.log.closed:
            self.log = StepLog(self.path, model=kwargs.get("model"), optimizer=kwargs.get("optimizer"),
                               source="tracer.integrations.hf.StepLogCallback").start()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Write the last steps and close the log (``train()`` raised: call it yourself)."""
        if self.log is not None:
            self.log.close()


class _HFReplay:
    """One Trainer step again: its micro-batches, clipping, the optimizer step, ``zero_grad``.
    Returns the micro-batch losses' sum (what the sentinel compares with the original's)."""

    def __init__(self, cb: WatchCallback, micro: list[tuple[tuple[Any, ...], dict[str, Any]]], model: Any) -> None:
        self.cb, self.micro, self.model = cb, micro, model

    def __call__(self) -> torch.Tensor | None:
        cb = self.cb
        assert cb.original_training_step is not None and cb.trainer is not None
        trainer = cb.trainer
        model = self.model or trainer.model
        losses = [cb.original_training_step(*args, **kwargs) for args, kwargs in self.micro]
        max_norm = getattr(trainer.args, "max_grad_norm", 0) or 0
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        trainer.optimizer.step()
        model.zero_grad()
        kept = [loss.detach().float() for loss in losses if isinstance(loss, torch.Tensor)]
        return torch.stack(kept).sum() if kept else None


def _calling_trainer(callback: Any) -> Any:
    """The Trainer whose callback handler holds ``callback``, from the frames calling it."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        handler = getattr(owner, "callback_handler", None)
        if handler is not None and callback in getattr(handler, "callbacks", ()):
            return owner
        frame = frame.f_back
    return None


__all__ = ["StepLogCallback", "TraceCallback", "WatchCallback"]
