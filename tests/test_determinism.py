"""``tracer.check_determinism`` and ``gradtrace run --check-determinism``: a step with a scatter-add
whose rows land in an order that changes at every call (atomics made to happen on the CPU), in
the forward or inside a custom Function's backward, is named with its line and the usual cause;
the same model trained with built-in ops is deterministic; the state is put back as it was; a
program whose runs already differ before the step is told so; and one whose runs read the
parameters in another order is told that, not that a parameter differs."""

from __future__ import annotations

import itertools
import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tracer
from export.cli import main
from tests.determinism_models import (
    custom_backward_step,
    forward_step,
    line_of,
    plain_step,
    rows_model,
    scrambled_add,
)
from tracer.analysis.determinism import CUSTOM, compare_runs, usual_cause
from tracer.record.checksums.fingerprint import fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "tests", "determinism_models.py")


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    out = [fingerprint(p) for p in model.parameters()]
    for p in model.parameters():
        out += [f"{k}:{fingerprint(v) if isinstance(v, torch.Tensor) else v}" for k, v in opt.state[p].items()]
    return out


def test_a_nondeterministic_op_inside_a_custom_backward_is_named_with_its_line():
    model, opt, index, scale = rows_model()
    step = custom_backward_step(model, opt, index, scale)
    step()  # the optimizer has state (momentum-free SGD: none) and the step is warm
    before = _state(model, opt)
    report = tracer.check_determinism(step, model=model, optimizer=opt)
    assert not report.deterministic and not report
    first = report.first
    assert first is not None
    assert (first.kind, first.name, first.what, first.phase) == (
        "call", "scrambled_add0", "torch.ops.gradtrace_tests.scrambled_add.default", "backward")
    assert (first.line.file, first.line.line) == (MODELS, line_of("ND-CPU-BACKWARD"))
    assert (first.cause, first.fix) == CUSTOM
    assert first.outputs == ["scrambled_add0:out"]
    text = report.describe()
    assert text.startswith(f"not deterministic: scrambled_add0 (torch.ops.gradtrace_tests.scrambled_add.default) at "
                           f"{MODELS}:{line_of('ND-CPU-BACKWARD')} (return scrambled_add(zero, index, grad), None  # ND-CPU-BACKWARD) got "
                           "bit-equal inputs in runs 1 and 2 and gave different outputs (scrambled_add0:out)")
    assert "\n  usual cause: a custom kernel" in text and "\n  set: accumulate in a fixed order" in text
    assert _state(model, opt) == before  # the check put everything back
    assert len(report.traces) == 2 and all(t.hash_algorithm == "fast" for t in report.traces)


def test_a_nondeterministic_op_in_the_forward_is_found_before_what_it_spoils():
    model, opt, index, scale = rows_model()
    report = tracer.check_determinism(forward_step(model, opt, index, scale), model=model, optimizer=opt, repeats=3)
    first = report.first
    assert first is not None and (first.name, first.phase) == ("scrambled_add0", "forward")
    assert (first.line.file, first.line.line) == (MODELS, line_of("ND-CPU-FORWARD"))


def test_the_same_model_with_built_in_ops_is_deterministic_and_the_model_is_found_by_itself():
    model, opt, index, scale = rows_model()
    step = plain_step(model, opt, index, scale)
    before = _state(model, opt)
    report = tracer.check_determinism(step, repeats=3)  # model and optimizer: those the closure holds
    assert report.deterministic and bool(report)
    assert report.first is None and report.before is None and report.compared > 10
    assert report.describe() == (f"deterministic: 3 runs of the step from the same state gave bit-equal results "
                                 f"({report.compared} records compared)")
    assert _state(model, opt) == before
    step()
    assert _state(model, opt) != before  # (the step does change the state: the check undid it)


def test_the_cause_is_named_for_the_usual_suspects():
    assert "atomic" in usual_cause("torch.Tensor.index_add_")[0]  # type: ignore[index]
    assert "index_put_(accumulate=True)" in usual_cause("Tensor.index_put_ accumulate=True")[0]  # type: ignore[index]
    assert usual_cause("Tensor.index_put_ accumulate=False") is None
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in usual_cause("torch.nn.functional.linear")[1]  # type: ignore[index]
    assert "cudnn.deterministic = True" in usual_cause("ConvolutionBackward0")[1]  # type: ignore[index]
    assert "SDPBackend.MATH" in usual_cause("ScaledDotProductFlashAttentionBackward0")[1]  # type: ignore[index]


def test_bad_arguments_are_trace_errors():
    model, opt, index, scale = rows_model()
    with pytest.raises(tracer.TraceError, match="repeats must be a number of runs >= 2"):
        tracer.check_determinism(plain_step(model, opt, index, scale), repeats=1)
    with pytest.raises(tracer.TraceError, match="found no model or optimizer"):
        tracer.check_determinism(lambda: None)


NONDETERMINISTIC = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {ROOT!r})
    import torch
    from tests.determinism_models import forward_step, plain_step, rows_model
    model, opt, index, scale = rows_model()
    plain, scrambled = plain_step(model, opt, index, scale), forward_step(model, opt, index, scale)
    for step in range(4):
        (scrambled if step == 2 else plain)()  # deterministic but at step 2
""")

UNSEEDED_INIT = textwrap.dedent("""
    import torch
    model = torch.nn.Linear(4, 1)  # BUG: no seed: another start in every run
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
""")


def test_run_check_determinism_names_the_op_of_the_step(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    (tmp_path / "train.py").write_text(NONDETERMINISTIC)
    assert main(["run", "--check-determinism", "--steps", "2", "train.py"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith(f"Step 2: not deterministic: scrambled_add0 (torch.ops.gradtrace_tests.scrambled_add.default)"
                          f" at {MODELS}:{line_of('ND-CPU-FORWARD')} ")
    assert "gradtrace: run 2: run 2 of 2, tracing step 2: train.py" in err
    assert sorted(os.listdir(tmp_path / "train.determinism")) == [
        "run1.gtsteps", "run1.out", "run1.step2.gtrace", "run2.gtsteps", "run2.out", "run2.step2.gtrace"]


def test_run_check_determinism_says_when_the_runs_differ_before_the_step(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    (tmp_path / "train.py").write_text(UNSEEDED_INIT)
    assert main(["run", "--check-determinism", "--steps", "2", "train.py"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("Step 2 does not start from the same state in every run: run 1 and run 2 part at step 0 "
                          "(A: run 1, B: run 2). The runs part before step 0: the parameters differ as step 0 begins")
    assert out.endswith("Check that step instead: gradtrace run --check-determinism --steps 0 ...\n")


def test_run_check_determinism_needs_one_step(tmp_path, capsys):
    (tmp_path / "train.py").write_text("")
    assert main(["run", "--check-determinism", os.fspath(tmp_path / "train.py")]) == 2
    assert "needs the step to check, one step number: --steps K" in capsys.readouterr().err
    assert main(["run", "--check-determinism", "--steps", "3", "--every", "2", os.fspath(tmp_path / "train.py")]) == 2
    assert "drop --every" in capsys.readouterr().err


def _reordered_model() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), list(model.parameters())


def _penalized_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                    order: Callable[[], list[torch.nn.Parameter]]) -> Callable[[torch.Tensor], None]:
    def step(x: torch.Tensor) -> None:
        penalty = sum(p.pow(2).sum() for p in order())  # (as iterating a set of names reads them)
        (model(x).sum() + 1e-3 * penalty).backward()
        opt.step()
        opt.zero_grad()
    return step


def _read_in_another_order(record: int) -> str:
    return (f"run 2 took another path than run 1 at record {record}: pow0 (Tensor.pow) read 0.weight in run 1 and "
            "2.bias in run 2 (the same record read other tensors: another path or order through the program)")


def test_runs_that_read_the_parameters_in_another_order_are_told_so_not_that_a_parameter_differs() -> None:
    model, opt, params = _reordered_model()
    repeats = itertools.count()
    step = _penalized_step(model, opt, lambda: params if next(repeats) == 0 else params[::-1])
    before = _state(model, opt)
    report = tracer.check_determinism(step, torch.ones(3, 4), model=model, optimizer=opt)
    assert not report and report.first is None
    assert report.before == _read_in_another_order(1)
    assert report.describe() == f"not comparable: {_read_in_another_order(1)}"
    assert "differs" not in report.describe() and "same state" not in report.describe()
    assert _state(model, opt) == before  # (the parameters were bit-equal as each repeat began)
    # A parameter that does differ as the step begins (read in the same order) is still named so.
    same_order = _penalized_step(model, opt, lambda: params)
    traces = []
    for bump in (0.0, 1e-3):
        with torch.no_grad():
            params[0].add_(bump)
        with tracer.trace(hash="fast") as t:
            same_order(torch.ones(3, 4))
        traces.append(t)
    assert compare_runs(traces).before == ("0.weight differs between run 1 and run 2 as the step begins (read by pow0 "
                                           "(Tensor.pow)): the runs do not start from the same state")


READ_IN_ANOTHER_ORDER_AT_STEP_2 = textwrap.dedent(f"""
    import os
    import sys
    sys.path.insert(0, {ROOT!r})
    import torch
    from tests.test_determinism import _penalized_step, _reordered_model
    runs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs.txt")
    with open(runs, "a") as f:
        f.write("run\\n")
    with open(runs) as f:
        second = len(f.readlines()) > 1
    model, opt, params = _reordered_model()
    steps = iter(range(4))
    # The second run reads the parameters in reverse order at step 2 (the order of a set of names
    # changes between processes): the parameters are bit-equal as step 2 begins in both runs.
    step = _penalized_step(model, opt, lambda: params[::-1] if second and next(steps) == 2 else params)
    for _ in range(4):
        step(torch.ones(3, 4))
""")


def test_run_check_determinism_says_when_the_runs_read_the_parameters_in_another_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    (tmp_path / "train.py").write_text(READ_IN_ANOTHER_ORDER_AT_STEP_2)
    assert main(["run", "--check-determinism", "--steps", "2", "train.py"]) == 1
    out = capsys.readouterr().out
    assert out == f"Step 2: not comparable: {_read_in_another_order(2)}\n"  # (record 1: torch.ones, the batch)
    assert "differs" not in out
    assert (tmp_path / "runs.txt").read_text() == "run\nrun\n"


def test_scrambled_add_is_index_add_up_to_rounding():
    base, index, src = torch.zeros(3, 4), torch.tensor([0, 2, 0, 0]), torch.randn(4, 4)
    assert torch.allclose(scrambled_add(base, index, src), base.index_add(0, index, src), atol=1e-6)


def _two_batch_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                    swap: Callable[[], bool]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        first, second = (y, x) if swap() else (x, y)  # (as a dict of batches iterated in another order)
        (model(first).sum() + model(second).sum()).backward()
        opt.step()
        opt.zero_grad()
    return step


def test_inputs_read_in_another_order_are_told_so_not_that_an_input_differs() -> None:
    # Inputs the step did not make are named in the order it reads them (input0, input1): two
    # batches read the other way round swap names, and their checksums with them.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    repeats = itertools.count()
    step = _two_batch_step(model, opt, lambda: next(repeats) == 1)
    report = tracer.check_determinism(step, torch.ones(3, 4), torch.full((3, 4), 2.0), model=model, optimizer=opt)
    assert not report and report.first is None
    assert report.before == ("run 2 took another path than run 1 at record 1: linear0 "
                             "(torch.nn.functional.linear) read input0 in run 1 and, in run 2, the value run 1 had "
                             "as input1 (the runs start from the same state and read it in another order)")
    assert "do not start from the same state" not in report.describe()


def test_an_input_that_does_differ_as_the_step_begins_is_still_named() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _two_batch_step(model, opt, lambda: False)
    x, y = torch.ones(3, 4), torch.full((3, 4), 2.0)
    traces = []
    for first in (x, torch.full((3, 4), 3.0)):  # run 2's first batch is one run 1 never read
        with tracer.trace(hash="fast") as t:
            step(first, y)
        traces.append(t)
    assert compare_runs(traces).before == ("input0 differs between run 1 and run 2 as the step begins (read by "
                                           "linear0 (torch.nn.functional.linear)): the runs do not start from "
                                           "the same state")
