"""DTensor traces on four ranks: FSDP2 and 2-way tensor parallel x 2-way FSDP2, CPU/gloo.

The torchrun tests start four real ranks running tests/dist4_script.py (a tiny Llama-style model
from ``transformers.LlamaConfig``) and check what each rank's trace says about its shards, its
collectives, and what ``gradtrace diff --ranks`` and the multi-rank report make of the four files.
One in-process test checks a DTensor's record on a one-rank mesh.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Any

import pytest
import torch

import tracer
from export.cli import main
from export.diff import ranks as dr
from tests.test_distributed import _torchrun
from tracer.model import Sharding, TensorRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist4_script.py")
PERTURBED = "model.norm.weight"
GATHER, SCATTER = "all_gather_single", "reduce_scatter_single"


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data).hexdigest()


def _paths(d: Any) -> list[str]:
    return [str(d / f"step.rank{r}.gtrace") for r in range(4)]


# The three four-rank steps the tests read, in one launch: four processes importing torch and
# transformers cost more than a step, three launches took 11-26 s each on a 2-core machine.
STEPS = {"fsdp4": ("fsdp",), "tp4": ("tp",), "tp4_perturbed": ("tp", PERTURBED)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, tuple[Any, list[dict[str, Any]]]]:
    """Each step's directory and its four ranks' RESULTs, by step name."""
    root = tmp_path_factory.mktemp("dist4")
    runs = [arg for name, how in STEPS.items() for arg in ("--job", ",".join([str(root / name / "step.gtrace"), *how]))]
    results = _torchrun(root, SCRIPT, *runs, nproc=4, timeout=600, runs=len(STEPS))
    by_out: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_out.setdefault(r["out"], []).append(r)
    return {name: (root / name, by_out[str(root / name / "step.gtrace")]) for name in STEPS}


@pytest.fixture(scope="module")
def fsdp4(launched):
    return launched["fsdp4"]


@pytest.fixture(scope="module")
def tp4(launched):
    return launched["tp4"]


@pytest.fixture(scope="module")
def tp4_perturbed(launched):
    return launched["tp4_perturbed"]


# ---- one rank, in process --------------------------------------------------------------------------------
def test_dtensor_record_hashes_the_local_shard_and_keeps_its_layout(one_rank: None, tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    w = torch.nn.Parameter(distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0), Replicate()]))
    out = tmp_path / "dt.gtrace"
    with tracer.trace(out=str(out)) as t:
        y = (w * 2).sum()
    rec = t.tensors["input0"]
    assert rec.sharding == Sharding(("Shard(0)", "Replicate()"), ("dp", "tp"), (1, 1), (0,), (0, 0), (4, 3))
    assert rec.md5 == _md5(w.to_local()) and rec.hash_note is None and rec.shape == (4, 3)
    assert rec.stats is not None and rec.stats.max == 11.0
    assert rec.sharding.describe() == "Shard(0)@dp, Replicate()@tp on mesh dp=1 x tp=1"
    # The product is a DTensor too; the sum's Partial is resolved by DTensor before it returns.
    assert t.tensors["mul0:out"].md5 == _md5((w * 2).to_local())
    assert float(y.detach().full_tensor()) == 132.0
    # Written and read back unchanged; a record without the field (older files) loads as before.
    assert t.meta["out"] == str(tmp_path / "dt.rank0.gtrace")  # under a process group: per rank
    back = tracer.load(t.meta["out"])
    assert back.tensors["input0"].sharding == rec.sharding
    plain = TensorRecord.from_json({k: v for k, v in rec.to_json().items() if k != "sharding"})
    assert plain.sharding is None and plain.md5 == rec.md5


def test_replica_key_ignores_only_replicated_dimensions() -> None:
    a = Sharding(("Shard(0)", "Replicate()"), ("dp", "tp"), (2, 2), (0, 1, 2, 3), (1, 0), (24,))
    b = Sharding(("Shard(0)", "Replicate()"), ("dp", "tp"), (2, 2), (0, 1, 2, 3), (1, 1), (24,))
    c = Sharding(("Shard(0)", "Replicate()"), ("dp", "tp"), (2, 2), (0, 1, 2, 3), (0, 1), (24,))
    partial = Sharding(("Replicate()", "Partial(sum)"), ("dp", "tp"), (2, 2), (0, 1, 2, 3), (1, 1), (24,))
    partial_peer = Sharding(("Replicate()", "Partial(sum)"), ("dp", "tp"), (2, 2), (0, 1, 2, 3), (1, 0), (24,))
    assert a.replica_key() == b.replica_key() != c.replica_key()
    assert partial.replica_key() != partial_peer.replica_key()  # each holds its own summand
    with pytest.raises(tracer.TraceFormatError, match="mesh_ranks"):
        Sharding.from_json({"placements": ["Replicate()"], "mesh_shape": [2], "local_shape": [3]})


# ---- FSDP2 over four ranks ---------------------------------------------------------------------------------
def test_fsdp2_four_ranks_sharded_parameters_and_collectives(fsdp4) -> None:
    d, results = fsdp4
    traces = [tracer.load(p) for p in _paths(d)]
    for rank, (t, res) in enumerate(zip(traces, results)):
        assert res["path"] == _paths(d)[rank] and res["dtensors"] == res["params"] == 21
        info = t.header["distributed"]
        assert (info["rank"], info["world_size"], info["backend"]) == (rank, 4, "gloo")
        norm = t["model.norm.weight"]
        assert (norm.role, norm.shape, norm.sharding.placements, norm.sharding.mesh_dims,
                norm.sharding.mesh_ranks, norm.sharding.coordinate, norm.sharding.local_shape) == \
            ("param", (48,), ("Shard(0)",), ("dp",), (0, 1, 2, 3), (rank,), (12,))
        assert t["lm_head.weight"].sharding.local_shape == (16, 48)
        # The trace's checksum is of this rank's local shard, as the script hashed it by hand.
        assert norm.md5 == res["local_md5"]["model.norm.weight"]
        assert t["lm_head.weight"].md5 == res["local_md5"]["lm_head.weight"]
        coll = [c for c in t.calls if c.kind == "collective"]
        # FSDP2: the root and two layers all-gathered in forward, the two layers again in backward
        # (resharded after forward), and their gradients reduce-scattered.
        assert [(c.name, c.phase) for c in coll] == [
            (f"{GATHER}0", "forward"), (f"{GATHER}1", "forward"), (f"{GATHER}2", "forward"),
            (f"{GATHER}3", "backward"), (f"{GATHER}4", "backward"),
            (f"{SCATTER}0", "backward"), (f"{SCATTER}1", "backward"), (f"{SCATTER}2", "backward")]
        assert {c.args for c in coll} == {"group=[0, 1, 2, 3]", "group=[0, 1, 2, 3], op='AVG'"}
        assert (t[f"{GATHER}1"].module, t[f"{SCATTER}0"].module) == ("model.layers.0", "model.layers.1")
        for c in coll:  # what was sent and what was received, each with its checksum
            assert c.inputs and c.outputs and all(t[n].md5 for n in c.inputs[-1:] + c.outputs)
    # Each rank sent its own shard; every rank received the same all-gathered buffer.
    sent = {t[t[f"{GATHER}1"].inputs[-1]].md5 for t in traces}
    received = {t[t[f"{GATHER}1"].outputs[0]].md5 for t in traces}
    assert len(sent) == 4 and len(received) == 1


def test_fsdp2_four_ranks_agree_and_shards_are_not_compared(fsdp4, capsys) -> None:
    d, _ = fsdp4
    assert main(["diff", "--ranks", *_paths(d)]) == 0
    assert capsys.readouterr().out.startswith("REPLICAS AGREE: ranks 0, 1, 2, 3,")
    res = dr.diff_ranks(_paths(d))
    # The 5 all-gathered buffers, the 21 step counts (plain tensors) and the rotary embedding's
    # buffer, and nothing sharded: each of the 21 parameters' shards (value, gradient, two
    # moments, new value) is on one rank only.
    assert res.compared == 5 + 21 + 1
    assert res.expected["distinct shards"] == 21 * 5
    assert res.not_comparable == {}


# ---- 2-way tensor parallel x 2-way FSDP2 -------------------------------------------------------------------
def test_tp_fsdp_2d_mesh_placements_and_collectives(tp4) -> None:
    d, results = tp4
    traces = [tracer.load(p) for p in _paths(d)]
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, (t, res) in enumerate(zip(traces, results)):
        assert res["norm_placements"] == ["S(0)", "R"]
        expect = {
            "model.norm.weight": (("Shard(0)", "Replicate()"), (24,)),
            "model.embed_tokens.weight": (("Shard(0)", "Shard(1)"), (32, 24)),
            "model.layers.0.self_attn.o_proj.weight": (("Shard(0)", "Shard(1)"), (24, 24)),
            # FSDP2 over a column-wise weight: dim 0 split by tp first, then by dp.
            "model.layers.0.self_attn.q_proj.weight": (("_StridedShard(dim=0, sf=2)", "Shard(0)"), (12, 48)),
        }
        for name, (placements, local) in expect.items():
            s = t[name].sharding
            assert (s.placements, s.local_shape, s.mesh_dims, s.mesh_shape, s.coordinate) == \
                (placements, local, ("dp", "tp"), (2, 2), coords[rank]), name
        assert t["model.norm.weight"].md5 == res["local_md5"]["model.norm.weight"]
        tp_group = f"[{rank - rank % 2}, {rank - rank % 2 + 1}]"
        dp_group = f"[{rank % 2}, {rank % 2 + 2}]"
        coll = [c for c in t.calls if c.kind == "collective"]
        kinds = [(c.api.rsplit(".", 1)[-1], c.phase, re.search(r"group=(\[[\d, ]*\])", c.args).group(1)) for c in coll]
        # FSDP2 on the dp pair: 3 all-gathers in forward, 2 in backward, 3 reduce-scatters.
        assert [k for k in kinds if k[2] == dp_group] == [
            (GATHER, "forward", dp_group)] * 3 + [(GATHER, "backward", dp_group)] * 2 + [
            (SCATTER, "backward", dp_group)] * 3
        # DTensor on the tp pair: the row-wise all-reduces (o_proj, down_proj per layer), the
        # embedding's and the logits' all-gathers, and their backward counterparts.
        tp_calls = [k[:2] for k in kinds if k[2] == tp_group]
        assert tp_calls.count(("all_reduce", "forward")) == 4
        assert tp_calls.count((GATHER, "forward")) == 2
        assert len(tp_calls) == 36 - 8
        assert t["all_reduce0"].parent is not None and t["all_reduce0"].parent.startswith("Redistribute")
    # A tp pair computes its replicated activations alike: the all-reduced attention output agrees.
    a0 = [t[t["all_reduce0"].outputs[0]].md5 for t in traces]
    assert a0[0] == a0[1] and a0[2] == a0[3] and a0[0] != a0[2]


def test_tp_fsdp_equal_runs_agree(tp4, capsys) -> None:
    d, _ = tp4
    assert main(["diff", "--ranks", *_paths(d)]) == 0
    assert capsys.readouterr().out.startswith("REPLICAS AGREE: ranks 0, 1, 2, 3,")
    res = dr.diff_ranks(_paths(d))
    assert res.exit_code == 0 and res.departures == [] and res.collectives == {r: 36 for r in range(4)}
    assert res.compared > 200 and res.not_comparable == {}


def test_tp_fsdp_planted_desync_names_rank_parameter_and_first_collective(tp4_perturbed, capsys) -> None:
    d, _ = tp4_perturbed
    assert main(["diff", "--ranks", *_paths(d), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    first = out["first"]
    assert (first["rank"], first["reference"], first["record"], first["what"], first["param"]) == \
        (3, [2], PERTURBED, "parameter", PERTURBED)
    assert first["placement"] == "Shard(0)@dp, Replicate()@tp on mesh dp=2 x tp=2"
    # One ulp of a float32 near 1.0.
    assert first["max_abs"] == pytest.approx(2 ** -23)
    # Rank 3 sent its shard to rank 1 in FSDP2's first all-gather (the root unit's parameters).
    assert (first["carrier"], first["carrier_api"], first["carrier_args"]) == \
        (f"{GATHER}0", "torch.distributed.all_gather_single", "group=[1, 3]")
    assert out["verdict"].startswith(f"RANK 3 DEPARTED first at parameter {PERTURBED}")
    assert f"first carried by {GATHER}0 (group=[1, 3])" in out["verdict"]
    # Rank 1 received it: its all-gathered norm weight (replicated on tp) now differs from rank 0's,
    # and so do the final norm's output on both; after the step only rank 3's parameter differs.
    later = {(x["rank"], x["what"]) for x in out["departures"][1:]}
    assert (1, "replicated value") in later and (3, "replicated value") in later
    assert [x["record"] for x in out["departures"] if x["what"] == "parameter"] == [PERTURBED, f"{PERTURBED}@v1"]
    assert {x["rank"] for x in out["departures"]} == {1, 3}
    # The table form names the same facts.
    assert main(["diff", "--ranks", *_paths(d)]) == 1
    text = capsys.readouterr().out
    assert "first carried by" in text and "Shard(0)@dp, Replicate()@tp on mesh dp=2 x tp=2" in text


# ---- the report of four ranks ----------------------------------------------------------------------------------
def test_four_rank_report_is_one_page_with_a_rank_switcher(tp4, tmp_path, capsys) -> None:
    d, _ = tp4
    out = tmp_path / "ranks.html"
    assert main(["report", *_paths(d), "-o", str(out)]) == 0
    assert "4 ranks" in capsys.readouterr().out
    html = out.read_text(encoding="utf-8")
    assert re.findall(r'<button data-rank="(\d)"', html) == ["0", "1", "2", "3"]
    assert len(re.findall(r'<iframe data-rank="\d"', html)) == 4
    chromium = "/usr/bin/chromium"
    if not (os.path.exists(chromium) or shutil.which("chromium")):
        pytest.skip("needs Debian's chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(out.as_uri())
        assert page.locator("#gt-ranks button").all_text_contents() == [f"rank {r}" for r in range(4)]
        assert page.locator('iframe[data-rank="0"]').is_visible()
        page.click('#gt-ranks button[data-rank="3"]')
        assert page.locator('iframe[data-rank="3"]').is_visible()
        assert not page.locator('iframe[data-rank="0"]').is_visible()
        frame = page.frame_locator('iframe[data-rank="3"]')
        data = frame.locator("#gt-data").text_content() or ""
        assert "all_reduce0" in data and "model.norm.weight" in data
        assert not errors
        browser.close()
