"""``hash="fast"``: an order-sensitive 64-bit fingerprint computed on the tensor's own device.

Algorithm ``gtfp2-fmix32x2-64``. The tensor's bytes (as MD5 sees them: contiguous, own dtype)
are read as little-endian 32-bit words ``w_i`` (zero-padded; the byte length is mixed in at the
end). In each of two lanes, a word is xor-ed with a key derived from its index ``i`` and passed
through a 32-bit finaliser (MurmurHash3's ``fmix32`` in lane A, the "lowbias32" constants in
lane B), a bijection on 32-bit integers; the terms are summed modulo 2^32.

Why these properties hold:
- identical bytes give identical fingerprints on any device: only integer adds, multiplies,
  shifts and xors, all modulo 2^32, and a modular sum does not depend on the reduction order;
- any single-bit change alters exactly one word, so exactly one term per lane, and since
  ``w -> fmix(w ^ key)`` is a bijection that term (hence the sum) changes: a one-bit change can
  never go unnoticed;
- a swap of two different words changes terms that depend on their positions: equal sums need
  a coincidence in both lanes (``torch.hash_tensor``'s XOR loses order and cancels equal
  pairs; this does not).

Why 32-bit lanes: the GPU kernel (``tracer.record.checksums.fused``) reads every byte a training step makes
(tens of GB for GPT-2 small), so the mix must cost fewer integer instructions per word than
the memory system takes to deliver it; 64-bit multiplies are emulated on GPUs and cost 4x.

This module is the definition: ``fingerprint_reference`` in plain Python (slow, obviously
right), ``lane_sums_host`` in in-place int32 torch ops (the CPU path), ``fingerprint_tensor`` in
int64 torch ops (any device, the fallback where Triton is missing), and the Triton kernel in
``tracer.record.checksums.fused`` must agree with all of them bit for bit.
"""

from __future__ import annotations

import functools

import torch

from tracer.record.checksums.bytes import as_bytes
from tracer.record.own_work import HOST

ALGORITHM = "gtfp2-fmix32x2-64"
MASK32 = 0xFFFFFFFF
# Index keys: key(i) = i_lo * MUL + i_hi * MUL_HI + ADD (mod 2^32), i_lo/i_hi the halves of i.
KEY_A = (0x9E3779B1, 0x7FEB352D, 0x243F6A88)
KEY_B = (0x85EBCA77, 0x68E31DA4, 0xB7E15162)
# Finaliser constants (xorshift, multiply, xorshift, multiply, xorshift).
FMIX_A = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)
FMIX_B = (16, 0x7FEB352D, 15, 0x846CA68B, 16)
LENGTH_SALT = (0x5851F42D, 0x4C957F2D)
_CHUNK_WORDS = 1 << 24  # 16M words (64 MiB of input) per pass: bounds the int64 temporaries


def _fmix_int(h: int, c: tuple[int, int, int, int, int]) -> int:
    h ^= h >> c[0]
    h = (h * c[1]) & MASK32
    h ^= h >> c[2]
    h = (h * c[3]) & MASK32
    return h ^ (h >> c[4])


def _key_int(i: int, k: tuple[int, int, int]) -> int:
    return ((i & MASK32) * k[0] + (i >> 32) * k[1] + k[2]) & MASK32


def finish(acc_a: int, acc_b: int, nbytes: int) -> str:
    """The fingerprint from the two lane sums and the byte length (mixed in so that ``[x]``
    and ``[x, 0-padding]`` differ)."""
    lo, hi = nbytes & MASK32, nbytes >> 32
    a = _fmix_int((acc_a + _fmix_int(lo ^ LENGTH_SALT[0] ^ _fmix_int(hi, FMIX_A), FMIX_A)) & MASK32, FMIX_A)
    b = _fmix_int((acc_b + _fmix_int(lo ^ LENGTH_SALT[1] ^ _fmix_int(hi, FMIX_B), FMIX_B)) & MASK32, FMIX_B)
    return hex_of(a, b)


def hex_of(lane_a: int, lane_b: int) -> str:
    """The 16 hex digits of two finished lanes (the kernel's rows hold them as int64)."""
    return f"{lane_a & MASK32:08x}{lane_b & MASK32:08x}"


def fingerprint_reference(data: bytes) -> str:
    """The definition, in plain Python: for tests on small inputs."""
    padded = data + b"\0" * (-len(data) % 4)
    acc_a = acc_b = 0
    for i in range(len(padded) // 4):
        w = int.from_bytes(padded[4 * i:4 * i + 4], "little")
        acc_a += _fmix_int(w ^ _key_int(i, KEY_A), FMIX_A)
        acc_b += _fmix_int(w ^ _key_int(i, KEY_B), FMIX_B)
    return finish(acc_a & MASK32, acc_b & MASK32, len(data))


def _fmix(x: torch.Tensor, c: tuple[int, int, int, int, int]) -> torch.Tensor:
    # x holds 32-bit values in int64: shifts are then logical, and products are reduced mod 2^32
    # (an int64 product of two 32-bit values may wrap mod 2^64, which keeps the low 32 bits).
    x = x ^ (x >> c[0])
    x = (x * c[1]) & MASK32
    x = x ^ (x >> c[2])
    x = (x * c[3]) & MASK32
    return x ^ (x >> c[4])


def lane_sums(t: torch.Tensor) -> torch.Tensor:
    """The two lane sums (int64 [2], each < 2^32) of ``t``'s bytes, on its device, no sync."""
    b = as_bytes(t)
    n = b.numel()
    pad = (-n) % 4
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    words = b.view(torch.int32)
    sums = torch.zeros(2, dtype=torch.int64, device=b.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start:start + _CHUNK_WORDS].to(torch.int64) & MASK32
        idx = torch.arange(start, start + w.numel(), device=b.device, dtype=torch.int64)
        lo, hi = idx & MASK32, idx >> 32
        key_a = (lo * KEY_A[0] + hi * KEY_A[1] + KEY_A[2]) & MASK32
        key_b = (lo * KEY_B[0] + hi * KEY_B[1] + KEY_B[2]) & MASK32
        sums[0] += _fmix(w ^ key_a, FMIX_A).sum()
        sums[1] += _fmix(w ^ key_b, FMIX_B).sum()
    return sums & MASK32


# ---- the CPU path: in-place int32 ops over cache-sized chunks, both lanes per op -----------------------
# Why int32: an int32 multiply wraps modulo 2^32 (what the definition asks), and
# ``sum(dtype=torch.int32)`` wraps too and runs at memory speed, where the int64 path above
# makes ~20 fresh int64 temporaries per pass (page faults: ~0.02 GB/s on a 2-core host against
# ~1.4 GB/s here). Shifts on int32 are arithmetic, so a logical shift by s is the arithmetic one
# masked with 2^(32-s) - 1. Chunks are a power of two and start at multiples of their size, so
# within a chunk key(start + o) = key(start) + o * K0 (mod 2^32): one table of o * K0 serves all.
# Larger chunks mean fewer ops per byte: a 48 MiB tensor ran at 1.3 GB/s in 64k-word chunks
# (which fit L2), 1.8 GB/s in 256k-word ones (2-core host; the ops cost microseconds each before
# they read anything, and L3 feeds them fast enough).
HOST_CHUNK = 1 << 18  # words per pass (1 MiB per lane)


def s32(x: int) -> int:
    """The int32 bit pattern of a 32-bit unsigned value."""
    x &= MASK32
    return x - (1 << 32) if x >= 1 << 31 else x


@functools.cache
def _fmix_constants() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The finalisers' shifts, shift masks and multipliers as [2, 1] int32 columns (lane A row
    0, lane B row 1)."""
    def column(a: int, b: int) -> torch.Tensor:
        return torch.tensor([[s32(a)], [s32(b)]], dtype=torch.int32, device=HOST)

    with torch.inference_mode(False):  # cached for the process: a normal tensor whatever the mode now
        shifts = [column(FMIX_A[j], FMIX_B[j]) for j in (0, 2, 4)]
        masks = [column((1 << (32 - FMIX_A[j])) - 1, (1 << (32 - FMIX_B[j])) - 1) for j in (0, 2, 4)]
        mults = [column(FMIX_A[j], FMIX_B[j]) for j in (1, 3)]
    return shifts, masks, mults


@functools.cache
def _chunk_offsets() -> torch.Tensor:
    """[2, HOST_CHUNK] int32: o * K0 of each lane for o < HOST_CHUNK. Built the first time a
    tensor too large to stage is fingerprinted (a step without one never pays for it): int32
    products wrap modulo 2^32, which is the definition, in one op per lane (int64 products
    masked and narrowed took 4x longer, ~20 ms on a 2-core host)."""
    with torch.inference_mode(False):
        o = torch.arange(HOST_CHUNK, dtype=torch.int32, device=HOST)
        return torch.stack([o * s32(KEY_A[0]), o * s32(KEY_B[0])])


def fmix_lanes_(h: torch.Tensor, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """Both lanes' finalisers in place on a [2, ...] int32 block (lane A first, lane B second)."""
    shifts, masks, mults = _fmix_constants()
    if h.dim() != 2:  # as [2, n]: the [2, 1] constant columns broadcast fastest over one dimension
        _ = fmix_lanes_(h.view(2, -1), None if tmp is None else tmp.view(2, -1))
        return h
    tt = torch.empty_like(h) if tmp is None else tmp
    for j in range(3):  # h ^= h >> s; h *= m; h ^= h >> s; h *= m; h ^= h >> s
        torch.bitwise_right_shift(h, shifts[j], out=tt)
        tt.bitwise_and_(masks[j])
        h.bitwise_xor_(tt)
        if j < 2:
            h.mul_(mults[j])
    return h


def lane_sums_host(t: torch.Tensor, work: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[int, int]:
    """The two lane sums of a CPU tensor's bytes (``b`` as ``as_bytes`` gives them), now.

    About 15 in-place int32 ops per chunk of ``HOST_CHUNK`` words, both lanes at once ([2, chunk]
    blocks); the last partial word is mixed in Python. ``work``: two flat int32 buffers to work
    in (each at least 2 * HOST_CHUNK words), else they are allocated."""
    b = as_bytes(t)
    n = b.numel()
    nwords = n // 4
    acc_a = acc_b = 0
    if nwords:
        whole = b[:nwords * 4]
        try:
            words = whole.view(torch.int32)
        except RuntimeError:  # a byte view that does not start on a 4-byte boundary
            words = whole.clone().view(torch.int32)
        offsets = _chunk_offsets()
        size = min(HOST_CHUNK, nwords)
        if work is not None and min(work[0].numel(), work[1].numel()) >= 2 * size:
            h, tmp = work[0][:2 * size].view(2, size), work[1][:2 * size].view(2, size)
        else:
            h = torch.empty((2, size), dtype=torch.int32, device=HOST)
            tmp = torch.empty((2, size), dtype=torch.int32, device=HOST)
        base = torch.empty((2, 1), dtype=torch.int32, device=HOST)
        sums = torch.zeros(2, dtype=torch.int64, device=HOST)
        for start in range(0, nwords, HOST_CHUNK):
            w = words[start:start + HOST_CHUNK]
            m = w.numel()
            hh, tt = (h, tmp) if m == size else (h[:, :m], tmp[:, :m])
            base[0, 0] = s32(_key_int(start, KEY_A))
            base[1, 0] = s32(_key_int(start, KEY_B))
            torch.add(offsets[:, :m], base, out=hh)  # index keys of both lanes
            hh.bitwise_xor_(w)  # the word, broadcast over the two lanes
            fmix_lanes_(hh, tt)
            sums += hh.sum(dim=1, dtype=torch.int32)  # wraps modulo 2^32
        acc_a, acc_b = sums.tolist()
    if n % 4:  # the last word, zero-padded
        tail = bytes(b[nwords * 4:].tolist())
        w_last = int.from_bytes(tail + b"\0" * (4 - len(tail)), "little")
        acc_a += _fmix_int(w_last ^ _key_int(nwords, KEY_A), FMIX_A)
        acc_b += _fmix_int(w_last ^ _key_int(nwords, KEY_B), FMIX_B)
    return acc_a & MASK32, acc_b & MASK32


def fingerprint_host(t: torch.Tensor) -> str:
    """The fingerprint of a CPU tensor, now (``lane_sums_host``)."""
    with torch._C.DisableTorchFunction():
        a, b = lane_sums_host(t)
        return finish(a, b, t.numel() * t.element_size())


def fingerprint_tensor(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Lane sums on ``t``'s device and the byte length; ``finish`` turns them into hex."""
    return lane_sums(t), t.numel() * t.element_size()


def fingerprint(t: torch.Tensor) -> str:
    """Synchronous convenience: the fingerprint of one tensor as 16 hex digits."""
    if t.device.type == "cpu":
        return fingerprint_host(t)
    with torch._C.DisableTorchFunction():
        sums, nbytes = fingerprint_tensor(t)
        a, b = sums.tolist()
        return finish(a, b, nbytes)
