"""CUDA: on-device hashing without per-call syncs, graph capture, SDPA. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracer
from tests.models import MLP
from tests.test_hashing import reference_md5

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_md5_of_cuda_tensors_equals_hashlib_and_no_sync_per_call():
    model = MLP(width=256, depth=4).cuda()
    x = torch.randn(64, 256, device="cuda")
    kept = {}
    with tracer.trace() as t:
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call in the hot path raises
        try:
            h = model(x)
            kept["tanh3:out"] = h
            loss = h.pow(2).mean()
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for name, tensor in kept.items():
        assert t.tensors[name].md5 == reference_md5(tensor)
    assert t.tensors["layers.0.weight@grad"].md5 == reference_md5(model.layers[0].weight.grad)
    assert all(r.md5 for r in t.tensors.values())
    assert t.tensors["input0"].device == "cuda:0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.bool])
def test_cuda_dtypes_and_views(dtype):
    src = torch.randn(33, 65, device="cuda")
    with tracer.trace() as t:
        a = src.to(dtype)
        b = a.t()[3:20:2]  # a non-contiguous view
        c = b.contiguous()
    assert t.tensors[t.calls[0].outputs[0]].md5 == reference_md5(a)
    assert t.tensors[t.calls[-1].outputs[0]].md5 == reference_md5(c) == reference_md5(b)


def test_large_tensor_over_two_to_the_31_bytes():
    n = (1 << 31) + 4099  # more bytes than a 32-bit offset can address
    x = torch.ones(n, dtype=torch.uint8, device="cuda")
    with tracer.trace() as t:
        y = x * 3
    assert t.tensors["mul0:out"].md5 == reference_md5(y)
    del x, y
    torch.cuda.empty_cache()


def test_hashing_skipped_during_cuda_graph_capture():
    x = torch.randn(16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with tracer.trace() as t:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x * 2  # warm-up outside capture, as CUDA graphs require
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = x * 2
    captured = t.tensors[t.calls[-1].outputs[0]]
    assert captured.md5 is None and captured.hash_note == "not hashed: CUDA graph capture in progress"
    assert any("CUDA graph capture" in n for n in t.notes)
    g.replay()
    assert torch.equal(y, x * 2)


def test_sdpa_flash_attention_nodes_attributed():
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with tracer.trace() as t:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().sum().backward()
    (call,) = [c for c in t.calls if c.api.endswith("scaled_dot_product_attention")]
    assert call.grad_nodes and "Attention" in call.grad_nodes[-1]
    assert call.grad_nodes[-1] in t.backward_runs[0].order
    assert t.tensors[call.outputs[0]].md5 == reference_md5(out)


# ---- issue #16 on the GPU: the trace stays true in real recipes ----------------------------------------
@pytest.mark.parametrize("trial", range(3))
def test_md5_is_of_the_bytes_before_later_in_place_writes_on_a_256_mib_tensor(trial):
    from tests.test_recipes import checksums_survive_in_place_writes

    checksums_survive_in_place_writes("cuda", 64 << 20)  # 64 Mi float32: 256 MiB per tensor
    torch.cuda.empty_cache()


def test_md5_is_of_the_bytes_before_a_write_on_another_stream():
    x = torch.randn(64 << 20, device="cuda")
    side = torch.cuda.Stream()
    with tracer.trace() as t:
        y = x * 1.0  # copied for MD5 on the current stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y.relu_()  # a writer on another stream: ordered after the copy by the recorder
        torch.cuda.current_stream().wait_stream(side)
    assert t["mul0:out"].md5 == reference_md5(x * 1.0)
    assert t["mul0:out@v1"].md5 == reference_md5(y)
    del x, y
    torch.cuda.empty_cache()


@pytest.mark.parametrize("hash_kind", ["md5", "fast"])
@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_fused_optimizer_on_cuda_records_parameters_and_state_after_the_step(kind, hash_kind):
    from tests.test_recipes import _md5
    from tracer.record.checksums.fingerprint import fingerprint

    torch.manual_seed(0)
    model = MLP(width=64, depth=3).cuda()
    opt = (torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if kind == "AdamW"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True))
    x = torch.randn(8, 64, device="cuda")
    with tracer.trace(hash=hash_kind) as t:
        model(x).pow(2).mean().backward()
        opt.step()
    step = t[f"{kind}0"]
    for n, p in model.named_parameters():
        assert f"{n}@v1" in step.outputs
        if hash_kind == "md5":
            assert t[f"{n}@v1"].md5 == _md5(p)
        else:
            assert t[f"{n}@v1"].fingerprint == fingerprint(p)


def test_gradient_accumulation_on_cuda_with_batched_checksums():
    from tests.test_recipes import _accumulate, _autograd_node_runs, _recorded_node_runs

    def setup():
        torch.manual_seed(0)
        model = MLP(width=64, depth=3).cuda()
        return model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.randn(8, 64, device="cuda") for _ in range(2)]

    model, opt, batches = setup()
    expected = _autograd_node_runs(lambda: _accumulate(model, opt, batches))
    model, opt, batches = setup()
    with tracer.trace(hash="fast") as t:
        _accumulate(model, opt, batches)
    assert _recorded_node_runs(t) == expected
    for n, _ in model.named_parameters():
        for name in (f"{n}@grad", f"{n}@grad#1", f"{n}@grad@v1"):
            assert t[name].fingerprint and t[name].stats is not None, name
        assert f"{n}@grad@v1" in t["SGD0"].inputs


def test_grad_scaler_fp16_on_cuda_records_the_unscaled_gradients():
    from tests.test_recipes import _md5

    torch.manual_seed(0)
    model = MLP(width=64, depth=3).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    x = torch.randn(8, 64, device="cuda")
    with tracer.trace() as t:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        unscaled = {n: _md5(p.grad) for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        scaler.step(opt)
        scaler.update()
    (unscale,) = [c for c in t.calls if c.api == "torch._amp_foreach_non_finite_check_and_unscale_"]
    names = [n for n, _ in model.named_parameters()]
    assert unscale.outputs[:len(names)] == [f"{n}@grad@v1" for n in names]
    for n in names:
        assert t[f"{n}@grad@v1"].md5 == unscaled[n]
