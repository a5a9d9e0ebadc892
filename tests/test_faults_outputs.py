"""An output that cannot be written, or that another process writes: what the user had is
neither lost nor changed (their modes, their file), and the error says so as it is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import tracer
from export.cli import main
from tests.modes import CountingMode
from tracer.model import load_steps
from tracer.model.claims import OutputInUse


def test_a_trace_file_that_cannot_be_opened_raises_its_oserror_and_leaves_the_callers_modes(tmp_path, monkeypatch):
    missing = tmp_path / "missing" / "x.gtrace"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with torch.device("meta"), CountingMode() as mode:
        with pytest.raises(FileNotFoundError) as err, tracer.trace(out=os.fspath(missing)):
            raise AssertionError("the block must not run")
        assert err.value.filename == os.fspath(missing)
        with pytest.raises(NotADirectoryError):
            tracer.trace(out=os.fspath(not_a_dir / "x.gtrace")).__enter__()
        # one rank of a torchrun job: the per-rank file is the one that cannot be opened
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(FileNotFoundError) as err:
            tracer.trace(out=os.fspath(missing)).__enter__()
        assert err.value.filename == os.fspath(tmp_path / "missing" / "x.rank1.gtrace")
        monkeypatch.delenv("RANK")
        # step traces: at once, not at the first chosen step
        for steps in ("0", "5"):
            with pytest.raises(FileNotFoundError) as err:
                tracer.trace(steps=steps, out=os.fspath(missing))
            assert err.value.filename in (os.fspath(missing), os.fspath(missing.parent))
        assert mode.calls == 0
        x = torch.ones(1)
        assert mode.calls == 1 and x.device.type == "meta"  # both of the caller's modes still apply
    assert torch.ones(1).device.type == "cpu" and not missing.parent.exists()
    assert not list(tmp_path.glob("**/*.lock"))


def test_demo_to_a_missing_directory_says_one_line_and_exits_2(tmp_path, capsys):
    out = tmp_path / "missing" / "x.gtrace"
    assert main(["demo", "-o", os.fspath(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"gradtrace demo: error: {out}: No such file or directory\n"


# A program that says it started (a file), then waits until told to go on (another file).
WAITING = textwrap.dedent("""\
    import os, sys, time
    import torch
    open(sys.argv[1] + ".started", "w").close()
    deadline = time.monotonic() + 120
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=float(sys.argv[2]))
    for i in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        while i == 0 and not os.path.exists(sys.argv[1] + ".go"):
            assert time.monotonic() < deadline, "never told to go on"
            time.sleep(0.05)
    """)


def _wait_for(path: str, proc: subprocess.Popen[str], seconds: float = 120) -> None:
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


def test_two_runs_writing_the_same_file_the_second_refuses_before_its_program_starts(tmp_path, monkeypatch,
                                                                                        capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lr.py").write_text(WAITING)
    run = [sys.executable, "-m", "tracer", "run", "--steps", "0,1", "--no-progress", "-o", "same.gtrace", "lr.py"]
    first = subprocess.Popen([*run, "a", "0.1"], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for("a.started", first)
        # a second gradtrace run beside it: refused, its program never started, the first's file untouched
        second = subprocess.run([*run, "b", "0.2"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and not os.path.exists("b.started")
        assert second.stderr == (f"gradtrace run: error: same.gtrace: being written by another process (pid "
                                 f"{first.pid} on {os.uname().nodename} since {second.stderr.split(' since ')[1]}")
        assert second.stderr.count("\n") == 1
        # the API in another process: refused before the block runs, nothing installed
        size = os.path.getsize("same.gtrace")
        with pytest.raises(OutputInUse) as err, tracer.trace(out="same.gtrace"):
            raise AssertionError("the block must not run")
        assert err.value.filename == "same.gtrace" and f"pid {first.pid} " in str(err.value)
        assert os.path.getsize("same.gtrace") == size
        open("a.go", "w").close()
        _, err_text = first.communicate(timeout=120)
    finally:
        first.kill()
        first.wait()
    assert first.returncode == 0, err_text
    assert err_text.splitlines()[-2].startswith("gradtrace: traced steps 0, 1 of lr.py -> same.gtrace")
    assert sorted(load_steps("same.gtrace")) == [0, 1]
    assert not os.path.exists("same.gtrace.lock")

    # A writer killed while it holds the file (SIGKILL) leaves its lock file; the lock went with the
    # process, so the next run takes the file over, and removes the lock file when done.
    killed = subprocess.Popen([sys.executable, "-c", "import time\n"
                               "from tracer.model.claims import claim_output\n"
                               "claim = claim_output('same.gtrace')\n"
                               "print('claimed', flush=True)\n"
                               "time.sleep(120)\n"], text=True, stdout=subprocess.PIPE)
    try:
        assert killed.stdout is not None and killed.stdout.readline() == "claimed\n"
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=60)
    finally:
        killed.kill()
        killed.wait()
    assert os.path.exists("same.gtrace.lock")
    open("c.go", "w").close()
    assert main(["run", "--steps", "0,1", "--no-progress", "-o", "same.gtrace", "lr.py", "c", "0.3"]) == 0
    assert os.path.exists("c.started") and sorted(load_steps("same.gtrace")) == [0, 1]
    assert not os.path.exists("same.gtrace.lock")
    # An output that is no regular file has nothing to protect: no lock file beside /dev/null.
    with tracer.trace(out=os.devnull):
        torch.ones(2).sum()
        assert not os.path.exists(os.devnull + ".lock")
    capsys.readouterr()
