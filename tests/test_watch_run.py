"""``gradtrace run --watch`` and the watch under torchrun (two gloo ranks on the CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import tracer
from export.cli import main
from tests.watch_models import WATCHED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def test_run_watch_writes_the_incident_report_and_exits_with_the_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(WATCHED)
    code = main(["run", "--watch", "train.py"])
    err = capsys.readouterr().err
    assert code == 1
    assert "NonFiniteStepError" in err and "gradtrace watch: step 3 tripped: the loss is -Inf" in err
    assert "gradtrace watch train_step: 4 steps watched" in err
    assert "gradtrace: step 3 tripped (the loss is -Inf" in err and "report -> incident.step3.html" in err
    assert (tmp_path / "incident.step3.html").stat().st_size > 10_000
    t = tracer.load(tmp_path / "incident.step3.gtrace")
    a = t.anomalies.forward
    assert (a.kind, a.producer_kind, a.stack[-1].line) == ("inf", "Tensor.log", 8)


def test_run_watch_says_so_when_the_program_has_no_watch(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain.py").write_text("print('trained')\n")
    assert main(["run", "--watch", "plain.py"]) == 0
    out, err = capsys.readouterr()
    assert out == "trained\n"
    assert err.startswith("gradtrace: plain.py created no watch, so nothing was watched: decorate its step function "
                          "with @tracer.watch(model, optimizer)")


def test_run_watch_refuses_step_options(tmp_path, capsys):
    (tmp_path / "plain.py").write_text("print('trained')\n")
    assert main(["run", "--watch", "--steps", "3", os.fspath(tmp_path / "plain.py")]) == 2
    assert "drop --steps" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_torchrun_a_trip_on_one_rank_makes_both_ranks_replay_the_same_step(tmp_path):
    out = os.fspath(tmp_path / "incident.gtrace")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", os.path.join(ROOT, "tests", "watch_dist_script.py"), out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    decoder = json.JSONDecoder()
    results = sorted((decoder.raw_decode(c)[0] for c in proc.stdout.split("RESULT ")[1:]), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        [incident] = r["incidents"]
        assert (incident["step"], incident["undone"], incident["rank"], r["finite"], r["steps"]) == \
            (3, [4], r["rank"], True, 8)
        assert incident["path"] == os.path.join(os.fspath(tmp_path), f"incident.step3.rank{r['rank']}.gtrace")
        assert incident["reproduced"]
    assert results[0]["incidents"][0]["reason"] == "a value was not finite on another rank"
    assert results[1]["incidents"][0]["reason"].startswith("the loss is NaN")
    t0 = tracer.load(results[0]["incidents"][0]["path"])
    t1 = tracer.load(results[1]["incidents"][0]["path"])
    assert t0.anomalies.clean and t1.anomalies.forward.producer_kind == "torch.nn.functional.linear"
    assert t0.header["distributed"]["rank"] == 0 and t1.header["distributed"]["rank"] == 1
