"""The batched Triton path for stats and fast fingerprints (tracer.record.checksums.fused).

Without a GPU the kernels run under Triton's CPU interpreter in a subprocess
(tests/fused_interpreted.py); on a GPU they run compiled, against the torch path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracer
from tests.interpreted import run_interpreted
from tracer.record.checksums.fingerprint import fingerprint, hex_of
from tracer.record.checksums.stats import stats_tensor

ROOT = Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted("tests.fused_interpreted")


@needs_triton
def test_kernel_fingerprint_equals_the_python_definition(interpreted):
    kernel = interpreted["kernel"]
    assert len(kernel) == 18
    wrong = {name: (v["fingerprint"], v["reference"]) for name, v in kernel.items()
             if v["fingerprint"] != v["reference"]}
    assert not wrong


@needs_triton
def test_kernel_stats_equal_the_torch_reduction(interpreted):
    for name, v in interpreted["kernel"].items():
        lo, hi, mean, absmax, nan, inf = v["stats"]
        rlo, rhi, rmean, rabsmax, rnan, rinf = v["reference_stats"]
        assert (nan, inf) == (rnan, rinf), name
        if name == "all nan":  # nothing finite: min/max stay at their identities
            assert (lo, hi) == (float("inf"), float("-inf"))
            continue
        assert (lo, hi, absmax) == (rlo, rhi, rabsmax), name
        assert mean == pytest.approx(rmean, rel=1e-5, abs=1e-6), name


@needs_triton
def test_batched_trace_equals_the_immediate_path_despite_in_place_changes(interpreted):
    """Tensors wait in batches; in-place ops, batch norm's running stats, the optimizer's
    foreach updates and a custom backward that scales its gradient in place all come after a
    tensor was recorded. The recorder flushes first, so every checksum is of the recorded bytes."""
    for mode, least in (("step", 80), ("ops", 130)):  # the step as one call / every op inside it
        immediate, batched = interpreted["trace"][mode]["immediate"], interpreted["trace"][mode]["batched"]
        assert set(immediate) == set(batched) and len(immediate) > least, mode
        differ = {name: (immediate[name], batched[name]) for name in immediate if immediate[name] != batched[name]}
        assert not differ, mode
        assert immediate["linear0:out"][0] != immediate["linear0:out@v1"][0]  # add_ made a new version
        assert "Halve0:out@grad" in immediate
        # each step leaves one new version of a parameter (step) or ~5 (the foreach ops)
        assert "norm.weight@v2" in immediate  # the second root module, named by its variable
        assert ("norm.weight@v3" in immediate) == (mode == "ops"), mode
    # The batches are launched only where anything may be written: per iteration the backward,
    # the custom backward and optimizer.step(), each launching the float32 batch and the int64
    # one (BatchNorm's num_batches_tracked), and the custom Function's forward (the float32
    # batch). The in-place ops, whose schemas name what they write, snapshot the waiting tensors
    # they reach instead; out-of-place ops (whose schemas name an unused out=) launch nothing.
    # Before, every one of them launched: 28 and 54. A gradient that goes on to a leaf's
    # accumulator (kept as .grad only when nobody else holds it) or into a slot several edges
    # feed is snapshotted, not held (Graph.let_go_after); launching there instead took 16.
    assert interpreted["trace"]["step"]["launches"] == interpreted["trace"]["ops"]["launches"] == 14


@needs_triton
def test_batched_recipe_reads_grads_and_optimizer_state_before_their_unseen_writes(interpreted):
    """Gradient accumulation into a .grad from before the block (the engine adds in place) and a
    fused AdamW whose state predates the block (written with no op the recorder sees): through
    the batches, every value is the one it had when recorded, as on the immediate path. Both
    were read after the write before (24 records of the second block differed)."""
    recipe = interpreted["trace"]["recipe"]
    immediate, batched = recipe["immediate"], recipe["batched"]
    assert set(immediate) == set(batched) and len(immediate) > 300
    assert {name: (immediate[name], batched[name]) for name in immediate if immediate[name] != batched[name]} == {}
    before = [name for name in immediate if name.startswith("1/") and name.endswith(("@grad@v0", ".exp_avg"))]
    assert len(before) == 12  # six parameters: their .grad and exp_avg from before the block
    assert all(immediate[name][1][:2] == [0.0, 0.0] for name in before if name.endswith("@grad@v0"))  # zeroed


@needs_triton
def test_batched_custom_function_writing_with_no_op_seen_leaves_the_recorded_value(interpreted):
    """A custom Function (as an extension kernel would) scales a recorded value in place with no
    torch call the recorder sees: every waiting value is read before the Function runs, so the
    record before it holds x * 2, as on the immediate path (before, it held x * 6)."""
    unseen = interpreted["trace"]["unseen_write"]
    immediate, batched = unseen["immediate"], unseen["batched"]
    assert "mul0:out" in immediate and set(immediate) == set(batched)
    assert {name: (immediate[name], batched[name]) for name in immediate if immediate[name] != batched[name]} == {}


@needs_triton
def test_batched_inference_mode_evaluation_first_in_the_block(interpreted):
    """An evaluation under torch.inference_mode first in the block, an in-place write there,
    then a training step: through the batches the same fingerprints and stats as on the
    immediate path, and the block ends without error (the batches hold inference tensors, and
    may launch inside the mode)."""
    run = interpreted["trace"]["inference_first"]
    immediate, batched = run["immediate"], run["batched"]
    assert {"linear1:out", "linear1:out@v1", "0.weight@v1"} <= set(immediate) and set(immediate) == set(batched)
    assert immediate["linear1:out"][0] != immediate["linear1:out@v1"][0]  # mul_ made a new version
    assert {name: (immediate[name], batched[name]) for name in immediate if immediate[name] != batched[name]} == {}


@needs_triton
def test_batched_tied_embeddings_with_checkpointing_and_accumulation_equal_the_immediate_path(interpreted):
    """GPT-2 with tied embeddings (the shared weight's gradient summed from two edges before its
    accumulator), gradient checkpointing (forwards run again inside the backward), two
    micro-batches accumulated, clipping and a foreach AdamW: through the batches every value is
    the immediate path's, and every parameter's and gradient's version counter is the untraced
    one. A gradient held past its node's hook is copied into .grad by autograd, not kept, and
    the tied weight's two gradients are summed out of place: other version counters."""
    run = interpreted["trace"]["tied_checkpointed"]
    immediate, batched = run["immediate"], run["batched"]
    assert set(immediate["values"]) == set(batched["values"]) and len(immediate["values"]) > 1000
    assert "transformer.wte.weight@grad@v1" in immediate["values"]  # the second micro-batch added into .grad
    assert "lm_head.weight" not in immediate["values"]  # one parameter, named once
    assert {name: (v, batched["values"][name]) for name, v in immediate["values"].items()
            if batched["values"][name] != v} == {}
    untraced = batched["untraced_versions"]
    assert untraced["transformer.wte.weight"][1] > 0  # kept as .grad, then added into in place
    assert batched["versions"] == untraced and immediate["versions"] == untraced


@needs_triton
@pytest.mark.parametrize("config", ["fast", "numerics"])
def test_a_models_state_is_read_ahead_and_never_snapshotted(interpreted, config):
    """A root module's parameters and buffers are read in one go when it is first called
    (``TensorNames._read_state_ahead``), so a batch norm writing its running statistics in the
    call that first reads them, and the optimizer's step, find none of them waiting: no
    parameter or buffer is snapshotted. What a value's record says is what the immediate path
    says: the head's weight, written with no op seen between its root's first call and its
    first use, is read again at its first use (its version moved); its bias, written through
    ``.data`` there, is recorded before and after."""
    run = interpreted["trace"][f"state_ahead_{config}"]
    immediate, batched = run["immediate"], run["batched"]
    assert set(immediate["values"]) == set(batched["values"]) and len(immediate["values"]) > 100
    differ = {n: (immediate["values"][n], batched["values"][n]) for n in immediate["values"]
              if immediate["values"][n] != batched["values"][n]}
    assert not differ
    assert immediate["snapshotted"] == []  # (the immediate path holds nothing)
    # (Before the state was read ahead, each batch norm's three buffers were snapshotted: 18.)
    assert not {"param", "buffer"} & set(batched["snapshotted"])
    assert "head.bias@v1" in immediate["values"]  # the .data write, a new version of the bias
    if config == "numerics":  # stats alone; the fast path has both
        assert immediate["values"]["head.weight"][0] is None


def test_stats_alone_read_dense_layouts_in_place(interpreted):
    """check_numerics' batches (stats, no fingerprint) hold a transposed, permuted, channels-last
    tensor or a Linear weight's gradient as it is (no packing copy: the stats do not depend on
    the order), a view with the same bytes shares its row, a strided slice is still packed; after
    a write into their base (protect first), every row holds the stats of the bytes as added:
    min, max, largest magnitude and the NaN and Inf counts exact, the mean to float rounding."""
    dense = interpreted["dense"]
    assert dense["held_as_is"] == {"transposed": True, "permuted": False, "slice": False, "channels_last": True,
                                   "weight_grad": True}
    assert dense["rows"] == 4  # permuted shares transposed's row; slice's row holds its packed copy
    assert dense["snapshots_dense"]
    for name, (lo, hi, mean, absmax, nan, inf) in dense["expected"].items():
        got = dense["got"][name]
        assert [got[0], got[1], got[3], got[4], got[5]] == [lo, hi, absmax, nan, inf], name
        assert got[2] == pytest.approx(mean, rel=1e-6, abs=1e-9), name
    assert dense["got"]["transposed"][4] == 1 and dense["got"]["transposed"][5] == 1  # the NaN and Inf of base


def test_kept_list_plans_are_bounded_by_count_and_device_bytes(monkeypatch):
    """The plans read_now keeps across traces hold device buffers: the oldest are dropped past
    LIST_PLANS_KEPT plans or LIST_PLANS_MAX_BYTES bytes, the newest is kept whatever its size."""
    from tracer.record.checksums import fused

    monkeypatch.setattr(fused, "_LIST_PLANS", [])
    key = (40, True, True, False, False)

    def kept_after(sizes: list[int]) -> list[int]:
        fused._LIST_PLANS.clear()
        for size in sizes:
            plan = fused.Plan([], [], [], [], -1, 0)
            plan.device_bytes = size
            fused._LIST_PLANS.insert(0, (key, plan))
            fused._drop_old_plans()
        return [plan.device_bytes for _, plan in fused._LIST_PLANS]

    mib = 1 << 20
    assert (fused.LIST_PLANS_MAX_BYTES, fused.LIST_PLANS_KEPT) == (64 << 20, 16)
    assert kept_after([k * mib for k in range(1, 21)]) == [20 * mib, 19 * mib, 18 * mib]  # 57 MiB; 74 > 64
    assert kept_after([1024 + k for k in range(20)]) == [1024 + k for k in range(19, 3, -1)]  # the newest 16
    assert kept_after([mib, 100 * mib]) == [100 * mib]  # alone past the bound: kept, the older dropped


def test_long_lists_are_read_through_one_plan_equal_to_the_immediate_path(interpreted):
    """Hasher.submit_many of a long list (an optimizer step's: three dtypes, a NaN, two views of
    bytes already listed) is read through one plan (Fused.read_now), with every record's
    fingerprint and stats the immediate path's. The plan is kept across hashers (a trace per
    step): a list of new tensors of the same dtypes and sizes follows it (addresses moved), the
    first list after in-place writes follows it too and reads the new bytes; a list no plan
    can read (a transposed tensor) is added one by one, equal as well. The same list read
    twice in one hasher, written between, keeps each reading's values (a plan's results are
    copied out behind its launch: its next launch overwrites them)."""
    lists = interpreted["lists"]
    assert lists["read"] == [True, True, True, False, True, True]
    first_plan = lists["plans"][0]
    assert len(first_plan) == 1 and lists["plans"][:4] == [first_plan] * 4  # one plan, followed twice
    # copies of the views no longer share bytes with what they viewed: a plan of their own
    assert len(lists["plans"][4]) == 2 and lists["plans"][4][1] == first_plan[0]
    for label in ("first", "moved", "written", "transposed", "twice"):
        immediate, batched = lists["immediate"][label], lists["batched"][label]
        assert len(batched) >= 38 and all(fp is not None and stats is not None for fp, stats in batched), label
        assert batched == immediate, label
    first, written, twice = lists["batched"]["first"], lists["batched"]["written"], lists["batched"]["twice"]
    assert first[3][1][2] == 1  # the NaN counted
    assert first[36] == first[0] and first[37] == first[25]  # a view reads as the tensor it views
    assert all(w != f for w, f in zip(written[:36], first[:36]))  # the written bytes, not the old ones
    assert len(twice) == 76 and all(a != b for a, b in zip(twice[:36], twice[38:74]))  # each reading its own


@needs_triton
def test_batched_ddp_step_reads_each_grad_before_ddp_writes_the_average_into_it(interpreted):
    """DDP copies the averaged gradients back into each .grad in a final callback of the
    backward, with no op the recorder sees: the batches are read in a final callback queued
    ahead of it, so each rank's gradient records hold its own gradients, as on the immediate
    path (before, three of them held the average). Likewise a value an in-place collective
    writes into."""
    immediate, batched = interpreted["ddp"]["immediate"], interpreted["ddp"]["batched"]
    assert set(immediate) == set(batched) and "module.0.weight@grad@v1" in immediate
    # all_reduce wrote mul0:out in place: its first value is rank 0's own (x * 1), not the sum
    assert immediate["mul0:out"] == immediate["input0"] and immediate["mul0:out@v1"] != immediate["mul0:out"]
    assert {name: (immediate[name], batched[name]) for name in immediate if immediate[name] != batched[name]} == {}


@needs_triton
def test_a_write_snapshots_only_the_waiting_tensors_it_reaches(interpreted):
    result = interpreted["protect"]
    # nothing launched by a write elsewhere, nor by one through a view (a snapshot); the flush: 2
    assert result["launches"] == [0, 0, 2]
    recorded, reference, now = result["a"]
    assert recorded == reference != now  # the bytes recorded, not the ones written afterwards
    assert result["c"][0] == result["c"][1]  # not reached: read when the batch ran
    # a tensor autograd takes next: a copy held instead of it, until the copies' bound; then a launch
    release = result["release"]
    before, held, released = release["refcounts"]
    assert held == before + 1 and released == before
    assert release["launches"] == [0, 2]
    # a gradient a leaf's accumulator takes: an alias of its storage held, no copy, no launch;
    # a write protected later copies what is still waiting, and the records hold the bytes added
    alias = result["alias"]
    before, held, aliased = alias["refcounts"]
    assert held == before + 1 and aliased == before  # the batch held grad itself; now an alias
    # no copy for the alias; the later write copies grad's and base_view's entries (the
    # transposed view was packed when added: a copy already, elsewhere); one flush
    assert alias["snapshots"] == [0, 2] and alias["launches"] == 2
    assert alias["recorded"] == alias["expected"]


@needs_triton
def test_a_freed_storage_is_read_before_its_memory_goes(interpreted):
    """FSDP's resize_(0) of a storage that holds a value waiting in a batch: the record holds
    the value's bytes, not what the next allocation wrote there; the wrapper is gone after."""
    result = interpreted["free"]
    assert result["recorded"] == result["expected"]
    assert result["wrapped_after"] is False


@needs_triton
@pytest.mark.parametrize("hash", ["fast", "md5"])
def test_batched_step_leaves_every_version_counter_as_untraced(interpreted, hash):
    """The batches hold their tensors until launched; held past a grad node's hook, they made
    autograd copy each gradient into .grad instead of keeping it, and sum a shared head's
    gradients out of place: .grad came out with other version counters (and more memory).
    Snapshotted at the end of each hook (Hasher.let_go), every version counter is the untraced one."""
    untraced, traced = interpreted["versions"]["untraced"], interpreted["versions"][hash]
    assert untraced["head.weight.grad"] == 3 and set(traced) == set(untraced)
    assert {name: (v, traced[name]) for name, v in untraced.items() if traced[name] != v} == {}
    # A slot inside the graph that two edges feed: summed in place, handed on unchanged into .grad.
    # Held by a batch, the first gradient was summed out of place (version 0); snapshotted, the
    # record still holds the sum's bytes (the gradient the leaf got).
    slot = interpreted["versions"]["slot_sum"]
    assert slot["untraced"]["p.grad"] == slot[hash]["p.grad"] == 1
    assert slot["untraced"]["w.grad"] == slot[hash]["w.grad"] == 0
    fingerprint, md5, _ = slot[hash]["expected"]
    assert (slot[hash]["fingerprint"] if hash == "fast" else slot[hash]["md5"]) == (fingerprint if hash == "fast" else md5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", ["fast", "check_numerics"])
def test_cuda_gradients_autograd_takes_next_are_copied_out_not_launched(config):
    """A gradient that goes on to a leaf's accumulator, or into a slot several edges feed, is
    copied out of the waiting batch (Graph.let_go_after, Fused.release): autograd keeps or sums
    it in place as untraced (every version counter the same), the record holds its bytes, no
    synchronisation, and the batches launch a few times a step, not at every such node."""
    from tests.fused_interpreted import counting_launches, slot_sum_versions
    from tests.version_recipes import versions_after
    from tracer.record.checksums.launcher import WARMUP

    def traced() -> contextlib.AbstractContextManager:
        return tracer.trace(hash="fast") if config == "fast" else tracer.check_numerics()

    # The detection-style step (a head shared by three levels, GradScaler, clipping, AdamW).
    untraced = versions_after(None, 8, "cuda")
    assert untraced["head.weight.grad"] == 3
    assert versions_after(traced, 8, "cuda") == untraced
    # A slot two edges feed inside the graph, summed in place and handed on into .grad.
    slot = slot_sum_versions(traced, "cuda")
    assert slot_sum_versions(None, "cuda")["p.grad"] == slot["p.grad"] == 1
    expected_fingerprint, _, expected_max = slot["expected"]
    if config == "fast":
        assert slot["fingerprint"] == expected_fingerprint
    else:
        assert slot["max"] == expected_max

    # A step of eight Linear layers: every one's bias gradient goes to an accumulator straight
    # from its AddmmBackward node (before: one launch each).
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8))).cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(32, 64, device="cuda")
    WARMUP.wait_all()  # the kernels compiled (while they compile, values take the torch path)
    with counting_launches() as launches, traced() as t:
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).pow(2).mean().backward()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert 0 < launches[0] <= 6, launches[0]
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad._version == 0
        record = t.tensors[f"{name}@grad"]
        if config == "fast":
            assert record.fingerprint == fingerprint(param.grad), name
        else:
            assert record.stats is not None and record.stats.max == param.grad.max().item(), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_long_lists_are_read_through_one_plan_without_a_sync():
    """On CUDA, Hasher.submit_many of a long list goes through one plan (Fused.read_now) with no
    synchronisation; each record's fingerprint and stats are the tensor's. A second hasher (the
    next trace) follows the kept plan for new tensors of the same dtypes and sizes."""
    from tests.fused_interpreted import list_tensors
    from tracer.model import TensorRecord
    from tracer.record.checksums import fused
    from tracer.record.checksums.hasher import Hasher

    fused._LIST_PLANS.clear()
    plans = []
    for seed in (8, 9):
        tensors = list_tensors(seed, "cuda")
        hasher = Hasher(algorithm="fast", stats=True)
        recs = [TensorRecord(name=f"t{i}", shape=tuple(t.shape), dtype=str(t.dtype), device="cuda:0", role="state",
                             producer=None) for i, t in enumerate(tensors)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hasher.submit_many(list(zip(recs, tensors)))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        plans.append([id(plan) for _, plan in fused._LIST_PLANS])
        # its end is one of the reads a writer on another stream waits for (_order_after_reads)
        assert (tensors[0].device, torch.cuda.current_stream().cuda_stream) in hasher._fused.events
        hasher.drain(wait=True)
        for rec, t in zip(recs, tensors):
            assert rec.fingerprint == fingerprint(t), rec.name
            assert rec.stats is not None
            finite = t[torch.isfinite(t)].double() if t.is_floating_point() else t.double()
            assert (rec.stats.min, rec.stats.max) == (finite.min().item(), finite.max().item()), rec.name
            assert rec.stats.nan == (int(torch.isnan(t).sum()) if t.is_floating_point() else 0), rec.name
    assert len(plans[0]) == 1 and plans[1] == plans[0]  # the second list followed the first's plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.int32, torch.uint8, torch.bool, torch.complex64])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("with_fingerprint", [True, False])
def test_cuda_batches_equal_the_torch_path(dtype, with_fingerprint):
    """Every layout through the batches gives the torch path's stats (and fingerprint). Stats
    alone (check_numerics) read the transposed and channels-last cases where they lie."""
    from tracer.model import TensorRecord
    from tracer.record.checksums.fused import Fused

    src = torch.randn(257, 129, device="cuda")
    src[3, 5] = float("nan")
    base = (src > 0) if dtype == torch.bool else src.to(dtype)
    images = torch.randn(4, 6, 9, 7, device="cuda").to(dtype).to(memory_format=torch.channels_last)
    cases = [base, base.t(), base[1:, ::2], base.reshape(-1)[3:1000], base[0], base.reshape(-1)[:3], images]
    batcher = Fused(stats=True, fingerprint=with_fingerprint)
    recs = [TensorRecord(name=str(i), shape=(), dtype="", device="cuda:0", role="output", producer=None)
            for i in range(len(cases))]
    for rec, t in zip(recs, cases):
        assert batcher.add(rec, t)
    held = [h for batch in batcher._batches.values() for h in batch.held]
    # read in place (a complex tensor: as its real view), or a packed copy
    assert any(h.data_ptr() == images.data_ptr() for h in held) is (not with_fingerprint)
    rows = _rows(batcher)
    for i, t in enumerate(cases):
        frow, irow = rows[str(i)]
        if with_fingerprint:
            assert hex_of(irow[2], irow[3]) == fingerprint(t), (dtype, i)
        ref = stats_tensor(t).tolist()
        assert irow[:2] == [int(ref[4]), int(ref[5])]
        if ref[6]:
            assert frow[0] == ref[0] and frow[1] == ref[1] and frow[3] == ref[3]
            assert frow[2] == pytest.approx(ref[2], rel=1e-4, abs=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_over_two_to_the_31_elements():
    """Offsets past 2^31 (the 32-bit index bug class): one tensor of 2^31 + 7 bytes, its last
    byte set; the batched kernel agrees with the torch path, and that last byte counts."""
    from tracer.model import TensorRecord
    from tracer.record.checksums.fused import Fused

    n = (1 << 31) + 7
    x = torch.zeros(n, dtype=torch.uint8, device="cuda")
    x[-1] = 9
    batcher = Fused(stats=True, fingerprint=True)
    rec = TensorRecord(name="big", shape=(n,), dtype="uint8", device="cuda:0", role="output", producer=None)
    assert batcher.add(rec, x)
    batcher.flush()
    [(_, [frow], [irow])] = batcher.take(wait=True)
    assert hex_of(irow[2], irow[3]) == fingerprint(x)
    assert frow[1] == 9.0 and frow[2] == pytest.approx(9 / n)
    x[-1] = 0
    assert fingerprint(x) != hex_of(irow[2], irow[3])
    del x
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trace_uses_batches_without_a_sync_and_matches_after_in_place_changes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(32, 64, device="cuda")
    w0 = model[0].weight.detach().clone()
    with tracer.trace(hash="fast") as t:
        torch.cuda.set_sync_debug_mode("error")
        try:
            h = model(x)
            h.mul_(2.0)
            h.sum().backward()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert t.tensors["linear1:out@v1"].fingerprint == fingerprint(h)
    assert t.tensors["linear1:out"].fingerprint == fingerprint(h / 2.0)
    # recorded before the optimizer changed it in place, and read before that change too
    assert t.tensors["0.weight"].fingerprint == fingerprint(w0) != fingerprint(model[0].weight)
    assert all(r.stats is not None for r in t.tensors.values() if r.numel)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", ["fast", "check_numerics"])
def test_cuda_model_state_read_ahead_equals_its_values_without_a_sync(config):
    """On the GPU a root module's parameters and buffers are read through one plan when it is
    first called: no sync, none of them snapshotted when a batch norm or the optimizer writes
    them, and each record's fingerprint and stats are those of the bytes before the writes."""
    import torch.nn.functional as F

    from tests.fused_interpreted import BatchNormNet
    from tracer.record.checksums import fused

    torch.manual_seed(0)
    model = BatchNormNet().cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x, y = torch.randn(4, 3, 8, 8, device="cuda"), torch.randint(0, 4, (4,), device="cuda")
    before = {name: v.detach().clone() for name, v in [*model.named_parameters(), *model.named_buffers()]}
    snapshotted: list[str] = []
    kept, snapshot = fused.Fused.__dict__["_snapshot"], fused.Fused._snapshot

    def counted(batch, slot):
        snapshotted.extend(rec.role for rec in batch.slots[slot])
        snapshot(batch, slot)

    fused.Fused._snapshot = staticmethod(counted)
    try:
        with (tracer.trace(hash="fast") if config == "fast" else tracer.check_numerics()) as t:
            torch.cuda.set_sync_debug_mode("error")
            try:
                F.cross_entropy(model(x), y).backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        fused.Fused._snapshot = kept
    assert not {"param", "buffer"} & set(snapshotted)
    before["head.weight"] *= 0.5  # (the forward halves it, unseen, before its first use)
    for name, value in before.items():
        rec = t.tensors[name]
        assert rec.stats is not None and (rec.stats.min, rec.stats.max) == (value.min().item(), value.max().item()), name
        if config == "fast":
            assert rec.fingerprint == fingerprint(value), name
    assert t.tensors["blocks.0.1.running_mean@v1"].stats.max == model.blocks[0][1].running_mean.max().item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_writes_through_a_view_and_on_another_stream_leave_the_recorded_bytes():
    """A write through a view snapshots the waiting tensor it reaches (same stream); a write on
    another stream launches the batch first. Neither synchronises, and every checksum is of
    the bytes each version had."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, device="cuda")
    side = torch.cuda.Stream()
    with tracer.trace(hash="fast") as t:
        torch.cuda.set_sync_debug_mode("error")
        try:
            h = x * 2
            h.view(-1)[:10].mul_(3)
            g = x + 1
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                g.mul_(2)
            torch.cuda.current_stream().wait_stream(side)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert t.tensors["mul0:out"].fingerprint == fingerprint(x * 2)
    assert t.tensors["mul0:out@v1"].fingerprint == fingerprint(h)
    assert t.tensors["getitem0:out@v1"].fingerprint == fingerprint(h.view(-1)[:10])
    assert t.tensors["add0:out"].fingerprint == fingerprint(x + 1)
    assert t.tensors["add0:out@v1"].fingerprint == fingerprint(g) == fingerprint((x + 1) * 2)


def _rows(batcher) -> dict[str, tuple[list[float], list[int]]]:
    """Each record's float and int rows, by name, once what waits is launched (a flush with
    nothing waiting launches nothing: the callers that flushed on a stream of their own keep it)."""
    from tests.fused_interpreted import flushed_rows

    return flushed_rows(batcher)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cached_launcher_gives_the_same_results_as_the_normal_launch():
    """The first batch of a specialisation launches through Triton's JIT; later ones through the
    compiled kernel's launcher (launcher.FastLaunch), with the same fingerprints and stats."""
    import time

    from tracer.model import TensorRecord
    from tracer.record.checksums.fused import Fused
    from tracer.record.checksums.launcher import WARMUP

    key = (torch.cuda.current_device(), torch.bfloat16, True, True)
    deadline = time.monotonic() + 300
    while WARMUP.wanted(key) and not WARMUP.ready(key):  # a trace earlier in this process started it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    warmed = WARMUP.result(key) is not None
    batcher = Fused(stats=True, fingerprint=True)
    names = []
    for round_ in range(3):
        for i, shape in enumerate([(1000,), (33, 17), (4096, 8)]):
            t = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            t.view(-1)[i] = float("inf")
            name = f"{round_}.{i}"
            names.append((name, t))
            rec = TensorRecord(name=name, shape=(), dtype="", device="cuda:0", role="output", producer=None)
            assert batcher.add(rec, t)
        batcher.flush()
    rows = _rows(batcher)
    # without a warm-up, the first round compiled them; the sizes (3) are of one class
    assert batcher.launches == 6 and batcher.fast_launches == (6 if warmed else 4)
    for name, t in names:
        frow, irow = rows[name]
        assert hex_of(irow[2], irow[3]) == fingerprint(t), name
        ref = stats_tensor(t).tolist()
        assert irow[:2] == [int(ref[4]), int(ref[5])] == [0, 1]
        assert frow[0] == ref[0] and frow[1] == ref[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_metadata_goes_through_reused_pinned_slots_and_a_side_stream_batch_is_ordered():
    """Batches' metadata is copied out of a ring of pinned slots (reused once a batch's kernels
    are done, skipped while busy): forty batches, more than the ring holds, each on the stream
    its tensors were made on (every fourth on a side stream, launched from the main one), all
    with the fingerprints and stats of their own tensors."""
    from tracer.model import TensorRecord
    from tracer.record.checksums.fused import Fused, _PinnedSlots

    batcher = Fused(stats=True, fingerprint=True)
    side = torch.cuda.Stream()
    names = []
    for round_ in range(40):
        on_side = round_ % 4 == 3
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if on_side else contextlib.nullcontext():
            t = torch.randn(257 + round_, device="cuda") * (round_ + 1)
            rec = TensorRecord(name=str(round_), shape=(), dtype="", device="cuda:0", role="output",
                               producer=None)
            assert batcher.add(rec, t)
        names.append((str(round_), t))
        batcher.flush()  # from the main stream
    torch.cuda.current_stream().wait_stream(side)
    rows = _rows(batcher)
    assert len(batcher._pinned._buffers) == _PinnedSlots.SLOTS < 40
    for name, t in names:
        frow, irow = rows[name]
        assert hex_of(irow[2], irow[3]) == fingerprint(t), name
        ref = stats_tensor(t).tolist()
        assert frow[0] == ref[0] and frow[1] == ref[1], name


_EXIT_DURING_WARM_UP = """
import pathlib, sys, time
import torch
torch.cuda.set_device = lambda index: None  # no GPU here: the jobs below stand in for compilations
from tracer.record.checksums.launcher import WARMUP
out = pathlib.Path(sys.argv[1])

def running():
    time.sleep(1.0)
    (out / "running").write_text("finished")

def queued():
    (out / "queued").write_text("started")

WARMUP.start(0, [("running", running), ("queued", queued)])
time.sleep(0.2)  # the first job is running; the script ends now
"""


def test_exit_waits_for_the_running_warm_up_job_and_skips_the_rest(tmp_path):
    """A script that ends while the kernels compile in the background: the interpreter would kill
    the daemon thread inside Triton's C++ code and the process abort ("FATAL: exception not
    rethrown", status 134). At exit the warm-up now lets the running compilation finish and
    starts no other."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_DURING_WARM_UP, str(tmp_path)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "running").read_text() == "finished"
    assert not (tmp_path / "queued").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_warm_up_compiles_in_the_background_and_the_first_batch_uses_it():
    from tracer.model import TensorRecord
    from tracer.record.checksums.fused import Fused, warm_up
    from tracer.record.checksums.launcher import WARMUP

    torch.cuda.init()
    warm_up(torch.cuda.current_device(), True, True)
    key = (torch.cuda.current_device(), torch.float16, True, True)
    assert WARMUP.wanted(key)
    batcher = Fused(stats=True, fingerprint=True)
    t = torch.randn(300, device="cuda", dtype=torch.float16)
    rec = TensorRecord(name="x", shape=(), dtype="", device="cuda:0", role="output", producer=None)
    import time

    deadline = time.monotonic() + 300
    while not WARMUP.ready(key):
        assert not batcher.add(rec, t)  # still compiling: the caller's torch path takes it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert WARMUP.result(key) is not None
    assert batcher.add(rec, t)
    batcher.flush()
    assert batcher.fast_launches == 2  # both kernels of the very first batch: the warmed ones
    frow, irow = _rows(batcher)["x"]
    assert hex_of(irow[2], irow[3]) == fingerprint(t)
    assert frow[1] == t.float().max().item()
    # the warmed kernels take any batch size (1, 16 and 17 are three specialisation classes)
    tensors = [torch.randn(100 + i, device="cuda", dtype=torch.float16) for i in range(34)]
    for n in (1, 16, 17):
        for i, x in enumerate(tensors[:n]):
            assert batcher.add(TensorRecord(name=f"{n}.{i}", shape=(), dtype="", device="cuda:0", role="output",
                                            producer=None), x)
        batcher.flush()
    rows = _rows(batcher)
    assert batcher.fast_launches == 8
    for n in (1, 16, 17):
        for i, x in enumerate(tensors[:n]):
            frow, irow = rows[f"{n}.{i}"]
            assert hex_of(irow[2], irow[3]) == fingerprint(x), (n, i)
            assert frow[0] == x.float().min().item() and frow[1] == x.float().max().item()
