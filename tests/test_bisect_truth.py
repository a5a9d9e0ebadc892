"""``gradtrace bisect`` says only what the step log can tell: the batch digest is the model's
inputs, not the labels a loop hands to the loss (a changed label is not called an input that
agrees); the gradients are read as ``optimizer.step()`` begins, so clipping ``.grad`` is not
called a changed backward pass; a generator the runs drew from differently is not called
unseeded; one step before the parting is "Step 0 agrees"; and logs without a step are bad input
(exit 2), not logs that agree."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracer
from export.bisect import bisect
from export.cli import main
from export.errors import UserError
from tracer.model.steplog import read_steplog

GRADS = "the gradients of 4 of 4 parameters differ, first in execution order: 0.weight, 0.bias, 2.weight and 1 more"


pytestmark = pytest.mark.usefixtures("one_thread")


def _run(path, *, steps: int = 4, flip_label_at: int | None = None, clip: float | None = None,
         lr_at: int | None = None, draw_at: int | None = None) -> str:
    """A small classifier trained with a step log; each keyword changes one thing at one step."""
    torch.manual_seed(0)
    x_all, y_all = torch.randn(8 * max(steps, 1), 10), torch.randint(0, 4, (8 * max(steps, 1),))
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.step_log(path, model=model, optimizer=opt):
        for step in range(steps):
            x, y = x_all[step * 8:(step + 1) * 8], y_all[step * 8:(step + 1) * 8].clone()
            if step == flip_label_at:
                y[0] = (y[0] + 1) % 4  # the labels go to the loss, not to the model
            if step == lr_at:
                opt.param_groups[0]["lr"] = 0.05
            if step == draw_at:
                torch.rand(1)  # one extra draw from a seeded generator, outside the step's computation
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return os.fspath(path)


def _loss_words(a: str, b: str, step: int) -> str:
    x, y = read_steplog(a).steps[step].loss[0], read_steplog(b).steps[step].loss[0]
    d = abs(x - y)
    return f"its loss differs: {x!r} in A, {y!r} in B (by {d:.2g}, {d / max(abs(x), abs(y)):.2g} relative)"


def test_a_changed_label_is_not_called_an_input_that_agrees(tmp_path):
    a, b = _run(tmp_path / "a.gtsteps", steps=6), _run(tmp_path / "b.gtsteps", steps=6, flip_label_at=3)
    r = bisect(a, b)
    assert (r.parting.step, r.parting.kind) == (3, "loss")
    assert r.describe() == (
        "The runs part at step 3: every input the log compares agrees (the parameters, the model's inputs, the "
        f"learning rates, the random state), yet {_loss_words(a, b, 3)}: the step's computation changed, or an "
        "input the log does not compare (the labels or targets the loss reads beside the model's output); "
        f"{GRADS}. Steps 0-2 agree bit for bit.")


def test_clipped_gradients_are_not_called_a_changed_backward_pass(tmp_path):
    a, b = _run(tmp_path / "a.gtsteps", steps=3), _run(tmp_path / "b.gtsteps", steps=3, clip=0.05)
    r = bisect(a, b)
    assert (r.parting.step, r.parting.kind) == (0, "grads")
    assert r.describe() == (
        "The runs part at step 0: every input the log compares agrees (the parameters, the model's inputs, the "
        "learning rates, the random state) and so does its loss, yet the gradients the optimizer read differ: the "
        "backward pass changed, or something changed the gradients between backward and optimizer.step() "
        f"(clipping, scaling, a hook); {GRADS}.")


def test_one_step_before_the_parting_is_step_0_agrees(tmp_path):
    a, b = _run(tmp_path / "a.gtsteps"), _run(tmp_path / "b.gtsteps", lr_at=1)
    assert bisect(a, b).describe() == (
        "The runs part at step 1: its learning rate differs: 0.1 in A, 0.05 in B, while its loss and gradients "
        "agree, so its update differs (seen as step 2 begins); the values of 4 of 4 parameters differ, first in "
        "execution order: 0.weight, 0.bias, 2.weight and 1 more. Step 0 agrees bit for bit.")


def test_a_seeded_generator_drawn_from_once_more_is_not_called_unseeded(tmp_path):
    a, b = _run(tmp_path / "a.gtsteps"), _run(tmp_path / "b.gtsteps", draw_at=2)
    r = bisect(a, b)
    assert r.exit_code == 0
    assert r.notes == ["(The random state of torch's CPU generator differs from step 2 on without changing any "
                       "result: the runs seeded it or drew from it differently, and no step's result depended on it "
                       "so far.)"]


def test_two_logs_without_a_step_are_bad_input(tmp_path, capsys):
    a, b = _run(tmp_path / "a.gtsteps", steps=0), _run(tmp_path / "b.gtsteps", steps=0)
    with pytest.raises(UserError):
        bisect(a, b)
    assert main(["bisect", a, b]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"gradtrace bisect: error: neither step log holds a step ({a}, {b}): no optimizer step "
                            "was logged in either run, nothing to compare\n")


def test_one_log_without_a_step_does_not_agree_on_0_steps(tmp_path):
    a, b = _run(tmp_path / "a.gtsteps", steps=0), _run(tmp_path / "b.gtsteps", steps=2)
    r = bisect(a, b)
    assert (r.exit_code, r.parting.kind) == (1, "length")
    assert r.describe() == ("A's log holds no step while B's holds 2 (A's program stopped early, failed or was "
                            "killed): no step to compare.")
