"""``gradtrace bisect`` and the random generators: a generator is blamed for the step where the
runs part only on the log's evidence that the step used it. Python's ``random`` and NumPy's
global generator are seeded differently in every process (``random.seed()`` /
``numpy.random.seed()`` here, as a fresh process does): a change of the computation at step 0
is the computation's (kind ``loss``), with the generators said beside; a change of torch's seed
(dropout) at step 0 is still torch's RNG, and so is an unseeded generator the steps draw from."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import tracer
from export.bisect import bisect
from tracer.model.steplog import StepLogFormatError, read_steplog

PY_NP_IDLE = ("(The random states of NumPy's global generator and Python's random differ as step 0 begins, but "
              "neither run draws from them before step 1: not what changed the step.)")
PY_NP_UNKNOWN = ("(The random states of NumPy's global generator and Python's random differ as step 0 begins, as "
                 "an unseeded generator's does in every process; the log cannot tell whether the step draws from "
                 "them.)")


@pytest.fixture(autouse=True)
def _keep_global_generators():
    """The runs reseed Python's and NumPy's global generators: put them back afterwards."""
    py, npy = random.getstate(), np.random.get_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)


def _run(path, *, steps: int = 3, scale: float = 1.0, dropout_seed: int | None = None,
         python_noise: bool = False) -> str:
    """A small regression trained with a step log, as a fresh process would: Python's and NumPy's
    generators unseeded; ``scale`` changes the computation, ``dropout_seed`` reseeds torch (a
    dropout draws from it every step), ``python_noise`` draws from Python's ``random`` every step."""
    random.seed()
    np.random.seed()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)]
    if dropout_seed is not None:
        layers.insert(2, torch.nn.Dropout(0.5))
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 12).view(3, 4)  # fixed data: no generator drawn for it
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tracer.step_log(path, model=model, optimizer=opt):
            for _ in range(steps):
                noise = 1 + random.random() * 1e-3 if python_noise else 1.0
                (model(x) * scale * noise).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return os.fspath(path)


def _loss_words(a: str, b: str) -> str:
    """``its loss differs: X in A, Y in B (by D, R relative)`` from the logs' step 0."""
    x, y = read_steplog(a).steps[0].loss[0], read_steplog(b).steps[0].loss[0]
    d = abs(x - y)
    return f"its loss differs: {x!r} in A, {y!r} in B (by {d:.2g}, {d / max(abs(x), abs(y)):.2g} relative)"


GRADS = "the gradients of 4 of 4 parameters differ, first in execution order: 0.weight, 0.bias, 2.weight and 1 more"
GRADS_DROPOUT = ("the gradients of 4 of 4 parameters differ, first in execution order: 0.weight, 0.bias, 3.weight "
                 "and 1 more")
COMPUTATION = ("The runs part at step 0: every input the log compares agrees (the parameters, the model's inputs, the "
               "learning rates), yet ")
CHANGED = ("the step's computation changed, or an input the log does not compare (the labels or targets the loss "
           "reads beside the model's output)")


def test_a_computation_change_at_step_0_is_not_blamed_on_unseeded_generators(tmp_path):
    a, b = _run(tmp_path / "a.gtsteps"), _run(tmp_path / "b.gtsteps", scale=1.001)
    sa, sb = read_steplog(a).steps, read_steplog(b).steps
    assert sa[0].rng["python"] != sb[0].rng["python"] and sa[0].rng["numpy"] != sb[0].rng["numpy"]
    assert sa[0].rng["torch"] == sb[0].rng["torch"]
    r = bisect(a, b)
    assert (r.exit_code, r.parting.step, r.parting.kind) == (1, 0, "loss")
    assert r.describe() == (f"{COMPUTATION}{_loss_words(a, b)}: {CHANGED}; {GRADS}. "
                            f"{PY_NP_IDLE}")
    assert r.to_json()["kind"] == "loss"


def test_a_computation_change_in_a_one_step_log_is_the_computation_s_too(tmp_path):
    # No next step: the log cannot tell whether step 0 drew from Python's or NumPy's generator.
    a, b = _run(tmp_path / "a.gtsteps", steps=1), _run(tmp_path / "b.gtsteps", steps=1, scale=1.001)
    r = bisect(a, b)
    assert (r.parting.step, r.parting.kind) == (0, "loss")
    assert r.describe() == (f"{COMPUTATION}{_loss_words(a, b)}: {CHANGED}; {GRADS}. "
                            f"{PY_NP_UNKNOWN}")


def test_a_log_unreadable_after_the_step_where_the_runs_part_cannot_tell_either(tmp_path):
    a, b = _run(tmp_path / "a.gtsteps"), _run(tmp_path / "b.gtsteps", scale=1.001)
    with open(b, "rb") as fh:
        lines = fh.read().splitlines(keepends=True)
    assert lines[3].startswith(b'{"t":"step"') and b'"step":1,' in lines[3]
    bad = tmp_path / "bad.gtsteps"
    bad.write_bytes(b"".join(lines[:3]) + b'{"t":"step","step":"one"}\n' + b"".join(lines[4:]))
    r = bisect(a, bad)
    assert (r.parting.step, r.parting.kind) == (0, "loss")
    assert r.describe().endswith(PY_NP_UNKNOWN)
    with pytest.raises(StepLogFormatError, match="line 4"):  # where the runs agree, the bad record is read and refused
        bisect(b, bad)


@pytest.mark.parametrize("steps", [3, 1])
def test_a_torch_seed_change_at_step_0_still_blames_torch_s_rng(tmp_path, steps):
    a = _run(tmp_path / "a.gtsteps", steps=steps, dropout_seed=0)
    b = _run(tmp_path / "b.gtsteps", steps=steps, dropout_seed=1)
    r = bisect(a, b)
    assert (r.exit_code, r.parting.step, r.parting.kind) == (1, 0, "rng")
    assert r.describe() == ("The runs part at step 0: the random state of torch's CPU generator differs as its first "
                            f"forward begins, and {_loss_words(a, b)}; {GRADS_DROPOUT}. "
                            + (PY_NP_IDLE if steps > 1 else PY_NP_UNKNOWN))


def test_an_unseeded_generator_the_steps_draw_from_is_blamed(tmp_path):
    # The same program twice: Python's random, unseeded, scales every step's loss.
    a, b = _run(tmp_path / "a.gtsteps", python_noise=True), _run(tmp_path / "b.gtsteps", python_noise=True)
    r = bisect(a, b)
    assert (r.parting.step, r.parting.kind) == (0, "rng")
    assert r.describe() == ("The runs part at step 0: the random state of Python's random differs as its first "
                            f"forward begins, and {_loss_words(a, b)}; {GRADS}. (The random state of NumPy's global "
                            "generator differs as step 0 begins, but neither run draws from it before step 1: not "
                            "what changed the step.)")
