"""``gradtrace run``: a program runs as python runs it, with chosen steps traced."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

import tracer
from export.cli import main
from export.cli.main import build_parser
from export.cli.run import NOT_ON_THE_COMMAND_LINE, trace_options
from tracer.model import load_steps
from tracer.options import TraceOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")

# A tiny training script: prints what python gave it, trains 4 steps, can fail on request.
SCRIPT = textwrap.dedent("""\
    import os, sys
    import torch
    print("argv", sys.argv)
    print("name", __name__, "file", __file__)
    print("path0", sys.path[0])
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        if i == 2 and "--boom" in sys.argv:
            model(torch.ones(3, 5))  # step 2 fails: wrong width
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
    if "--exit-message" in sys.argv:
        sys.exit("stopped: bad config")
    """)


def _gradtrace_run() -> list[str]:
    """The real command line: `python -m tracer run`."""
    return [sys.executable, "-m", "tracer", "run"]


def main_run(argv: list[str]) -> int:
    """``gradtrace run ARGV`` in this process."""
    return main(["run", *argv])


@pytest.fixture
def script(tmp_path, monkeypatch):
    (tmp_path / "train_tiny.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    return "train_tiny.py"


def test_train_example_traced_at_step_3_with_report_output_and_exit_code_kept(tmp_path, capsys):
    import runpy

    args = ["--steps", "5", "--batch", "2", "--seq", "8"]
    # the example on its own, as python runs it
    argv = sys.argv
    sys.argv = [TRAIN, *args]
    try:
        with pytest.raises(SystemExit) as plain_exit:
            runpy.run_path(TRAIN, run_name="__main__")
    finally:
        sys.argv = argv
    plain = capsys.readouterr().out
    assert plain_exit.value.code == 0 and plain.count("\nstep ") == 5

    proc = subprocess.run([*_gradtrace_run(), "--steps", "3", "--report", TRAIN, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain  # the script's own output, untouched
    err = proc.stderr.splitlines()
    assert err[0].startswith("gradtrace: step 3 traced: ") and err[0].endswith(" backward run")
    assert err[-3:] == [f"gradtrace: traced step 3 of {TRAIN} -> train.gtrace ({err[-3].rsplit('(', 1)[1]}",
                        "gradtrace: report -> train.html", "next: gradtrace summary train.gtrace"]
    t = tracer.load(tmp_path / "train.gtrace")
    assert t.header["step"] == 3 and t.status == "ok" and t.meta["steps_in_file"] == [3]
    assert t.meta["argv"] == [TRAIN, *args]
    assert len(t.backward_runs) == 1 and "transformer.wte.weight.exp_avg" in t
    assert t.calls[0].stack[-1].file == TRAIN  # stacks point at the script, by its absolute path
    page = (tmp_path / "train.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "embedding0" in page


def test_script_gets_argv_name_path_and_exit_code_as_from_python(script, tmp_path):
    proc = subprocess.run([*_gradtrace_run(), "--steps", "1,3", "--no-progress", script, "a", "--steps", "x",
                           "--exit", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == [
        f"argv {[script, 'a', '--steps', 'x', '--exit', '3']}",
        f"name __main__ file {tmp_path / script}",
        f"path0 {os.path.realpath(tmp_path)}",
    ]
    assert proc.stderr.splitlines() == [
        "gradtrace: traced steps 1, 3 of train_tiny.py -> train_tiny.gtrace (" + proc.stderr.split("(")[1].split(")")[0] + ")",
        "next: gradtrace summary train_tiny.gtrace   (or: gradtrace report train_tiny.gtrace)",
    ]
    assert list(load_steps(tmp_path / "train_tiny.gtrace")) == [1, 3]


def test_a_script_that_raises_exits_1_with_its_traceback_and_keeps_the_trace(script, capsys):
    code = main_run(["--steps", "1,2", "--out", "boom.gtrace", script, "--boom"])
    assert code == 1
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == ["gradtrace: step 1 traced: 4 calls, 5 grad nodes, 1 backward run",
                       "gradtrace: step 2 traced: 2 calls, 0 grad nodes, 0 backward runs [failed]",
                       "Traceback (most recent call last):"]
    assert err[3] == f'  File "{os.path.abspath(script)}", line 10, in <module>'
    assert not any("tracer/" in line or "runpy" in line for line in err)  # python's traceback, not ours
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2)" in err
    steps = load_steps("boom.gtrace")
    assert list(steps) == [1, 2]
    assert steps[1].status == "ok"
    failed = steps[2]
    assert failed.status == "failed" and failed.error["type"] == "RuntimeError"
    assert [c.name for c in failed.calls] == ["ones0", "linear0"] and failed.calls[1].error is not None


def test_an_error_inside_a_python_torch_function_shows_pythons_own_traceback(tmp_path, monkeypatch, capsys):
    # F.batch_norm is Python: under the trace it hands itself to handle_torch_function, which
    # calls it again under the mode. The traceback shows it once, as a plain run does.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_norm.py").write_text(textwrap.dedent("""\
        import torch
        m = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(2):
            y = torch.nn.functional.batch_norm(m(torch.ones(2, 4)), torch.zeros(5), torch.ones(5))
            y.sum().backward()
            opt.step()
        """))
    plain = subprocess.run([sys.executable, "bad_norm.py"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 1
    assert main_run(["--no-progress", "bad_norm.py"]) == 1
    err = capsys.readouterr().err
    traced = err[err.index("Traceback (most recent call last):"):].splitlines()
    expected = plain.stderr[plain.stderr.index("Traceback (most recent call last):"):].splitlines()
    assert traced[:len(expected)] == expected
    assert "handle_torch_function" not in err


def test_sys_exit_with_a_message_and_every(script, capsys):
    assert main_run(["--every", "2", script, "--exit-message"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == ["gradtrace: step 0 traced: 8 calls, 5 grad nodes, 1 backward run",
                       "gradtrace: step 2 traced: 4 calls, 5 grad nodes, 1 backward run",
                       "stopped: bad config"]
    # step 4 began after the last optimizer step and recorded nothing: it is not in the file
    steps = load_steps("train_tiny.gtrace")
    assert list(steps) == [0, 2]
    # step 0 starts with the program: the model's initialisation is in it
    assert [c.name for c in steps[0].calls] == ["empty0", "empty1", "kaiming_uniform_0", "uniform_0",
                                                "ones0", "linear0", "sum0", "SGD0"]
    assert [c.name for c in steps[2].calls] == ["ones0", "linear0", "sum0", "SGD0"]


def test_optimizer_ops_option_records_the_ops_inside_the_step(script, capsys):
    assert main_run(["--steps", "1", "--optimizer-ops", "-o", "ops.gtrace", script]) == 0
    t = tracer.load("ops.gtrace")
    assert t.header["optimizer_ops"] is True
    assert [c.name for c in t.calls] == ["ones0", "linear0", "sum0", "add_0", "add_1"]  # SGD, op by op


def test_optimizer_state_option_keeps_the_state_in_a_trace_without_checksums(script, capsys):
    assert main_run(["--steps", "1", "--hash", "none", "-o", "lean.gtrace", script]) == 0
    assert main_run(["--steps", "1", "--hash", "none", "--optimizer-state", "-o", "state.gtrace", script]) == 0
    assert main_run(["--steps", "1", "-o", "md5.gtrace", script]) == 0
    assert [tracer.load(f"{n}.gtrace").header["optimizer_state"] for n in ("lean", "state", "md5")] == \
        [False, True, True]


EVERY_OPTION = ["--out", "x.gtrace", "--hash", "fast", "--no-stacks", "--stats", "--check-numerics", "--raise-on-nonfinite",
                "--memory", "--optimizer-ops", "--node-runs", "--optimizer-state", "--keep-values", "h.*",
                "--keep-values-bytes", "1MiB", "--max-calls", "10", "--max-bytes", "20M", "--flush-every", "7"]


def test_every_trace_option_is_an_option_of_gradtrace_run():
    """Each field of TraceOptions is an option of gradtrace run whose dest is the field's name
    (listeners aside, with the reason), and what the command line says reaches the options: a
    new field without its option fails here."""
    fields = {f.name for f in dataclasses.fields(TraceOptions)}
    on_the_command_line = fields - set(NOT_ON_THE_COMMAND_LINE)
    assert set(NOT_ON_THE_COMMAND_LINE) == {"listeners"}
    assert on_the_command_line - set(vars(build_parser().parse_args(["run", "s.py"]))) == set()
    given = TraceOptions.from_kwargs(**trace_options(build_parser().parse_args(["run", *EVERY_OPTION, "s.py"])))
    assert given == TraceOptions(hash="fast", stacks=False, stats=True, out="x.gtrace", flush_every=7, memory=True,
                                 max_calls=10, max_bytes=20_000_000, check_numerics=True, raise_on_nonfinite=True,
                                 optimizer_ops=True, node_runs=True, optimizer_state=True, keep_values=("h.*",),
                                 keep_values_bytes=1 << 20)
    default = TraceOptions()
    assert {f for f in fields if getattr(given, f) != getattr(default, f)} == on_the_command_line
    negated = build_parser().parse_args(["run", "--no-stats", "--no-node-runs", "--no-optimizer-state", "s.py"])
    assert (negated.stats, negated.node_runs, negated.optimizer_state) == (False, False, False)


def test_the_new_trace_options_reach_the_trace(script, capsys):
    assert main_run(["--steps", "1", "--hash", "none", "--no-stacks", "--check-numerics", "--memory",
                     "--no-node-runs", "--flush-every", "3", "-o", "lean.gtrace", script]) == 0
    t = tracer.load("lean.gtrace")
    assert {k: t.header[k] for k in ("hash", "stacks", "check_numerics", "node_runs")} == \
        {"hash": "none", "stacks": False, "check_numerics": True, "node_runs": False}
    assert [c.name for c in t.calls] == ["ones0", "linear0", "sum0", "SGD0"]
    assert all(c.stack_id is None for c in t.calls) and t.memory
    assert all(t.tensors[n].stats is not None for n in t.calls[1].outputs)  # --check-numerics: stats


def test_watch_refuses_the_options_of_a_trace_it_does_not_take(script, capsys):
    assert main_run(["--watch", "--memory", "--no-stacks", "-o", "w.gtrace", script]) == 2
    assert capsys.readouterr().err.strip() == (
        "gradtrace run: error: --watch traces only the steps that trip, where the program's watch says: drop "
        "--no-stacks, --out, --memory (give out= and the trace options to tracer.watch)")


def test_module_mode_runs_like_python_dash_m(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert main_run(["--steps", "0", "--no-progress", "-m", "mypkg.train", "--steps", "9", "--exit", "5"]) == 5
    out = capsys.readouterr()
    assert out.out.splitlines()[0] == f"argv {[str(pkg / 'train.py'), '--steps', '9', '--exit', '5']}"
    assert out.out.splitlines()[2] == f"path0 {tmp_path}"
    assert tracer.load("train.gtrace").header["step"] == 0
    assert main_run(["-m", "no_such_module_here"]) == 2
    assert "error: no module named 'no_such_module_here'" in capsys.readouterr().err


def test_usage_errors_are_one_line_exit_2(script, capsys):
    assert main_run([]) == 2
    assert "nothing to run" in capsys.readouterr().err
    assert main_run(["missing.py"]) == 2
    assert capsys.readouterr().err == "gradtrace run: error: can't open file 'missing.py': no such file\n"
    assert main_run(["--steps", "1-x", script]) == 2
    assert "'1-x' is not a step number" in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_refused_before_the_program_runs(script, tmp_path, capsys):
    out = tmp_path / "missing" / "x.gtrace"
    assert main_run(["--out", str(out), script]) == 2
    captured = capsys.readouterr()
    assert "argv" not in captured.out  # the program never started
    assert captured.err.count("\n") == 1 and "does not exist" in captured.err and "Traceback" not in captured.err
    assert not out.exists()


def test_register_sends_options_after_the_program_to_the_program():
    parser = build_parser()
    args = parser.parse_args(["run", "--steps", "3", "--report", "--max-bytes", "50M", "s.py", "--steps", "5",
                              "-m", "x"])
    assert (args.steps, args.report, args.max_bytes) == ("3", True, 50_000_000)
    assert args.program == ["s.py", "--steps", "5", "-m", "x"] and args.module is None
    args = parser.parse_args(["run", "--every", "2", "-m", "pkg.mod", "--every", "7"])
    assert args.every == 2 and args.module == ["pkg.mod", "--every", "7"]
    assert args.func.__name__ == "run_command"


def test_a_step_whose_recording_gradtrace_stopped_says_why():
    from export.cli.run_program import why_stopped
    from tracer.model import Trace

    t = Trace()
    assert why_stopped(t) == ""
    t.notes.append("recording stopped at max_calls=3: later calls, grad nodes and backward runs were not recorded")
    assert why_stopped(t) == "recording stopped at a bound"
    t.notes[0] = "recording stopped: gradtrace failed while recording (RecursionError: ... at tracer/x.py:1 (f)); ..."
    assert why_stopped(t) == "recording stopped: gradtrace failed, see the trace's notes"


def test_a_program_option_that_prefixes_gradtrace_options_goes_to_the_program() -> None:
    """Everything after the script is the program's: ``--opt`` (a prefix of ``--optimizer-ops``
    and ``--optimizer-state``), ``--rep``, ``--max``, ``--no`` were refused as ambiguous, and an
    unambiguous prefix (``--per``) would have been taken as gradtrace's own option."""
    own = ["--opt", "adam", "--rep", "2", "--max", "9", "--ste", "1", "--no", "--per"]
    args = build_parser().parse_args(["run", "--log", "x.gtsteps", "prog.py", *own])
    assert args.program == ["prog.py", *own]
    assert args.log == "x.gtsteps" and not args.per_step_files and args.repeats == 2
    with pytest.raises(SystemExit):  # gradtrace's own options are spelled in full
        build_parser().parse_args(["run", "--per-step", "prog.py"])
