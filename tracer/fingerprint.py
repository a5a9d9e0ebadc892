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
    """Fingerprints of many small flat uint8 tensors on one device, as int64 [k, 2].

    Each tensor's words keep their own indices, so the result is exactly ``fingerprint_tensor``
    of each. The words are laid out as padded rows (one matrix per size class, see
    ``tracer.hashing.pad_rows``); padded slots are masked to contribute nothing to the sums.
    """
    from tracer.hashing import pad_rows

    dev = byte_tensors[0].device
    words = []
    for b in byte_tensors:
        pad = (-b.numel()) % 4
        padded = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=dev)]) if pad else b
        words.append(padded.view(torch.int32))
    k = len(byte_tensors)
    lanes = torch.zeros(k, 2, dtype=torch.int64, device=dev)
    for which, rows, lengths in pad_rows(words, 0):
        w = rows.to(torch.int64) & _LOW32
        col = torch.arange(rows.shape[1], device=dev, dtype=torch.int64)
        valid = col[None, :] < lengths[:, None]
        key = col * _GOLDEN
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        lane0 = torch.where(valid, _mix(w + key), zero).sum(dim=1)
        lane1 = torch.where(valid, _mix((w ^ _LANE2) + key * 3 + 1), zero).sum(dim=1)
        lanes[torch.tensor(which, device=dev)] = torch.stack([lane0, lane1], dim=1)
    n = torch.tensor([b.numel() for b in byte_tensors], dtype=torch.int64, device=dev)
    length = torch.stack([n, n * 7 + 3], dim=1)
    return _mix(lanes + _mix(length))


def fingerprint_hex(lanes: list[int]) -> str:
    return "".join(f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in lanes)


def fingerprint(t: torch.Tensor) -> str:
    """Synchronous convenience: the fingerprint of one tensor as 32 hex digits."""
    with torch._C.DisableTorchFunction():
        return fingerprint_hex(fingerprint_tensor(t).cpu().tolist())
