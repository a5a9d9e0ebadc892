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


# ---- the CPU paths: in-place int32 ops, and many small tensors staged into one pass ----------------
def _reference(t: torch.Tensor) -> str:
    packed = as_bytes(t)  # alive while host_bytes reads it
    return fingerprint_reference(bytes(host_bytes(packed)))


def test_cpu_paths_equal_the_definition_on_every_length_and_dtype():
    """Lengths around the staging block (1024 words) and the direct path's chunk (``HOST_CHUNK``
    words), odd byte counts (the zero-padded last word), and a byte view that starts off a word;
    with the work buffers passed in (dirty from an earlier tensor) and without."""
    from tracer.record.checksums.fingerprint import HOST_CHUNK, lane_sums, lane_sums_host

    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 5, 1023, 1024, 1025, 4097, HOST_CHUNK - 1, HOST_CHUNK, HOST_CHUNK + 3, 2 * HOST_CHUNK + 7):
        for dtype in (torch.float32, torch.uint8, torch.bfloat16, torch.int64, torch.bool):
            t = (torch.randn(n, generator=g) * 1e6).to(dtype)
            want = finish_of(lane_sums(t).tolist(), t) if n > 2000 else _reference(t)
            got = lane_sums_host(t)
            assert finish_of(list(got), t) == want, (n, dtype)
            work = (torch.full((2 * HOST_CHUNK,), -1, dtype=torch.int32), torch.full((2 * HOST_CHUNK,), 7, dtype=torch.int32))
            assert lane_sums_host(t, work) == got, (n, dtype)
    odd = torch.arange(200, dtype=torch.uint8)[3:]
    assert fingerprint(odd) == _reference(odd)
    lone = torch.randn(3, 2, generator=g)[:1, 0]  # one element, stride 2
    assert fingerprint(lone) == _reference(lone)


def finish_of(sums: list[int], t: torch.Tensor) -> str:
    from tracer.record.checksums.fingerprint import finish

    return finish(sums[0], sums[1], t.numel() * t.element_size())


def test_staged_fingerprints_equal_one_at_a_time_and_are_snapshots():
    """Small tensors share passes (several per pass, the pass started when the stage is full),
    large ones go alone; each equals the definition, also when the tensor changes after it was
    added (the staged bytes are a copy)."""
    from tracer.model import TensorRecord
    from tracer.record.checksums.host_batch import BATCH_BLOCKS, BLOCK, HostFingerprints

    g = torch.Generator().manual_seed(4)
    lengths = [1, 17, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, BATCH_BLOCKS * BLOCK // 2 - 3,
               BATCH_BLOCKS * BLOCK // 2 + BLOCK, 5000, 12345] * 3
    tensors = [(torch.randn(n, generator=g) * 100).to(torch.float32 if i % 3 else torch.bfloat16)
               for i, n in enumerate(lengths)]
    wanted = [fingerprint(t) for t in tensors]
    staged = HostFingerprints()
    recs = [TensorRecord(f"t{i}", list(t.shape), "float32", "cpu", "output") for i, t in enumerate(tensors)]
    for rec, t in zip(recs, tensors):
        staged.add(rec, t)
        t.add_(1)  # after it was staged: must not reach the fingerprint
    assert 0 < len(staged.pending()) < len(tensors)  # some passes ran when the stage filled
    staged.flush()
    assert staged.pending() == []
    assert [r.fingerprint for r in recs] == wanted


def test_staged_padding_is_zero_where_an_earlier_pass_left_bytes():
    """The stage is reused from pass to pass: a short tensor's padding words land on bytes an
    earlier, longer tensor left there, and must still count as zeros."""
    from tracer.model import TensorRecord
    from tracer.record.checksums.host_batch import BLOCK, HostFingerprints

    staged = HostFingerprints()
    first = torch.full((3 * BLOCK + 1,), -1, dtype=torch.int32)  # every bit set
    later = [torch.arange(n, dtype=torch.uint8) for n in (1, 5, 4 * BLOCK - 2)]
    recs = [TensorRecord(f"t{i}", [1], "uint8", "cpu", "output") for i in range(1 + len(later))]
    staged.add(recs[0], first)
    staged.flush()
    for rec, t in zip(recs[1:], later):
        staged.add(rec, t)
        staged.flush()  # each at the start of the stage, on first's bytes
    assert [r.fingerprint for r in recs] == [_reference(t) for t in (first, *later)]


@pytest.mark.parametrize("raw", [True, False], ids=["memmove", "torch-ops"])
def test_staged_copies_take_the_bytes_md5_takes_from_any_layout_and_dtype(raw, monkeypatch):
    """The stage copies a tensor in its own dtype and shape: a contiguous one by its bytes
    (memmove from data_ptr), any other by ``copy_``, which reads the strides and applies
    conjugate and negative bits. The bytes are those ``as_bytes`` gives, for views (with a
    storage offset, one element with an odd stride), channels-last, expanded and zero-dim
    tensors, conjugate and negative views, odd-sized narrow dtypes and inference tensors;
    both ways of staging (``RAW_COPY``) give the same fingerprints."""
    from tracer.model import TensorRecord
    from tracer.record.checksums import host_batch
    from tracer.record.checksums.host_batch import HostFingerprints

    monkeypatch.setattr(host_batch, "RAW_COPY", raw)

    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 7, generator=g)
    cases = {
        "transposed": base.t(), "sliced": base[:, 1:5], "every other row": base[::2],
        "zero-dim": torch.tensor(3.5), "expanded": torch.randn(1, 7, generator=g).expand(5, 7),
        "conjugate": torch.randn(4, 3, dtype=torch.cfloat, generator=g).conj(),
        "conjugate transposed": torch.randn(4, 3, dtype=torch.cfloat, generator=g).conj().t(),
        "negative view": torch._neg_view(torch.randn(4, 5, generator=g)),
        "bool": torch.rand(37, generator=g) > 0.5, "float16, odd": torch.randn(13, generator=g).half(),
        "uint8, odd": torch.arange(23, dtype=torch.uint8), "int64": torch.arange(30),
        "complex128": torch.randn(5, dtype=torch.cdouble, generator=g),
        "bfloat16 transposed": torch.randn(8, 9, generator=g).bfloat16().t(),
    }
    cases["storage offset"] = base.view(-1)[5:30]
    cases["one element, stride 2"] = torch.randn(3, 2, generator=g)[:1, 0]
    cases["channels last"] = torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)
    cases["empty"] = torch.empty(0, 4)
    with torch.inference_mode():
        cases["inference"] = torch.randn(33, generator=g)
    if hasattr(torch, "float8_e4m3fn"):
        cases["float8"] = torch.randn(11, generator=g).to(torch.float8_e4m3fn)
    assert cases["negative view"].is_neg() and cases["conjugate"].is_conj()
    assert cases["one element, stride 2"].is_contiguous() and not cases["channels last"].is_contiguous()
    staged = HostFingerprints()
    recs = {k: TensorRecord(k, [1], "float32", "cpu", "output") for k in cases}
    for k, t in cases.items():
        staged.add(recs[k], t)
    staged.flush()
    assert {k: r.fingerprint for k, r in recs.items()} == {k: _reference(t) for k, t in cases.items()}


def test_a_traced_cpu_step_fingerprints_like_the_reference():
    """Through the recorder: outputs, a leaf's gradient and an in-place change after the call
    (the record keeps the value the call made)."""
    x = torch.randn(64, 300, requires_grad=True)
    w = torch.randn(300, 70, requires_grad=True)
    with tracer.trace(hash="fast") as t:
        y = x @ w
        made = y.detach().clone()
        z = y.relu()
        z.sum().backward()
        with torch.no_grad():
            y.mul_(2)  # after y was recorded
    mm = next(c for c in t.calls if c.api.endswith("matmul"))
    assert t[mm.outputs[0]].fingerprint == _reference(made)
    assert t[mm.outputs[0]].fingerprint != _reference(y.detach())
    grads = [r for r in t.tensors.values() if r.role == "grad" and list(r.shape) == [300, 70]]
    assert grads and all(r.fingerprint == _reference(w.grad) for r in grads[-1:])


def test_staging_refuses_a_tensor_whose_storage_was_freed():
    """A view whose storage was resized to 0 under it (FSDP frees unsharded parameters so) is
    refused with a note: reading it, by memmove or torch's copy_, would crash the process. An
    empty tensor, whose storage holds nothing either, is fingerprinted as empty."""
    from tracer.model import TensorRecord
    from tracer.record.checksums.hasher import Hasher

    base = torch.randn(100)
    freed = base.view(10, 10)[2:]
    base.untyped_storage().resize_(0)
    hasher = Hasher("fast", stats=False)
    recs = [TensorRecord(k, [1], "float32", "cpu", "output") for k in ("freed", "empty")]
    hasher.submit(recs[0], freed)
    hasher.submit(recs[1], torch.empty(0, 3))
    hasher.close()
    assert recs[0].fingerprint is None
    assert recs[0].hash_note == "not hashed: its storage does not hold its bytes (freed or shrunk)"
    assert recs[1].fingerprint == fingerprint_reference(b"") and recs[1].hash_note is None
