"""A streamed trace after a SIGKILL at any point: the file holds every call recorded up to the
documented window (fewer than ``flush_every`` calls are lost, and none recorded a second before
a later call) and loads as ``truncated``. Real subprocesses, killed with SIGKILL by a listener
at a chosen call, mid-forward or right after backward."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import warnings
import zlib
from typing import Any

import pytest

import tracer
from tracer.record.session import FLUSH_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLUSH_EVERY = tracer.TraceOptions().flush_every

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import tracer

    out, kill_at, mode, sleep = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])

    class KillAt(tracer.Listener):
        def on_call(self, trace, call, token, outputs):
            if mode == "call" and len(trace.calls) == kill_at:
                print(len(trace.calls), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(8, 16)
    if mode == "step":  # (warm: the step's calls then take well under FLUSH_SECONDS)
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    with tracer.trace(out=out, listeners=[KillAt()]) as t:
        h = x
        for i in range(2000):  # ~2 recorded calls per step: a long forward
            h = torch.tanh(h * 0.5 + 0.1)
            if sleep and mode != "step":
                time.sleep(sleep)
            if mode in ("backward", "step") and i == 20:
                break
        loss = model(h).pow(2).mean()
        loss.backward()
        if mode == "backward":
            print(len(t.calls), len(t.backward_runs), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # (its first call flushes the backward)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        if mode == "step":  # the loop waits for its next batch, and is killed meanwhile
            time.sleep(sleep)
            print(len(t.calls), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
""")


def _run(tmp_path: Any, name: str, kill_at: int, mode: str = "call", sleep: float = 0.0) -> tuple[str, list[int]]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = str(tmp_path / name)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script), out, str(kill_at), mode, str(sleep)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return out, [int(v) for v in proc.stdout.split()]


def _load(path: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracer.TruncatedTraceWarning)
        return tracer.load(path)


def _records_in_gzip(path: str) -> list[dict[str, Any]]:
    """Every complete record a cut-off gzip file decompresses to (independent of the loader)."""
    with open(path, "rb") as fh:
        data = fh.read()
    text = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data).decode("utf-8")
    return [json.loads(line) for line in text.split("\n")[:-1]]


def test_killed_mid_forward_at_random_calls_keeps_all_but_the_window(tmp_path: Any) -> None:
    rng = random.Random(21)
    points = [801, FLUSH_EVERY + 1, *rng.sample(range(2, 2 * FLUSH_EVERY * 3), 2)]
    for i, kill_at in enumerate(points):
        path, (recorded,) = _run(tmp_path, f"k{i}.gtrace", kill_at)
        assert recorded == kill_at
        t = _load(path)
        assert t.status == "truncated"
        kept = len(t.calls)
        # Flushes come every FLUSH_EVERY calls; the call being recorded at the kill is not in yet.
        assert kept == (recorded - 1) // FLUSH_EVERY * FLUSH_EVERY, (kill_at, kept)
        assert recorded - kept <= FLUSH_EVERY
        assert [c.seq for c in sorted(t.calls, key=lambda c: c.seq)] == list(range(kept))


def test_killed_mid_forward_in_gzip_keeps_what_was_flushed(tmp_path: Any) -> None:
    path, (recorded,) = _run(tmp_path, "k.gtrace.gz", 801)
    records = _records_in_gzip(path)
    calls = [r for r in records if r["t"] == "call"]
    assert len(calls) == (recorded - 1) // FLUSH_EVERY * FLUSH_EVERY == 768
    assert not any(r["t"] == "end" for r in records)
    with open(path, "rb") as fh, pytest.raises(EOFError):  # no trailer: the file really is cut short
        gzip.decompress(fh.read())


def test_slow_calls_are_flushed_by_time(tmp_path: Any) -> None:
    # 0.3 s per loop step (two calls): with the count alone nothing of 15 calls would be written.
    path, (recorded,) = _run(tmp_path, "slow.gtrace", 15, sleep=0.3)
    t = _load(path)
    assert t.status == "truncated"
    # The kill comes ~2.1 s after the 1st call: every call at least FLUSH_SECONDS + one step
    # older than the kill is written (a flush happens at the first call a second after the last).
    steps_before_kill = (recorded - 1) // 2
    older = steps_before_kill - int((FLUSH_SECONDS + 0.3) / 0.3)
    assert len(t.calls) >= 2 * older > 0
    assert len(t.calls) < recorded


@pytest.mark.parametrize("name", ["b.gtrace", "b.gtrace.gz"])
def test_killed_right_after_backward_keeps_the_whole_step(tmp_path: Any, name: str) -> None:
    path, (recorded, runs) = _run(tmp_path, name, 0, mode="backward")
    assert runs == 1
    if name.endswith(".gz"):
        records = _records_in_gzip(path)
        assert sum(r["t"] == "call" for r in records) == recorded
        assert sum(r["t"] == "backward" for r in records) == 1
        return
    t = _load(path)
    assert t.status == "truncated"
    assert len(t.calls) == recorded
    assert len(t.backward_runs) == 1 and t.backward_runs[0].status == "ok"
    assert t.grad_nodes and all(n.call is None or n.call in {c.name for c in t.calls} for n in t.grad_nodes)


def test_killed_while_waiting_after_the_optimizer_step_keeps_the_whole_step(tmp_path: Any) -> None:
    """The loop is idle after ``optimizer.step()`` (a DataLoader fetching the next batch) and is
    killed: every call of the step, its optimizer step included, is on disk (the step's end
    flushed it; before, the calls since the backward's flush waited for a later call)."""
    path, (recorded,) = _run(tmp_path, "step.gtrace", 0, mode="step", sleep=0.3)
    t = _load(path)
    assert len(t.calls) == recorded
    assert t.calls[-1].kind == "optimizer" and t.calls[-1].name == "SGD0"
