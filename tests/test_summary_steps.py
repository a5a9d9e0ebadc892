"""`gradtrace summary` counts the optimizer steps of a block and the backward runs of each.

Micro-batches are the backward runs whose gradients one optimizer step sums in ``.grad``
(gradient accumulation); a block of K ordinary steps holds K steps of one run each, and SAM's two
passes per step are two backward runs, not micro-batches (the second starts from a fresh
``.grad``). The numerics headline splits the steps the same way, also where GradScaler skipped
every optimizer step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import tracer
from export.cli import main


def _phases(capsys: Any, tmp_path: Path, t: tracer.Trace) -> str:
    """The Phases table of `gradtrace summary` of ``t`` saved, run in-process (piped: plain text)."""
    path = tmp_path / "t.gtrace"
    t.save(path)
    assert main(["summary", str(path)]) == 0
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    start = lines.index("Phases")
    end = next(i for i in range(start + 3, len(lines)) if not lines[i].strip())
    return "\n".join(lines[start:end])


def _traced(body: Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor], None]) -> tracer.Trace:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with tracer.trace() as t:
        body(model, opt, x)
    return t


def _steps(steps: int, micro_batches: int) -> Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor], None]:
    def body(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        for _ in range(steps):
            for _ in range(micro_batches):
                (model(x).pow(2).mean() / micro_batches).backward()
            opt.step()
            opt.zero_grad()
    return body


def test_three_plain_steps_are_three_steps_not_micro_batches(capsys: Any, tmp_path: Path) -> None:
    assert _phases(capsys, tmp_path, _traced(_steps(3, 1))) == """\
Phases

  phase       calls   first     last
 ───────────────────────────────────────────────────────
  forward        12   linear0   div2   3 steps
  backward        0   -         -      3 backward runs
  optimizer       3   SGD0      SGD2   SGD0, SGD1, SGD2"""


def test_one_step_of_four_accumulated_micro_batches(capsys: Any, tmp_path: Path) -> None:
    assert _phases(capsys, tmp_path, _traced(_steps(1, 4))) == """\
Phases

  phase       calls   first     last
 ────────────────────────────────────────────────────────────────
  forward        16   linear0   div3   1 step of 4 micro-batches
  backward        0   -         -      4 backward runs
  optimizer       1   SGD0      SGD0   SGD0"""


def test_two_steps_of_two_micro_batches(capsys: Any, tmp_path: Path) -> None:
    assert _phases(capsys, tmp_path, _traced(_steps(2, 2))) == """\
Phases

  phase       calls   first     last
 ────────────────────────────────────────────────────────────────────
  forward        16   linear0   div3   2 steps, 2 micro-batches each
  backward        0   -         -      4 backward runs
  optimizer       2   SGD0      SGD1   SGD0, SGD1"""


def _sam(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """SAM: a pass to find the worst nearby weights, a second pass there, the step from its
    gradients; zero_grad between the passes, so nothing is accumulated."""
    for _ in range(2):
        model(x).pow(2).mean().backward()
        with torch.no_grad():
            eps = [0.05 * p.grad for p in model.parameters()]
            for p, e in zip(model.parameters(), eps):
                p.add_(e)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        with torch.no_grad():
            for p, e in zip(model.parameters(), eps):
                p.sub_(e)
        opt.step()
        opt.zero_grad()


def test_sam_passes_are_backward_runs_of_a_step_not_micro_batches(capsys: Any, tmp_path: Path) -> None:
    assert _phases(capsys, tmp_path, _traced(_sam)) == """\
Phases

  phase       calls   first     last
 ─────────────────────────────────────────────────────────────────────
  forward        12   linear0   mean3   2 steps, 2 backward runs each
  backward        0   -         -       4 backward runs
  optimizer      14   mul0      SGD1    SGD0, SGD1"""


def test_runs_after_the_last_step_are_named_apart(capsys: Any, tmp_path: Path) -> None:
    def body(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        _steps(2, 1)(model, opt, x)
        model(x).pow(2).mean().backward()  # a step the block does not finish

    text = _phases(capsys, tmp_path, _traced(body))
    assert "  forward        11   linear0   mean2   2 steps, then 1 backward run with no step\n" in text + "\n"


def test_steps_gradscaler_skipped_are_steps(capsys: Any, tmp_path: Path) -> None:
    """Every step overflows: no optimizer call splits them, GradScaler's unscale does."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model.weight.data.fill_(1e30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracer.check_numerics() as t:
            for _ in range(3):
                scaler.scale(model(x).pow(2).mean()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    assert t.anomalies.headline is not None
    assert t.anomalies.headline.where().startswith("forward (step 1 of 3), ")
    text = _phases(capsys, tmp_path, t)
    assert "  forward        15   linear0   mul2                  3 steps\n" in text
    assert text.endswith("no optimizer step: GradScaler skipped all 3")


def test_micro_batches_are_told_from_the_sum_in_grad_through_edits_and_resets(capsys: Any, tmp_path: Path) -> None:
    """Unscaled and clipped in place, the gradient the optimizer reads is still the sum of the
    step's runs (micro-batches); SAM with zero_grad(set_to_none=False) adds into a zeroed .grad,
    which sums nothing (backward runs)."""
    scaler = torch.amp.GradScaler("cpu")

    def accumulated(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        for _ in range(2):
            for _ in range(2):
                scaler.scale(model(x).pow(2).mean()).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    def sam_zeroed(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.zero_grad(set_to_none=False)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

    assert "   2 steps, 2 micro-batches each\n" in _phases(capsys, tmp_path, _traced(accumulated))
    assert "   2 steps, 2 backward runs each\n" in _phases(capsys, tmp_path, _traced(sam_zeroed))
