"""examples/train.py runs as a user would run it, and the step it traces is a complete trace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tracer

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"


def _run_train(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    out = os.fspath(tmp_path / "step1.gtrace")
    proc = subprocess.run(
        [sys.executable, os.fspath(TRAIN), "--steps", "3", "--trace-step", "1", "--out", out, *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc, out


@pytest.mark.parametrize("model", ["gpt2", "torch"])
def test_train_traces_one_complete_step(tmp_path: Path, model: str) -> None:
    if model == "gpt2":
        pytest.importorskip("transformers")
    proc, out = _run_train(tmp_path, "--model", model)

    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"model {model}, ")
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["0", "1", "2"]
    assert "[traced:" in steps[1] and "[traced:" not in steps[0] + steps[2]

    t = tracer.load(out)
    assert t.status == "ok" and t.error is None
    assert t.header["format"] == "gradtrace" and t.header["version"] == tracer.SCHEMA_VERSION
    # the model's calls are forward; the optimizer step and what works on the gradients are optimizer
    assert t.calls and {c.phase for c in t.calls} <= {"forward", "optimizer"}
    assert all(c.phase == "optimizer" for c in t.calls if c.kind == "optimizer")
    assert all(c.phase == "forward" for c in t.calls if c.module)
    assert f"{len(t.calls)} calls" in steps[1]

    # One backward run, from the loss, called on the user's line in train.py.
    (run,) = t.backward_runs
    assert run.name == "backward0" and run.api == "Tensor.backward" and run.status == "ok"
    (root,) = run.roots
    producer = t[t.tensors[root].producer]
    assert producer.api == "torch.nn.functional.cross_entropy"
    assert run.stack[-1].file == os.fspath(TRAIN) and run.stack[-1].code == "loss.backward()"

    # Every parameter was seen under its module path, got its gradient accumulated in that run,
    # and was updated in place by AdamW afterwards (a new version that replaces it).
    params = {n for n, r in t.tensors.items() if r.role == "param" and r.previous is None}
    accumulated = {n.param for n in t.grad_nodes if n.kind == "AccumulateGrad"}
    assert params and accumulated == params
    assert {f"{p}/AccumulateGrad" for p in params} <= set(run.order)
    for p in params:
        assert t[f"{p}@v1"].previous == p
        assert t[f"{p}@grad"].role == "grad"

    # Every grad node the step created is linked to a recorded call and ran in the backward.
    made = [n for n in t.grad_nodes if n.call is not None]
    assert made and all(n.name in t[n.call].grad_nodes for n in made)
    assert {n.name for n in made} <= set(run.order)
    assert not any(n.external for n in t.grad_nodes)

    if model == "gpt2":
        assert "transformer.h.1.attn.c_attn.weight" in params
        assert t.modules["transformer.h.0.mlp.c_fc"] == "Conv1D"
    else:
        first = t["embedding0"]
        assert first.module == "tok" and first.inputs[1] == "tok.weight"
        assert first.stack[-1].file == os.fspath(TRAIN) and first.stack[-1].function == "TinyLM.forward"


def test_train_without_trace_writes_nothing(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, os.fspath(TRAIN), "--steps", "1", "--model", "torch"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [ln.split()[:2] for ln in proc.stdout.splitlines()[1:]] == [["step", "0"]]
    assert list(tmp_path.iterdir()) == []


def test_train_rejects_a_trace_step_past_the_end(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, os.fspath(TRAIN), "--steps", "2", "--trace-step", "2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--trace-step must be between 0 and 1" in proc.stderr
