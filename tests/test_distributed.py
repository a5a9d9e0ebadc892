"""Distributed traces: one file per rank, collectives recorded as calls, replicas compared.

The in-process tests use a one-rank gloo group (fast, and they see the wrappers come and go);
the torchrun tests start two real ranks on CPU/gloo running tests/dist_script.py (a small
transformer under DDP or FSDP2) and compare their traces with ``diff-ranks``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

import tracer
from export.cli import main
from export.diff import ranks as dr
from tracer.features.distributed import C10D, FUNCOL, launched_rank_info, rank_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_script.py")
PERTURBED = "blocks.0.fc1.weight"


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data).hexdigest()


def _patched_state() -> dict[str, object]:
    """Every function attach() may patch, by module and name (compared before/after a trace)."""
    state: dict[str, object] = {}
    for mod in (dist, c10d):
        for name in C10D:
            state[f"{mod.__name__}.{name}"] = getattr(mod, name, None)
    for name in FUNCOL:
        state[f"funcol.{name}"] = getattr(funcol, name, None)
    return state


def _cli(argv: list[str]) -> int:
    """``gradtrace diff-ranks ...`` in this process."""
    return main(["diff-ranks", *argv])


# ---- file names and header ---------------------------------------------------------------------------
@pytest.mark.parametrize("out, rank, expected", [
    ("step.gtrace", 0, "step.rank0.gtrace"),
    ("x.gtrace.gz", 3, "x.rank3.gtrace.gz"),
    ("runs/a.b.gtrace", 1, os.path.join("runs", "a.b.rank1.gtrace")),
    ("trace", 2, "trace.rank2"),
    ("out.json", 1, "out.rank1.json"),
    ("step-{rank}.gtrace", 5, "step-5.gtrace"),
    ("step.rank1.gtrace", 1, "step.rank1.gtrace"),
])
def test_rank_path(out: str, rank: int, expected: str) -> None:
    assert rank_path(out, rank) == expected


def test_launched_rank_info_reads_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    assert launched_rank_info() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    info = launched_rank_info()
    assert info is not None
    assert (info["rank"], info["world_size"], info["local_rank"], info["backend"], info["initialized"]) == \
        (3, 4, 1, None, False)
    assert info["default_group"] == [0, 1, 2, 3] and info["launcher"] == "torchelastic"


# all_gather_single and reduce_scatter_single are newer than some torch releases (2.11 lacks them);
# there, the recorder and FSDP2 meet the older names.
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


# ---- one rank, in process --------------------------------------------------------------------------------
def test_collectives_recorded_as_calls(one_rank: None, tmp_path) -> None:
    before = _patched_state()
    gather = getattr(dist, GATHER)
    x = torch.arange(4, dtype=torch.float32)
    with tracer.trace(out=tmp_path / "step.gtrace") as t:
        y = x * 2
        dist.all_reduce(y)
        assert dist.all_reduce is not before["torch.distributed.all_reduce"]  # installed while tracing
        dist.broadcast(y, src=0)
        out = torch.empty(4)
        gather(out, y)
        dist.barrier()
        z = y + 1
        f = funcol.all_reduce(z, "sum", dist.group.WORLD)
        w = f * 3
    assert _patched_state() == before  # every wrapper removed
    assert os.path.exists(tmp_path / "step.rank0.gtrace") and not os.path.exists(tmp_path / "step.gtrace")
    info = t.header["distributed"]
    assert (info["rank"], info["world_size"], info["backend"], info["default_group"], info["initialized"]) == \
        (0, 1, "gloo", [0], True)
    assert info["groups"] == [{"name": "0", "ranks": [0], "backend": "gloo"}]

    coll = [c for c in t.calls if c.kind == "collective"]
    assert [c.name for c in coll] == ["all_reduce0", "broadcast0", f"{GATHER}0", "barrier0", "all_reduce1"]
    ar, bc, ag, bar, fr = coll
    # In place: the tensor's new value is a new version, produced by the collective.
    assert (ar.api, ar.inputs, ar.outputs, ar.args) == ("torch.distributed.all_reduce", ["mul0:out"],
                                                        ["mul0:out@v1"], "group=[0], op='SUM'")
    assert t["mul0:out@v1"].producer == "all_reduce0" and t["mul0:out@v1"].previous == "mul0:out"
    assert (bc.inputs, bc.outputs, bc.args) == (["mul0:out@v1"], ["mul0:out@v2"], "group=[0], src=0")
    assert (ag.inputs, ag.outputs) == (["empty0:out", "mul0:out@v2"], ["empty0:out@v1"])
    assert (bar.inputs, bar.outputs, bar.args) == ([], [], "group=[0]")
    assert t["add0"].inputs == ["mul0:out@v2"]  # later reads see the collective's version
    # Functional: waited for, returned as a plain tensor, hashed after the data arrived.
    assert type(f) is torch.Tensor
    assert (fr.api, fr.inputs, fr.outputs) == ("torch.distributed._functional_collectives.all_reduce",
                                               ["add0:out"], ["all_reduce1:out"])
    assert t["mul1"].inputs == ["all_reduce1:out"]
    assert t["empty0:out@v1"].md5 == _md5(out)
    assert t["all_reduce1:out"].md5 == _md5(f)
    assert any("functional collectives were waited for" in n for n in t.notes)
    assert all(c.stack and c.stack[-1].function == "test_collectives_recorded_as_calls" for c in coll)
    assert w.shape == (4,)
    loaded = tracer.load(tmp_path / "step.rank0.gtrace")
    assert [c.name for c in loaded.calls if c.kind == "collective"] == [c.name for c in coll]


def test_async_collective_recorded_at_issue_without_hash(one_rank: None) -> None:
    x = torch.ones(3)
    with tracer.trace() as t:
        y = x + 1
        work = dist.all_reduce(y, async_op=True)
        work.wait()
        z = y * 2
    call = t["all_reduce0"]
    assert (call.inputs, call.outputs, call.args) == (["add0:out"], ["add0:out@v1"], "group=[0], op='SUM', async_op=True")
    assert t["add0:out"].md5 == _md5(torch.full((3,), 2.0))  # the input, hashed before the collective ran
    rec = t["add0:out@v1"]
    assert rec.md5 is None and rec.hash_note == "not hashed: async collective, result not ready when issued"
    assert any(n.startswith("async collectives") for n in t.notes)
    assert t["mul0"].inputs == ["add0:out@v1"] and z.sum().item() == 12


def test_collective_for_records_a_reference_taken_before_the_trace(one_rank: None) -> None:
    from tracer.features.distributed import collective_for
    from tracer.record.recorder import active_recorder

    all_reduce = c10d.all_reduce  # what `from torch.distributed import all_reduce` would hold
    with tracer.trace() as t:
        rec = active_recorder()
        wrapper = collective_for(rec, all_reduce)
        assert wrapper is dist.all_reduce and collective_for(rec, torch.add) is None
        y = torch.ones(2) + 1
        wrapper(y)  # how the recorder's mode hands over a call of the original function
        op = torch.ops._c10d_functional.all_reduce
        z = collective_for(rec, op)(y, "sum", dist.group.WORLD.group_name)  # the op under funcol.all_reduce
    assert collective_for(rec, all_reduce) is None  # gone with the trace
    assert (t["all_reduce0"].kind, t["all_reduce0"].outputs) == ("collective", ["add0:out@v1"])
    call = t["all_reduce1"]
    assert (call.api, call.kind, call.inputs, call.outputs, call.args) == (
        "torch.ops._c10d_functional.all_reduce", "collective", ["add0:out@v1"], ["all_reduce1:out"],
        "group=[0], op='SUM'")
    assert t["all_reduce1:out"].md5 == _md5(z) == _md5(torch.full((2,), 2.0))


def test_other_threads_pass_through(one_rank: None) -> None:
    seen: list[float] = []

    def other() -> None:
        v = torch.ones(2)
        dist.all_reduce(v)
        seen.append(v.sum().item())

    with tracer.trace() as t:
        th = threading.Thread(target=other)
        th.start()
        th.join()
        dist.all_reduce(torch.zeros(1) + 1)
    assert seen == [2.0]
    assert [c.name for c in t.calls if c.kind == "collective"] == ["all_reduce0"]


def test_wrappers_removed_when_the_block_raises(one_rank: None) -> None:
    before = _patched_state()
    with pytest.raises(ValueError, match="boom"), tracer.trace() as t:
        dist.all_reduce(torch.ones(1))
        raise ValueError("boom")
    assert _patched_state() == before
    assert t.status == "failed" and t["all_reduce0"].kind == "collective"


def test_diff_ranks_refuses_what_it_cannot_compare(one_rank: None, tmp_path, capsys) -> None:
    with tracer.trace(out=tmp_path / "a.gtrace"):
        dist.all_reduce(torch.ones(1))
    path = str(tmp_path / "a.rank0.gtrace")
    assert _cli([path, path]) == 2
    assert "rank 0 appears twice" in capsys.readouterr().err
    plain = tracer.load(path)
    other = tracer.load(path)
    del other.header["distributed"]  # as recorded without a process group
    res = dr.diff_ranks([plain, other])
    assert res.exit_code == 2 and res.problems[0] == "trace 1 has no rank (not recorded under an initialized process group)"
    assert _cli([path]) == 2
    assert "at least two ranks" in capsys.readouterr().err


def test_diff_ranks_reports_a_collective_one_rank_skipped(one_rank: None, tmp_path) -> None:
    with tracer.trace(out=tmp_path / "s.gtrace"):
        x = torch.ones(2) + 1
        dist.all_reduce(x)
        dist.barrier()
        dist.all_reduce(x)
    path = tmp_path / "s.rank0.gtrace"
    ranks = []
    for r in (0, 1):  # the one-rank trace, as two ranks of a world of two
        t = tracer.load(path)
        t.header["distributed"] = {**t.header["distributed"], "rank": r, "world_size": 2, "default_group": [0, 1]}
        for c in t.calls:
            c.args = c.args.replace("group=[0]", "group=[0, 1]")
        ranks.append(t)
    ranks[1].calls = [c for c in ranks[1].calls if c.name != "barrier0"]  # rank 1 never reached the barrier
    ranks[1].invalidate()
    res = dr.diff_ranks(ranks)
    assert res.exit_code == 1 and len(res.departures) == 1
    d = res.departures[0]
    assert (d.what, d.rank, d.reference, d.record) == ("collective sequence", 1, [0], "all_reduce1")
    assert d.reason == ("collective #1 on the default group: rank 1 issued all_reduce1 (all_reduce, group=[0, 1], "
                        "op='SUM'), rank 0 issued barrier0 (barrier, group=[0, 1])")
    assert d.stack[-1].code == "dist.all_reduce(x)"


# ---- two ranks under torchrun ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(cwd, *args: str, launcher: list[str] | None = None, nproc: int = 2,
              timeout: int = 180, runs: int = 1) -> list[dict]:
    """Run a script on ``nproc`` ranks; each rank's ``RESULT {json}`` of each of its ``runs``
    steps, by rank (a stable sort: a rank's runs in the order it printed them)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", *(launcher or []), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    # Two ranks print into one pipe: a line's newline can land after the other rank's text, so
    # decode each payload where it starts instead of splitting on lines.
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(chunk)[0] for chunk in proc.stdout.split("RESULT ")[1:]]
    assert sorted(r["rank"] for r in results) == sorted(list(range(nproc)) * runs), proc.stdout
    return sorted(results, key=lambda r: r["rank"])


def _paths(d) -> list[str]:
    return [str(d / f"step.rank{r}.gtrace") for r in (0, 1)]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    return d, _torchrun(d, SCRIPT, "--out", str(d / "step.gtrace"))


@pytest.fixture(scope="module")
def ddp_perturbed_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp_perturbed")
    return d, _torchrun(d, SCRIPT, "--out", str(d / "step.gtrace"), "--perturb", PERTURBED)


def test_ddp_one_trace_per_rank_with_collectives(ddp_run) -> None:
    d, results = ddp_run
    assert [r["path"] for r in results] == _paths(d) and all(r["restored"] for r in results)
    assert not os.path.exists(d / "step.gtrace")
    traces = [tracer.load(p) for p in _paths(d)]
    for rank, t in enumerate(traces):
        info = t.header["distributed"]
        assert (info["rank"], info["world_size"], info["backend"], info["local_rank"], info["default_group"]) == \
            (rank, 2, "gloo", rank, [0, 1])
        coll = [c for c in t.calls if c.kind == "collective"]
        assert [c.name for c in coll] == ["ddp_allreduce0", "all_reduce0", "broadcast0", f"{GATHER}0", "barrier0"]
        ddp = coll[0]
        params = [n for n, r in t.tensors.items() if r.role == "param" and r.previous is None]
        assert len(params) == 29 and params[0] == "module.emb.weight"
        # DDP's all-reduce: local gradients in, averaged gradients (on the parameters) out.
        assert ddp.inputs == [f"{p}@grad" for p in params]
        assert ddp.outputs == [f"{p}@grad@v1" for p in params]
        assert (ddp.api, ddp.phase, ddp.args) == (
            "torch.nn.parallel.DistributedDataParallel.reducer.allreduce", "backward",
            "group=[0, 1], buckets=1, bucket_bytes=[30592], during='backward0'")
        assert ddp.stack[-1].code == "loss.backward()"
        assert t["module.head.weight@grad@v1"].md5 == results[rank]["head_grad_md5"]
        assert t["all_reduce0"].outputs == ["clone0:out@v1"]
        assert t["clone0:out@v1"].md5 == results[rank]["total_md5"]
    a, b = traces
    # Reduced values agree, local ones differ (each rank had its own data).
    assert a["module.head.weight@grad@v1"].md5 == b["module.head.weight@grad@v1"].md5
    assert a["module.head.weight@grad"].md5 != b["module.head.weight@grad"].md5
    assert a["clone0:out@v1"].md5 == b["clone0:out@v1"].md5


def test_ddp_replicas_agree(ddp_run, capsys) -> None:
    d, _ = ddp_run
    assert _cli(_paths(d)) == 0
    assert capsys.readouterr().out.startswith("REPLICAS AGREE: ranks 0, 1,")
    res = dr.diff_ranks(_paths(d))
    assert res.exit_code == 0 and res.departures == []
    assert res.collectives == {0: 5, 1: 5}
    # 29 parameters before and after AdamW's step (one call), the 3 state tensors it made for
    # each, 29 averaged gradients, and the outputs of all_reduce, broadcast and all_gather_single.
    assert res.compared == 29 * 2 + 29 * 3 + 29 + 3
    assert res.expected["local gradients"] > 29 and res.expected["inputs"] == 1


def test_ddp_rank_that_nudges_a_gradient_is_reported(ddp_perturbed_run, capsys) -> None:
    d, _ = ddp_perturbed_run
    assert _cli([*_paths(d), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    first = out["first"]
    param = f"module.{PERTURBED}"
    assert (first["rank"], first["record"], first["what"], first["param"], first["call"], first["module"]) == \
        (1, f"{param}@grad@v2", "reduced gradient", param, "add_0", "")
    assert first["stack"][-1]["code"].startswith("param.grad.add_(1e-6)")
    assert first["reason"] == f"only rank 1 has {param}@grad@v2; rank 0 does not"
    # The parameter then steps differently on rank 1, and only that parameter: the state AdamW's
    # step makes for it and its new value, both outputs of the step (one call).
    later = [(x["rank"], x["record"]) for x in out["departures"][1:]]
    assert later == [(1, f"{param}.exp_avg"), (1, f"{param}.exp_avg_sq"), (1, f"{param}@v1")]
    assert out["verdict"].startswith(f"RANK 1 DEPARTED first at reduced gradient {param}@grad@v2")


def test_fsdp2_traces_and_compares(tmp_path) -> None:
    results = _torchrun(tmp_path, SCRIPT, "--out", str(tmp_path / "step.gtrace"), "--mode", "fsdp")
    assert all(r["restored"] for r in results)
    traces = [tracer.load(p) for p in _paths(tmp_path)]
    for t in traces:
        names = [c.name for c in t.calls if c.kind == "collective"]
        # FSDP2 all-gathers each unit's parameters in forward (root, two blocks), again in
        # backward for the resharded blocks, and reduce-scatters their gradients.
        assert [n for n in names if n.startswith(GATHER)] == [f"{GATHER}{i}" for i in range(6)]
        assert [n for n in names if n.startswith(SCATTER)] == [f"{SCATTER}{i}" for i in range(3)]
        rs = t[f"{SCATTER}0"]
        assert rs.args == "group=[0, 1], op='AVG'" and rs.phase == "backward"
        assert t[f"{GATHER}1"].module == "blocks.0"
    a, b = traces
    assert a[a[f"{GATHER}1"].outputs[0]].md5 == b[b[f"{GATHER}1"].outputs[0]].md5
    res = dr.diff_ranks(traces)
    assert res.exit_code == 0, res.verdict()
    # 5 all-gathered parameter sets; all_reduce, broadcast, all_gather_single; and AdamW's step
    # count of each of the 29 parameters (plain tensors).
    assert res.compared == 8 + 29
    assert res.expected["rank-specific collective outputs"] == 3  # each rank's gradient shard
    # The sharded DTensors are hashed (their local shard), and each shard lives on one rank: the
    # 29 parameters before and after the step, their gradients and AdamW's two moments.
    assert res.not_comparable == {}
    assert res.expected["distinct shards"] == 29 * 5
    p = a["blocks.0.fc1.weight"]
    assert p.sharding is not None and (p.shape, p.sharding.local_shape, p.sharding.placements) == \
        ((64, 16), (32, 16), ("Shard(0)",))
    assert [t["blocks.0.fc1.weight"].sharding.coordinate for t in traces] == [(0,), (1,)]


def test_gradtrace_run_under_torchrun_writes_one_file_per_rank(tmp_path) -> None:
    _torchrun(tmp_path, "--out", str(tmp_path / "step.gtrace"), "--steps", "0", SCRIPT,
              "--out", "unused", "--untraced", launcher=["-m", "tracer", "run"])
    for rank, path in enumerate(_paths(tmp_path)):
        t = tracer.load(path)
        assert (t.header["distributed"]["rank"], t.header["distributed"]["world_size"]) == (rank, 2)
        assert [c.name for c in t.calls if c.kind == "collective"] == \
            ["ddp_allreduce0", "all_reduce0", "broadcast0", f"{GATHER}0", "barrier0"]
    assert not os.path.exists(tmp_path / "step.gtrace")
    assert _cli(_paths(tmp_path)) == 0


# ---- two GPUs, NCCL -----------------------------------------------------------------------------------------
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.mark.cuda
@two_gpus
def test_ddp_nccl_replicas_agree_and_departure_found(tmp_path) -> None:
    clean, nudged = tmp_path / "clean", tmp_path / "nudged"
    clean.mkdir()
    nudged.mkdir()
    _torchrun(clean, SCRIPT, "--out", str(clean / "step.gtrace"), "--device", "cuda")
    _torchrun(nudged, SCRIPT, "--out", str(nudged / "step.gtrace"), "--device", "cuda", "--perturb", PERTURBED)
    ok = dr.diff_ranks(_paths(clean))
    assert ok.exit_code == 0, ok.verdict()
    bad = dr.diff_ranks(_paths(nudged))
    assert bad.exit_code == 1 and bad.first is not None
    assert (bad.first.rank, bad.first.param) == (1, f"module.{PERTURBED}")
    t = tracer.load(_paths(clean)[0])
    assert t.header["distributed"]["backend"] == "nccl" and t["ddp_allreduce0"].kind == "collective"


# ---- DDP's bucket views: gradients the all-reduce averages in place ---------------------------------------------
BUCKET_SCRIPT = os.path.join(ROOT, "tests", "ddp_bucket_views_script.py")


def _check_bucket_views(printed: list[dict]) -> None:
    """Per rank and setting: the batched path's records equal the per-tensor path's, name for
    name (fingerprints and stats), and neither traced step changed a gradient or a parameter.
    With the comm hook, its future's decompression into the bucket is recorded only when torch
    runs it on the traced thread (when the all-reduce has finished by the time the hook attaches
    it), else it runs unseen on gloo's thread: the versions it makes (the bucket's, ``input<k>@v<n>``,
    and its gradients') may be on one side only; every record both sides have is equal."""
    results = []
    for line in printed:
        with open(line["file"]) as f:
            results.append(json.load(f))
    settings = [(False, False), (True, False), (True, True)]
    assert sorted((r["rank"], r["bucket_view"], r["comm_hook"]) for r in results) == \
        sorted((rank, *s) for rank in (0, 1) for s in settings)
    for r in results:
        per_tensor, batched, untraced = r["per_tensor"], r["batched"], r["untraced"]
        setting = (r["rank"], r["bucket_view"], r["comm_hook"])
        if r["comm_hook"]:
            one_side = set(per_tensor["records"]) ^ set(batched["records"])
            assert all(re.search(r"@v\d+$", name) for name in one_side), (setting, one_side)
            common = set(per_tensor["records"]) & set(batched["records"])
            assert {n: batched["records"][n] for n in common} == {n: per_tensor["records"][n] for n in common}, setting
        else:
            assert batched["records"] == per_tensor["records"], setting
        assert batched["grads"] == per_tensor["grads"] == untraced["grads"]
        assert batched["after"] == per_tensor["after"] == untraced["after"]
        # ddp_allreduce's outputs, one per parameter, are the averaged gradients as the step
        # left them (read again afterwards), its inputs the local ones; every value was read.
        params = len(untraced["grads"]) // 2
        assert params == 2 * 12 + 5
        for path in (per_tensor, batched):
            assert len(path["averaged"]) == len(path["local"]) == len(path["truth"]) == params
            assert [path["records"][name][0] for name in path["averaged"]] == path["truth"], setting
            # (the comm hook's async all-reduce outputs are not ready when issued: by design unread)
            assert all((fp is not None and stats is not None) or "async collective" in (note or "")
                       for fp, stats, note in path["records"].values())
    # The ranks' gradients were averaged: the same on both, though each rank had its own data.
    by_setting: dict[tuple[bool, bool], list[dict]] = {}
    for r in results:
        by_setting.setdefault((r["bucket_view"], r["comm_hook"]), []).append(r["untraced"]["grads"])
    assert all(a == b for a, b in by_setting.values())


def test_ddp_bucket_views_are_read_as_accumulated_through_the_batches(tmp_path) -> None:
    """gloo on the CPU, the batches under Triton's interpreter: with gradient_as_bucket_view the
    all-reduce rewrites each .grad in place; every record still equals the per-tensor path's."""
    _check_bucket_views(_torchrun(tmp_path, BUCKET_SCRIPT, runs=3, timeout=600))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ddp_gloo_cuda_bucket_views_are_read_as_accumulated_through_the_batches(tmp_path) -> None:
    """gloo with CUDA tensors, both ranks on one GPU: the all-reduce copies each bucket through
    the host on streams of its own and writes it back in place; the Triton batches read every
    value as the per-tensor torch reads did."""
    _check_bucket_views(_torchrun(tmp_path, BUCKET_SCRIPT, "--device", "cuda", "--backend", "gloo", runs=3,
                                  timeout=600))


@pytest.mark.cuda
@two_gpus
def test_ddp_nccl_bucket_views_are_read_as_accumulated_through_the_batches(tmp_path) -> None:
    """NCCL on two GPUs: the all-reduces run on their own stream while the batches still hold
    bucket views; the Triton batches read every value as the per-tensor torch reads did."""
    _check_bucket_views(_torchrun(tmp_path, BUCKET_SCRIPT, "--device", "cuda", runs=3, timeout=600))


def test_ddp_bucket_views_with_gradient_accumulation_in_one_trace(one_rank) -> None:
    """Gradient accumulation under DDP with bucket views, both micro-batches and the step in one
    block: the first under no_sync (no all-reduce), the second synchronised. The accumulated
    values are read in gradtrace's post-accumulate-grad hooks (one per parameter, hooked once
    however many forwards), DDP's record follows the synchronised backward only, the optimizer
    reads the averaged gradients, and the hooks are gone after the block."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(3, 8)
    ddp(x).sum().backward()  # DDP makes .grad views into its buckets
    opt.step()
    opt.zero_grad(set_to_none=False)
    with tracer.trace() as t:
        with ddp.no_sync():
            ddp(x).sum().backward()
        ddp(x * 2).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    ddp_calls = [c for c in t.calls if c.kind == "collective"]
    assert [c.name for c in ddp_calls] == ["ddp_allreduce0"]
    call = ddp_calls[0]
    params = [f"module.{n}" for n, _ in model.named_parameters()]
    # Per parameter: v0 the zeroed bucket view, v1 the first accumulation, v2 the same bytes after
    # DDP re-laid its buckets at the synchronised forward (a write the trace cannot see: the
    # version counter moved), v3 the second accumulation, read in gradtrace's hook before DDP
    # divided it, v4 the averaged gradient the all-reduce left in place (one rank: the same values).
    assert call.inputs == [f"{p}@grad@v3" for p in params]
    assert call.outputs == [f"{p}@grad@v4" for p in params]
    for p, g in zip(params, grads):
        assert t[f"{p}@grad@v1"].producer == t[f"{p}@grad@v3"].producer == f"{p}/AccumulateGrad"
        assert t[f"{p}@grad@v4"].producer == "ddp_allreduce0"
        assert t[f"{p}@grad@v4"].md5 == t[f"{p}@grad@v3"].md5 == hashlib.md5(g.numpy().tobytes()).hexdigest()
    assert {f"{p}@grad@v4" for p in params} <= set(t["SGD0"].inputs)  # the step read the averaged ones
