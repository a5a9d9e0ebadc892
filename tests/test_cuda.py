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
