"""``tracer.record.checksums.torch_rows``: a batch's rows from torch ops, what ``Fused`` computes
while its Triton kernels compile. Fingerprints must equal the definition's plain-Python reference
of the same bytes; stats the torch reduction of each tensor alone."""

from __future__ import annotations

import pytest
import torch

from tracer.record.checksums.bytes import as_bytes, host_bytes
from tracer.record.checksums.fingerprint import fingerprint_reference, hex_of
from tracer.record.checksums.stats import reduce_one, stats_input
from tracer.record.checksums.torch_rows import batch_rows

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _cases(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(17, 9, generator=g)
    cases = {
        "float32": x, "bfloat16 odd": x.bfloat16().reshape(-1)[:5],  # 10 bytes: a padded last word
        "bfloat16 at an odd element": x.bfloat16().reshape(-1)[1:40],  # bytes off a 4-byte boundary
        "float16": x.half(), "float64": x.double()[:3], "int64": torch.arange(-9, 40),
        "int32": torch.arange(13, dtype=torch.int32), "int16 odd": torch.arange(-2, 5, dtype=torch.int16),
        "int8": torch.arange(-4, 5, dtype=torch.int8), "uint8 tail 1": torch.arange(9, dtype=torch.uint8),
        "bool": x[0] > 0, "one": torch.tensor(-2.5),
        "nan and inf": torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -4.0]),
        "all nan": torch.full((4,), float("nan")), "large": torch.randn(50_000, generator=g),
    }
    return {name: t.to(device) for name, t in cases.items()}


def _reference(t: torch.Tensor) -> tuple[str, list[float]]:
    packed = as_bytes(t).cpu()
    digest = fingerprint_reference(bytes(host_bytes(packed)))
    values = t.to(torch.uint8) if t.dtype == torch.bool else t
    flat = stats_input(values)
    assert flat is not None
    return digest, reduce_one(flat).tolist()


def _check(name: str, t: torch.Tensor, row_f: list[float], row_i: list[int]) -> None:
    digest, (lo, hi, mean, absmax, nan, inf, n_fin) = _reference(t)
    assert hex_of(row_i[2], row_i[3]) == digest, name
    assert row_i[:2] == [int(nan), int(inf)], name
    if n_fin == 0:
        assert row_f[0] == float("inf"), name  # no finite value: the drain leaves min..absmax empty
        return
    assert (row_f[0], row_f[1], row_f[3]) == (lo, hi, absmax), name
    assert row_f[2] == pytest.approx(mean, rel=1e-12, abs=1e-12), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [5, 64, 1 << 23])
def test_each_tensor_alone_equals_the_definition(device, chunk):
    """Small chunks cut tensors into several pieces (and several chunks): the sums must not care."""
    for name, t in _cases(device).items():
        rows_f, rows_i = batch_rows([t], stats=True, fingerprint=True, chunk=chunk)
        _check(name, t, rows_f[0].tolist(), rows_i[0].tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_of_many_tensors_gives_each_its_own_row(device):
    """One batch of one dtype, as ``Fused`` makes them: 200 tensors of different lengths, two of
    them sharing bytes, split over chunks of 1,000 elements."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(200_000, generator=g).to(device, torch.bfloat16)
    tensors = [base[i * 900:i * 900 + 1 + i * 7] for i in range(199)] + [base[:1]]
    rows_f, rows_i = batch_rows(tensors, stats=True, fingerprint=True, chunk=1000)
    for i, (t, row_f, row_i) in enumerate(zip(tensors, rows_f.tolist(), rows_i.tolist())):
        _check(str(i), t, row_f, row_i)


def test_columns_not_asked_for_are_zero():
    t = torch.randn(10)
    rows_f, rows_i = batch_rows([t], stats=False, fingerprint=True)
    assert rows_f.tolist() == [[0.0] * 4] and rows_i[0, :2].tolist() == [0, 0]
    rows_f, rows_i = batch_rows([t], stats=True, fingerprint=False)
    assert rows_i[0, 2:].tolist() == [0, 0] and rows_f[0, 1].item() == t.max().item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batch_rows_queue_without_a_host_sync():
    """The per-piece metadata goes through pinned memory, ``repeat_interleave`` gets its output
    size: nothing waits for the stream (a pageable copy or a data-dependent size would)."""
    tensors = [torch.randn(1000 + i, device="cuda") for i in range(50)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows_f, rows_i = batch_rows(tensors, stats=True, fingerprint=True, chunk=4096)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, (t, row_f, row_i) in enumerate(zip(tensors, rows_f.tolist(), rows_i.tolist())):
        _check(str(i), t, row_f, row_i)
