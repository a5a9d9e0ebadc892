"""A Hugging Face ``transformers`` ``TrainerCallback`` that traces chosen training steps.

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
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Literal

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tracer.integrations.hf needs the transformers package (pip install transformers)") from exc

from tracer.loops.steps import StepRecorder, StepResults, StepSelection
from tracer.options import TraceOptions


class TraceCallback(TrainerCallback, StepResults):
    """Trace the chosen steps (``steps="1,3"``, ``"100-"`` or ``every=N``) into ``out``.

    ``trace_options`` are those of ``tracer.trace`` (``hash``, ``stacks``, ``stats``,
    ``max_calls``, ``max_bytes``, ``listeners``, ``flush_every``, ...); ``per_step_files``
    writes one file per step.
    """

    def __init__(self, steps: str | int | Iterable[int] | None = None, *, every: int | None = None,
                 out: str | os.PathLike[str] | None = "hf.gtrace", per_step_files: bool = False,
                 **trace_options: Any) -> None:
        self.selection = StepSelection.parse(steps, every)
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
        """Finish a step still being traced (``train()`` raised or stopped in the middle of it)."""
        self.recorder.end(exc, completed=False)

    def __enter__(self) -> TraceCallback:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        self.close(exc)
        return False


__all__ = ["TraceCallback"]
