"""hash="fast": identical bytes agree, every single-bit change and every swap is detected."""

from __future__ import annotations

import itertools

import pytest
import torch

import tracer
from tracer.record.checksums.bytes import as_bytes, host_bytes
from tracer.record.checksums.fingerprint import ALGORITHM, fingerprint, fingerprint_reference


def test_every_single_bit_flip_changes_the_fingerprint():
    x = torch.randn(16)  # 64 bytes, 512 bits
    base = fingerprint(x)
    seen = {base}
    raw = x.view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            y = raw.clone()
            y[byte] ^= 1 << bit
            seen.add(fingerprint(y.view(torch.float32)))
    assert len(seen) == 1 + 512  # all different from the original and from each other


def test_torch_implementation_equals_the_python_definition():
    g = torch.Generator().manual_seed(1)
    cases = [torch.randn(37, generator=g), torch.arange(7, dtype=torch.uint8), torch.tensor([True]),
             torch.randn(5, 6, generator=g).t(), torch.zeros(0), torch.randn(301, generator=g).bfloat16(),
             torch.arange(-5, 5, dtype=torch.int64), torch.randn(3, dtype=torch.complex64, generator=g)]
    for t in cases:
        packed = as_bytes(t)
        assert fingerprint(t) == fingerprint_reference(bytes(host_bytes(packed))), t
    assert fingerprint(torch.zeros(0)) == fingerprint_reference(b"")
    assert len(fingerprint(torch.ones(3))) == 16 and ALGORITHM == "gtfp2-fmix32x2-64"


def test_every_swap_of_two_different_elements_changes_it():
    x = torch.arange(24, dtype=torch.float32)
    base = fingerprint(x)
    for i, j in itertools.combinations(range(24), 2):
        y = x.clone()
        y[i], y[j] = x[j], x[i]
        assert fingerprint(y) != base, (i, j)
    # torch.hash_tensor's XOR reduction maps [5,5,7,7] to 0 and [5,7,5,7] alike; not here.
    assert len({fingerprint(torch.tensor(v, dtype=torch.float32)) for v in
                ([5, 5, 7, 7], [5, 7, 5, 7], [7, 7, 5, 5], [0, 0, 0, 0])}) == 4


def test_same_bytes_same_fingerprint_across_views_and_dtypes():
    x = torch.randn(6, 5)
    assert fingerprint(x.t()) == fingerprint(x.t().contiguous())
    assert fingerprint(torch.zeros(3)) != fingerprint(torch.zeros(4))  # length is part of it
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.bool, torch.int64):
        a = (x > 0) if dtype == torch.bool else x.to(dtype)
        assert fingerprint(a) == fingerprint(a.clone())
    assert fingerprint(torch.tensor(2.5)) == fingerprint(torch.tensor([2.5]))  # bytes only, shape beside


def test_trace_with_fast_hash_records_fingerprints():
    w = torch.randn(8, 8)
    with tracer.trace(hash="fast") as t:
        y = torch.tanh(w @ w)
    rec = t.tensors["tanh0:out"]
    assert rec.md5 is None and rec.fingerprint == fingerprint(y)
    assert t.header["hash"] == "fast" and t.header["fingerprint"] == ALGORITHM


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fingerprint_equals_cpu_and_needs_no_sync_per_call():
    x = torch.randn(1 << 20)
    assert fingerprint(x.cuda()) == fingerprint(x)
    big = torch.randint(0, 255, ((1 << 31) + 12345,), dtype=torch.uint8, device="cuda")
    assert fingerprint(big) == fingerprint(big.cpu())
    del big
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()).cuda()
    with tracer.trace(hash="fast") as t:
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = model(torch.randn(32, 64, device="cuda"))
            out.sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert t.tensors["tanh0:out"].fingerprint == fingerprint(out)
