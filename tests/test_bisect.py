"""``gradtrace bisect``: a tiny GPT-2 training script and the same script with one change that acts
first at step 23 (the data order, the learning-rate schedule, a LayerNorm's eps): the step, what
differed first and the first parameters in execution order, the commands that trace that step;
two identical runs of 50 steps agree (exit 0); tolerances; a log cut short; ``--run`` down to the
op and line of the LayerNorm; and a program that is not deterministic (a loader shuffling with an
unseeded generator) said to be, not blamed on the change."""

from __future__ import annotations

import inspect
import os
import textwrap

import pytest
import torch

import tracer
from export.bisect import bisect, trace_command
from export.cli import main
from tests import steplog_gpt2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "steplog_gpt2.py")
FIRST_THREE = "transformer.wte.weight, transformer.wpe.weight, transformer.h.0.ln_1.weight and 25 more"


def _logged(path, variant: str, steps: int) -> str:
    """Train the script's model in this process with a step log that names the script's command line."""
    argv = [SCRIPT, "--steps", str(steps)] + ([] if variant == "none" else ["--variant", variant])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    log = tracer.StepLog(path, program={"argv": argv, "module": False}).start()
    try:
        steplog_gpt2.train(steps, variant)
    finally:
        log.close()
        torch.set_num_threads(threads)
    return os.fspath(path)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("logs")
    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # the lr variant's bug, as PyTorch sees it
        return {v: _logged(folder / f"{v}.gtsteps", v, 30) for v in ("none", "data", "lr", "eps")}


def test_a_data_order_change_parts_at_step_23_by_its_batch(logs):
    r = bisect(logs["none"], logs["data"])
    assert (r.exit_code, r.parting.step, r.parting.kind) == (1, 23, "batch")
    text = r.describe()
    assert text.startswith("The runs part at step 23: its batch differs (the tensors given to the model: digest ")
    assert f"; the gradients of 28 of 28 parameters differ, first in execution order: {FIRST_THREE}." in text
    assert text.endswith("Steps 0-22 agree bit for bit.")


def test_an_lr_schedule_off_by_one_parts_at_step_23_by_its_learning_rate(logs):
    r = bisect(logs["none"], logs["lr"])
    assert (r.parting.step, r.parting.kind) == (23, "lr")
    assert r.describe().startswith("The runs part at step 23: its learning rate differs: 0.001 in A, 0.0005 in B, "
                                   "while its loss and gradients agree, so its update differs (seen as step 24 "
                                   f"begins); the values of 28 of 28 parameters differ, first in execution order: "
                                   f"{FIRST_THREE}.")


def test_a_layernorm_eps_change_parts_at_step_23_by_its_loss(logs):
    r = bisect(logs["none"], logs["eps"])
    assert (r.parting.step, r.parting.kind) == (23, "loss")
    text = r.describe()
    assert text.startswith("The runs part at step 23: every input the log compares agrees (the parameters, the "
                           "model's inputs, the learning rates, the random state), yet its loss differs: ")
    assert "the step's computation changed, or an input the log does not compare (the labels" in text


def test_the_commands_trace_the_step_in_both_runs(logs, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # where the runs ran: the commands need no cd
    assert main(["bisect", logs["none"], logs["eps"]]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2:6] == [
        "To trace step 23 in both runs and diff them:",
        f"  gradtrace run --steps 23 -o none.step23.gtrace {SCRIPT} --steps 30",
        f"  gradtrace run --steps 23 -o eps.step23.gtrace {SCRIPT} --steps 30 --variant eps",
        "  gradtrace diff none.step23.gtrace eps.step23.gtrace"]
    assert out[6] == f"(or all at once: gradtrace bisect --run '{SCRIPT} --steps 30' '{SCRIPT} --steps 30 --variant eps')"


def test_a_command_run_elsewhere_changes_directory_first(tmp_path):
    meta = {"argv": ["train.py", "--lr", "3e-4"], "module": False, "cwd": "/data/my runs"}
    assert trace_command(meta, 7, "a.step7.gtrace") == \
        f"cd '/data/my runs' && gradtrace run --steps 7 -o {os.path.abspath('a.step7.gtrace')} train.py --lr 3e-4"
    assert trace_command({"argv": ["pkg.train"], "module": True}, 0, "x.gtrace") == \
        "gradtrace run --steps 0 -o x.gtrace -m pkg.train"
    assert trace_command({"argv": ["-c"]}, 0, "x.gtrace") is None  # python -c: no command to give


def test_two_identical_runs_of_50_steps_agree(tmp_path, capsys):
    a, b = (_logged(tmp_path / f"{n}.gtsteps", "none", 50) for n in ("a", "b"))
    assert main(["bisect", a, b]) == 0
    out = capsys.readouterr().out
    assert out == ("The logs agree on all 50 steps bit for bit: every loss, model input, learning rate, gradient "
                   "and parameter, and the parameters after the last step.\n")


def _float64_products(path, wide: bool) -> str:
    """A small regression trained with its products in float32, or in float64 rounded back
    (``wide``): the same model to a few ulps, as another machine or library would compute it."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 1))
    opt = torch.optim.SGD([w], lr=0.05)
    data = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(1))
    with tracer.step_log(path, optimizer=opt):
        for x in data:
            y = (x.double() @ w.double()).float() if wide else x @ w
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
    return os.fspath(path)


def test_a_tolerance_lets_rounding_agree_and_not_a_real_change(tmp_path, logs):
    a, b = _float64_products(tmp_path / "f32.gtsteps", False), _float64_products(tmp_path / "f64.gtsteps", True)
    exact = bisect(a, b)
    assert (exact.parting.step, exact.parting.kind) == (0, "grads")  # the loss rounds to the same float32
    within = bisect(a, b, rtol=1e-5)
    assert within.exit_code == 0
    assert within.describe().startswith("The logs agree on all 8 steps within rtol=1e-05 atol=0")
    eps = bisect(logs["none"], logs["eps"], rtol=1e-5)  # the LayerNorm change is far above rounding
    assert (eps.parting.step, eps.parting.kind) == (23, "loss")


def test_a_log_cut_short_agrees_on_its_steps_and_says_where_it_ends(logs, tmp_path):
    with open(logs["none"], "rb") as fh:
        lines = fh.read().splitlines(keepends=True)
    cut = tmp_path / "cut.gtsteps"
    cut.write_bytes(b"".join(lines[:2 + 12]) + lines[14][:40])  # header, layout, steps 0-11, half of 12
    r = bisect(logs["none"], cut)
    assert (r.exit_code, r.compared, r.parting.kind) == (1, 12, "length")
    assert r.describe() == ("The logs agree on the 12 steps both hold bit for bit, but B's log was cut off after 12 "
                            "steps while A's holds 30 (B's program stopped early, failed or was killed).")


def test_a_missing_log_and_options_for_run_only_are_one_line(tmp_path, capsys):
    assert main(["bisect", "nope.gtsteps", "nope2.gtsteps"]) == 2
    assert capsys.readouterr().err == "gradtrace bisect: error: no such step log: nope.gtsteps\n"
    assert main(["bisect", "--out", "x", "a", "b"]) == 2
    assert "--out only with --run" in capsys.readouterr().err


def _ln_1_line() -> tuple[str, int]:
    """Where GPT2Block.forward calls its first LayerNorm (the line the op-level diff must name)."""
    from transformers.models.gpt2 import modeling_gpt2

    lines, first = inspect.getsourcelines(modeling_gpt2.GPT2Block.forward)
    n = next(i for i, line in enumerate(lines) if "self.ln_1(hidden_states)" in line)
    return inspect.getsourcefile(modeling_gpt2), first + n


def test_run_finds_the_step_then_the_op_and_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = main(["bisect", "--run", f"python {SCRIPT} --steps 25", f"python {SCRIPT} --steps 25 --variant eps"])
    out, err = capsys.readouterr()
    assert code == 1
    assert out.startswith("The runs part at step 23: every input the log compares agrees")
    file, line = _ln_1_line()
    assert (f"The runs part at step 23, first at layer_norm2 (torch.nn.functional.layer_norm in transformer.h.1.ln_1, "
            f"forward) at {file}:{line} (hidden_states = self.ln_1(hidden_states)): inputs match, arguments differ "
            "('(32), eps=1e-05' vs '(32), eps=0.001'), outputs differ.") in out
    assert "not deterministic" not in out
    assert f"gradtrace: A: running with the step log: {SCRIPT} --steps 25 (output: bisect-runs/a.out)" in err
    assert "gradtrace: B again: 25 steps logged in" in err
    kept = sorted(os.listdir(tmp_path / "bisect-runs"))
    assert kept == ["a.again.gtsteps", "a.again.out", "a.gtsteps", "a.out", "a.step23.gtrace", "b.again.gtsteps",
                    "b.again.out", "b.gtsteps", "b.out", "b.step23.gtrace"]
    assert tracer.load(tmp_path / "bisect-runs" / "b.step23.gtrace").header["step"] == 23


UNSEEDED = textwrap.dedent("""
    import sys, torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # (64 rows in batches of 8: two orders share their first batch with odds of 1 in ~1.8e14;
    # with 8 rows in pairs they did 1 time in 56, and the runs parted at step 1)
    data = torch.utils.data.TensorDataset(torch.arange(256.0).view(64, 4))
    shuffle = torch.Generator()
    shuffle.seed()  # BUG: an unseeded generator: every run reads the data in another order
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=shuffle)
    for step, (x,) in enumerate(loader):
        if "--change" in sys.argv and step == 3:
            opt.param_groups[0]["lr"] = 0.05
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
""")


def test_run_says_a_program_is_not_deterministic_instead_of_blaming_the_change(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    (tmp_path / "train.py").write_text(UNSEEDED)
    assert main(["bisect", "--run", "--out", "hunt", "python train.py", "python train.py --change"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("The runs part at step 0: its batch differs")
    assert "\nA's program is not deterministic: two runs of the same command part at step 0, the step where A and B " \
           "part. The runs part at step 0: its batch differs" in out
    assert "So the difference at step 0 cannot be blamed on what differs between A and B" in out
    assert "op by op" not in out  # no trace is diffed


def test_run_refuses_gradtrace_s_own_command_line(tmp_path, capsys):
    assert main(["bisect", "--run", "--out", os.fspath(tmp_path / "o"), "gradtrace run train.py", "train.py"]) == 2
    assert "give the program's own command line, not gradtrace's" in capsys.readouterr().err


def test_python_is_dropped_from_a_command_line():
    from export.cli.runs import program_words

    assert program_words("python3.11 train.py --lr 3") == ["train.py", "--lr", "3"]
    assert program_words("python -m pkg.train --x") == ["-m", "pkg.train", "--x"]
    assert program_words("train.py 'a b'") == ["train.py", "a b"]
