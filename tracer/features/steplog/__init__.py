"""The step log: a few facts of every optimizer step of a run in a small append-only file
(``.gtsteps``), so that ``gradtrace bisect`` can find the first step where two runs part.

    with tracer.step_log("run.gtsteps"):         # every optimizer step of the loop inside
        for batch in loader:
            loss = model(**batch).loss
            loss.backward(); opt.step(); opt.zero_grad()

``tracer.watch(model, opt, log="run.gtsteps")``, ``gradtrace run --log run.gtsteps train.py`` and
the framework callbacks (``StepLogCallback``, ``WatchCallback(log=...)``) open the same log.
See ``recorder`` for what is written when, ``digests`` for the fingerprints and ``inputs`` for
the batch and random states; the file format is ``tracer.model.steplog``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tracer.features.steplog.recorder import StepLog, paused, program_meta


def step_log(path: str | os.PathLike[str], *, model: torch.nn.Module | None = None, optimizer: Any = None) -> StepLog:
    """Log every optimizer step from now on into ``path`` (a new file), until ``close()``, the
    end of the ``with`` block, or the end of the program.

    ``model``: whose module paths name the parameters (default: the modules each step's first
    forward calls outermost); ``optimizer``: log only this optimizer's steps (default: every
    ``optimizer.step()`` on this thread, as ``gradtrace run`` counts steps). Costs no snapshot:
    a fingerprint and a norm per parameter and gradient, computed on the device and read a
    step later."""
    return StepLog(path, model=model, optimizer=optimizer).start()


__all__ = ["StepLog", "paused", "program_meta", "step_log"]
