"""``hash="fast"``: an order-sensitive 128-bit fingerprint computed on the tensor's own device.

The tensor's bytes (as MD5 sees them: contiguous, own dtype) are read as 32-bit words ``w_i``
(zero-padded; the byte length is mixed in at the end). Each word is combined with its index and
passed through splitmix64's finaliser, a bijection on 64-bit integers; the terms are summed
modulo 2^64. Two lanes with different constants give 128 bits.

Why these properties hold:
- identical bytes give identical fingerprints on any device: only integer adds, multiplies and
  xors wrap modulo 2^64, and a modular sum does not depend on the order of reduction;
- any single-bit change alters exactly one word, so exactly one term, and since the mix is a
  bijection that term (hence the sum) changes: a one-bit change can never go unnoticed;
- a swap of two different words changes two terms that depend on their positions: equal sums
  would need a 64-bit coincidence in both lanes (``torch.hash_tensor``'s XOR loses order and
  cancels equal pairs; this does not).

It runs as a handful of element-wise kernels and one sum per lane, in chunks to bound memory,
and returns a small device tensor: nothing synchronises until the trace fetches all results in
one batch.
"""

from __future__ import annotations

import torch

ALGORITHM = "gtfp1-splitmix64x2-128"
_CHUNK_WORDS = 1 << 24  # 16M words (64 MiB of input) per pass: bounds temporaries to ~0.5 GiB

_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as signed int64
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_LANE2 = 0x2545F4914F6CDD1D
_LOW32 = (1 << 32) - 1
_LOW33 = (1 << 33) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    # splitmix64 finaliser with logical right shifts (arithmetic shift, then mask the sign fill).
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & _LOW33)


def fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """Two int64 lanes on ``t``'s device; ``fingerprint_hex`` turns them into 32 hex digits."""
    from tracer.hashing import as_bytes

    b = as_bytes(t)
    n = b.numel()
    pad = (-n) % 4
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    words = b.view(torch.int32)
    lanes = torch.zeros(2, dtype=torch.int64, device=b.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start:start + _CHUNK_WORDS].to(torch.int64) & _LOW32
        idx = torch.arange(start, start + w.numel(), device=b.device, dtype=torch.int64)
        key = idx * _GOLDEN
        lanes[0] += _mix(w + key).sum()
        lanes[1] += _mix((w ^ _LANE2) + key * 3 + 1).sum()
    # Mix the byte length in, so [x] and [x, 0-padding] differ.
    length = torch.tensor([n, n * 7 + 3], dtype=torch.int64, device=b.device)
    return _mix(lanes + _mix(length))


def fingerprint_batch(byte_tensors: list[torch.Tensor]) -> torch.Tensor:
    """Fingerprints of many small flat uint8 tensors on one device, as int64 [k, 2], in one pass.

    Each tensor's words keep their own indices (0, 1, ... within the tensor), so the result is
    exactly ``fingerprint_tensor`` of each; the per-tensor sums are integer scatter-adds, whose
    modular result does not depend on the order the atomics land in.
    """
    dev = byte_tensors[0].device
    padded = []
    for b in byte_tensors:
        pad = (-b.numel()) % 4
        padded.append(torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=dev)]) if pad else b)
    data = torch.cat(padded) if len(padded) > 1 else padded[0]
    words = data.view(torch.int32).to(torch.int64) & _LOW32
    counts = [p.numel() // 4 for p in padded]
    k = len(byte_tensors)
    counts_t = torch.tensor(counts, device=dev)
    seg = torch.repeat_interleave(torch.arange(k, device=dev), counts_t, output_size=words.numel())
    starts = torch.cumsum(counts_t, 0) - counts_t
    idx = torch.arange(words.numel(), device=dev, dtype=torch.int64) - starts[seg]
    key = idx * _GOLDEN
    lanes = torch.zeros(k, 2, dtype=torch.int64, device=dev)
    lanes[:, 0].index_add_(0, seg, _mix(words + key))
    lanes[:, 1].index_add_(0, seg, _mix((words ^ _LANE2) + key * 3 + 1))
    n = torch.tensor([b.numel() for b in byte_tensors], dtype=torch.int64, device=dev)
    length = torch.stack([n, n * 7 + 3], dim=1)
    return _mix(lanes + _mix(length))


def fingerprint_hex(lanes: list[int]) -> str:
    return "".join(f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in lanes)


def fingerprint(t: torch.Tensor) -> str:
    """Synchronous convenience: the fingerprint of one tensor as 32 hex digits."""
    with torch._C.DisableTorchFunction():
        return fingerprint_hex(fingerprint_tensor(t).cpu().tolist())
