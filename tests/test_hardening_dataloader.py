"""Batches that DataLoader workers send are inputs of the step, not calls: the main process
rebuilds each one from shared memory while unpickling it (``torch.multiprocessing``), and that
rebuilding (a ``torch.empty`` and a ``set_`` per tensor, as many and in an order that depend on
when each worker's batch came in) is not recorded. Three identical seeded runs of a training
loop over a two-worker DataLoader, traced over a few steps, diff EQUAL step for step."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import export
import tracer
from tracer.model import load_steps

STEPS = [1, 2, 3, 4]
STEP_CALLS = ["linear0", "tanh0", "linear1", "mse_loss0", "SGD0"]


def _loader(num_workers: int) -> DataLoader[Any]:
    """Batches in order (a shuffling sampler's own randperm, in this process, would be a call of
    whichever step asks for its next indices)."""
    data = TensorDataset(torch.randn(48, 8, generator=torch.Generator().manual_seed(1)),
                         torch.randn(48, 1, generator=torch.Generator().manual_seed(2)))
    return DataLoader(data, batch_size=8, num_workers=num_workers)


def _train(path: str) -> dict[int, tracer.Trace]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(steps="1-4", out=path):
        for x, y in _loader(num_workers=2):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return load_steps(path)


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="workers forked from the test process")
def test_worker_batches_are_inputs_and_identical_runs_diff_equal(tmp_path: Any) -> None:
    runs = [_train(os.fspath(tmp_path / f"run{i}.gtrace")) for i in range(3)]
    batches = list(_loader(num_workers=0))  # the same batches, made in this process
    for steps in runs:
        assert sorted(steps) == STEPS
        for k in STEPS:
            t = steps[k]
            assert [c.name for c in t.calls] == STEP_CALLS
            x, y = batches[k]
            linear0, mse = t["linear0"], t["mse_loss0"]
            assert linear0.inputs == ["input0", "0.weight", "0.bias"] and mse.inputs == ["linear1:out", "input1"]
            assert t.tensors["input0"].role == "input" and t.tensors["input0"].md5 == _md5(x)
            assert t.tensors["input1"].role == "input" and t.tensors["input1"].md5 == _md5(y)
    first = runs[0]
    for other in runs[1:]:
        for k in STEPS:
            result = export.diff(first[k], other[k])
            assert result.equal, (k, result.verdict())
