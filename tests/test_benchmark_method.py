"""The overhead benchmark's method: configurations take turns in an order rotated every round,
and garbage is collected before each step, outside the timed region (benchmarks/README.md)."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


def _load_script(name: str) -> Any:
    """benchmarks/<name>.py, imported with the benchmarks directory on the path only while it
    loads (it puts that directory first on ``sys.path``, which other tests' subprocess-like runs
    of a script would then see)."""
    import importlib

    saved = sys.path[:]
    sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        return importlib.import_module(name)  # (a script directory, not a package)
    finally:
        sys.path[:] = saved


class _Steps:
    """A workload whose step notes which configuration it ran under."""

    device = torch.device("cpu")

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.current = ""

    def step(self) -> None:
        self.log.append(f"step:{self.current}")


def test_configurations_rotate_every_round_and_garbage_is_collected_before_each_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    w = _Steps(log)
    real_collect = gc.collect

    def collect(*args: Any) -> int:
        log.append("collect")
        return real_collect(*args)

    monkeypatch.setattr(gc, "collect", collect)

    def config(name: str) -> Any:
        @contextlib.contextmanager
        def make() -> Iterator[None]:
            w.current = name
            yield None

        return (name, make)

    available = {k: config(k) for k in ("a", "b", "c")}
    tm = _load_script("overhead").measure(w, ["a", "b", "c"], available, warmup=1, repeats=3)
    steps = [e for e in log if e != "collect"]
    assert steps == [f"step:{k}" for k in "abc" + "bca" + "cab" + "abc"]
    # One collection right before every step (none inside it), warm-up round included.
    assert log == [e for s in steps for e in ("collect", s)]
    assert {k: len(v) for k, v in tm.times.items()} == {"a": 3, "b": 3, "c": 3}  # the warm-up round is not timed


def test_the_minimal_records_floor_keeps_one_record_per_object_and_no_tensor() -> None:
    """floor.py's ``+minimal records`` row (the bound overhead.py prints under each table) records
    each call, each tensor value (a first-seen input too) and each grad node once, with the
    value's metadata, and holds no tensor."""
    import weakref

    floor = _load_script("floor")
    row = floor.hook_point_rows()["+minimal records"]
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(2, 3)
    with row():
        y = x @ w  # inputs x and w first seen: two records; y a third
        z = y.relu().sum()
    rec = floor._RecordsMode.last
    assert rec is not None and floor.minimal_records_objects() == rec.objects()
    assert [c[0] for c in rec.calls] == ["matmul0", "relu1", "sum2"]
    assert len(rec.tensors) == 5  # x, w, y, relu's output, z
    names = [c[2][0] for c in rec.calls]
    assert rec.calls[1][1] == [names[0]] and rec.calls[2][1] == [names[1]]  # linked by identity
    assert rec.tensors[names[0]][:4] == (torch.Size([2, 4]), (4, 1), torch.float32, torch.device("cpu"))
    # MmBackward0, AccumulateGrad (w), ReluBackward0, SumBackward0
    assert sorted(n[1] for n in rec.nodes) == ["AccumulateGrad", "MmBackward0", "ReluBackward0", "SumBackward0"]
    assert rec.objects() == 3 + 5 + 4
    ref = weakref.ref(y)
    del y, z
    assert ref() is None  # the records hold no tensor


class _Sleeps:
    """A step that waits without using the CPU."""

    device = torch.device("cpu")

    def step(self) -> None:
        import time

        time.sleep(0.2)


def test_the_process_clock_counts_cpu_time_only() -> None:
    """``--clock process``: a step that only waits costs (almost) nothing on it, its full wait
    on the wall clock; the clock is the process's for every later step until set back."""
    workloads = _load_script("workloads")
    try:
        workloads.use_clock("process")
        ms, body_ms, _ = workloads.time_step(_Sleeps(), contextlib.nullcontext)
        assert ms < 50 and body_ms < 50
    finally:
        workloads.use_clock("wall")
    ms, _, _ = workloads.time_step(_Sleeps(), contextlib.nullcontext)
    assert ms >= 200


def test_the_process_clock_is_refused_on_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    overhead = _load_script("overhead")
    with pytest.raises(SystemExit):
        overhead.main(["--device", "cuda", "--clock", "process"])
    assert "--clock process measures CPU time" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny12", "llama-tiny", "resnet50-tiny", "vit-tiny", "bert-tiny"])
def test_every_tiny_workload_takes_a_training_step_with_its_own_loss(model: str) -> None:
    """The benchmarks' CPU workloads: each builds from its config, its loss is the model's own
    (causal LM, masked LM, or cross-entropy over the image classes), and a step changes every
    parameter that got a gradient."""
    workloads = _load_script("workloads")
    w = workloads.build(model, torch.device("cpu"), None, None, None, True)
    before = [p.detach().clone() for p in w.model.parameters()]
    w.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, w.model.parameters()) if p.grad is not None)
    assert sum(p.grad is not None for p in w.model.parameters()) > 100  # 12 layers' worth
    with torch.no_grad():
        loss = float(w.loss())
    if model.startswith(("resnet", "vit")):
        assert w.labels is not None and w.describe() == "batch 4 x 3 x 32 x 32"
        logits = w.model(**w.inputs).logits
        assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, w.labels)), rel=1e-5)
    else:
        assert w.labels is None and w.describe() == "batch 4 x seq 64"
        expected = w.model.loss_type
        assert expected == ("ForMaskedLM" if model == "bert-tiny" else "ForCausalLM")
    assert torch.isfinite(torch.tensor(loss))


def test_lever_ab_rotates_its_variants_and_puts_each_lever_back() -> None:
    """benchmarks/lever_ab.py: the variants take turns in an order rotated every round; a lever
    is off only inside its variant and is put back even when the step raises; a lever's cost is
    the median of the per-round differences off minus on, with their quartiles."""
    from tracer.record.checksums import fused, hasher

    lever_ab = _load_script("lever_ab")
    order: list[str] = []
    variants = {name: (lambda name=name: order.append(name) or 1.0) for name in ("plain", "on", "off")}
    times = lever_ab.run_rounds(variants, 3)
    assert order == ["plain", "on", "off", "on", "off", "plain", "off", "plain", "on"]
    assert times == {"plain": [1.0] * 3, "on": [1.0] * 3, "off": [1.0] * 3}
    order.clear()  # with settle: each timed call right after an untimed one of the same variant
    counted = {name: (lambda name=name: float(len(order.append(name) or order))) for name in variants}
    times = lever_ab.run_rounds(counted, 2, settle=1)
    assert order == ["plain", "plain", "on", "on", "off", "off", "on", "on", "off", "off", "plain", "plain"]
    assert times == {"plain": [2.0, 12.0], "on": [4.0, 8.0], "off": [6.0, 10.0]}  # the second of each pair

    dense, list_min = fused.READ_DENSE_IN_PLACE, hasher.LIST_MIN
    with lever_ab.lever_off(lever_ab.LEVERS["dense_stats"]), lever_ab.lever_off(lever_ab.LEVERS["read_now"]):
        off = (fused.READ_DENSE_IN_PLACE, hasher.LIST_MIN)
        assert off == (False, sys.maxsize)
    with pytest.raises(RuntimeError), lever_ab.lever_off(lever_ab.LEVERS["dense_stats"]):
        raise RuntimeError("a step that failed")
    assert (fused.READ_DENSE_IN_PLACE, hasher.LIST_MIN) == (dense, list_min) == (True, 32)
    import importlib

    for name, lever in lever_ab.LEVERS.items():  # every lever: a public switch, on by default
        module = importlib.import_module(lever.module)
        on = getattr(module, lever.attribute)
        assert not lever.attribute.startswith("_") and on != lever.off, name
        with lever_ab.lever_off(lever):
            assert getattr(module, lever.attribute) == lever.off, name
        assert getattr(module, lever.attribute) == on, name

    # rounds drift (100, 120, 90, 110, 105) but each pair differs by 3 or 4: the drift cancels
    on = [100.0, 120.0, 90.0, 110.0, 105.0]
    off = [103.0, 124.0, 93.0, 114.0, 108.0]
    assert lever_ab.paired_summary(on, off) == (3.0, 3.0, 4.0)


def test_host_split_times_the_recorder_functions_and_puts_them_back() -> None:
    """benchmarks/host_split.py: the per-function table counts each call of the wrapped entry
    points (inclusive time), and every original is back after the block, also when it raises;
    ``capture_only_nodes`` hands each grad node's run to a list instead of the recorder."""
    import tracer
    from tracer.record.autograd import Graph
    from tracer.record.checksums.hasher import Hasher

    host_split = _load_script("host_split")
    originals = {name: Graph.__dict__[name] for name in ("node_done", "_grad_names")}
    submit = Hasher.__dict__["submit"]
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with host_split.timed_functions() as (ns, calls), tracer.trace(hash="fast", node_runs=True) as t:
        lin(x).relu().sum().backward()
    assert calls["Graph.node_done"] == len(t.grad_nodes) - 2 == 4  # all but the two accumulators'
    assert calls["Graph.node_begin"] == calls["Graph.node_end"] == 2  # the accumulators: pre-hook and hook
    assert calls["Hasher.submit"] == calls["TensorNames.new_tensor"] == len(t.tensors)
    assert all(ns[label] > 0 for label in calls)
    assert {name: Graph.__dict__[name] for name in originals} == originals and Hasher.__dict__["submit"] is submit
    with pytest.raises(RuntimeError), host_split.timed_functions():
        raise RuntimeError("a step that failed")
    assert Graph.__dict__["node_done"] is originals["node_done"]

    with host_split.capture_only_nodes() as captured, tracer.trace(hash="none", node_runs=True):
        lin(x).relu().sum().backward()
    assert [node for node, _, _ in captured] == ["sum0/SumBackward0", "relu0/ReluBackward0",
                                                 "linear0/AddmmBackward0", "linear0/TBackward0"]
    assert Graph.__dict__["node_done"] is originals["node_done"]
