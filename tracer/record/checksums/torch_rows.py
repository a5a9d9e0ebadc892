"""A waiting batch's rows computed with torch ops, a whole batch at a time: what ``Fused`` uses
while Triton is still compiling its kernels (the first traced step of a process).

The rows are those of the batched kernels (``tracer.record.checksums.fused``): per tensor,
float64 ``[min, max, mean, absmax]`` over its finite values and int64 ``[nan, inf, lane_a,
lane_b]``, the lanes finished as ``fingerprint.finish`` finishes them. Fingerprints are equal to
the kernel's bit for bit (the same modular arithmetic, ``fingerprint.lane_sums``); stats are
summed in float64, as the per-tensor torch path sums them.

Why not the per-tensor torch path: it makes ~40 kernel launches per tensor (1.2-1.6 ms of host
time each on an H200 host), so a first step of ResNet-50 that met 1,382 tensors while its
kernels compiled spent 2.3 s there. Here the batch's tensors are cut into chunks of at most
``CHUNK_ELEMENTS`` elements or words; each chunk is one ``cat`` and ~30 element-wise and
scatter ops, whatever the number of tensors in it. The per-piece metadata (which tensor each
piece is, where it starts) goes to the device in one non-blocking copy from pinned memory: a
pageable copy would wait for the stream's queued work.
"""

from __future__ import annotations

import array
from collections.abc import Iterator, Sequence

import torch

from tracer.record.checksums import fingerprint as fp
from tracer.record.checksums.bytes import as_bytes

CHUNK_ELEMENTS = 1 << 23  # per chunk: bounds the float64 / int64 temporaries (64 MiB each)
_WIDE = frozenset({torch.float64, torch.int64, torch.int32})


def batch_rows(tensors: Sequence[torch.Tensor], stats: bool, fingerprint: bool,
               chunk: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows_f [k, 4] float64, rows_i [k, 4] int64)`` of ``tensors`` (one dtype, one device,
    none empty), on their device, queued on the current stream with no host synchronisation.
    Columns a caller did not ask for (``stats``, ``fingerprint``) are zeros."""
    k = len(tensors)
    device = tensors[0].device
    rows_f = torch.zeros((k, 4), dtype=torch.float64, device=device)
    rows_i = torch.zeros((k, 4), dtype=torch.int64, device=device)
    with torch._C.DisableTorchFunction():  # our own ops, never the user's: not recorded
        if fingerprint:
            rows_i[:, 2:] = _fingerprint_lanes(tensors, chunk)
        if stats:
            _stats_into(tensors, chunk, rows_f, rows_i)
    return rows_f, rows_i


def _pieces(lengths: Sequence[int], chunk: int) -> Iterator[list[tuple[int, int, int]]]:
    """``lengths`` (per tensor) cut into chunks of at most ``chunk``: each chunk a list of
    ``(tensor, first, count)`` pieces, in order."""
    out: list[tuple[int, int, int]] = []
    room = chunk
    for slot, n in enumerate(lengths):
        first = 0
        while first < n:
            take = min(n - first, room)
            out.append((slot, first, take))
            first += take
            room -= take
            if room == 0:
                yield out
                out, room = [], chunk
    if out:
        yield out


def _to_device(values: array.array[int], device: torch.device) -> torch.Tensor:
    """An int64 host array on ``device`` without waiting for the stream (pinned, non-blocking)."""
    host = torch.frombuffer(values, dtype=torch.int64) if len(values) else torch.empty(0, dtype=torch.int64)
    if device.type == "cpu":
        return host.clone()
    return host.pin_memory().to(device, non_blocking=True)


def _segments(pieces: list[tuple[int, int, int]], total: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of a chunk made of ``pieces``: which tensor it belongs to, and its index in
    that tensor."""
    meta = array.array("q")
    at = 0
    for slot, first, count in pieces:
        meta.extend((slot, count, first - at))
        at += count
    m = _to_device(meta, device).view(-1, 3)
    counts = m[:, 1]
    slots = torch.repeat_interleave(m[:, 0], counts, output_size=total)  # output_size: no sync
    index = torch.arange(total, dtype=torch.int64, device=device)
    index += torch.repeat_interleave(m[:, 2], counts, output_size=total)
    return slots, index


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words, the last one zero-padded."""
    b = as_bytes(t)
    pad = -b.numel() % 4
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    try:
        return b.view(torch.int32)
    except RuntimeError:  # bytes that do not start on a 4-byte boundary (a view into a tensor)
        return b.clone().view(torch.int32)


def _fingerprint_lanes(tensors: Sequence[torch.Tensor], chunk: int) -> torch.Tensor:
    """[k, 2] int64: each tensor's two finished fingerprint lanes."""
    device = tensors[0].device
    k = len(tensors)
    words = [_words(t) for t in tensors]
    sums = torch.zeros((2, k), dtype=torch.int64, device=device)
    for pieces in _pieces([w.numel() for w in words], chunk):
        parts = [words[slot][first:first + count] for slot, first, count in pieces]
        w = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(torch.int64) & fp.MASK32
        slots, index = _segments(pieces, w.numel(), device)
        lo, hi = index & fp.MASK32, index >> 32
        for lane, key, mix in ((0, fp.KEY_A, fp.FMIX_A), (1, fp.KEY_B, fp.FMIX_B)):
            keys = (lo * key[0] + hi * key[1] + key[2]) & fp.MASK32
            sums[lane].index_add_(0, slots, fp.fmix(w ^ keys, mix))  # integer adds: any order
    # The byte length's term, per tensor (a function of the length alone: computed here).
    terms = array.array("q")
    for mix, salt in ((fp.FMIX_A, fp.LENGTH_SALT[0]), (fp.FMIX_B, fp.LENGTH_SALT[1])):
        for t in tensors:
            n = t.numel() * t.element_size()
            terms.append(fp.fmix_int((n & fp.MASK32) ^ salt ^ fp.fmix_int(n >> 32, mix), mix))
    length_terms = _to_device(terms, device).view(2, k)
    lane_a = fp.fmix((sums[0] + length_terms[0]) & fp.MASK32, fp.FMIX_A)
    lane_b = fp.fmix((sums[1] + length_terms[1]) & fp.MASK32, fp.FMIX_B)
    return torch.stack([lane_a, lane_b], dim=1)


def _stats_into(tensors: Sequence[torch.Tensor], chunk: int, rows_f: torch.Tensor, rows_i: torch.Tensor) -> None:
    """Fill ``rows_f`` with [min, max, mean, absmax] over finite values (min +inf where there is
    none) and ``rows_i[:, :2]`` with the NaN and Inf counts."""
    device = tensors[0].device
    k = len(tensors)
    flats = [_values(t) for t in tensors]
    lo = torch.full((k,), torch.inf, dtype=torch.float64, device=device)
    hi = torch.full((k,), -torch.inf, dtype=torch.float64, device=device)
    absmax = torch.zeros(k, dtype=torch.float64, device=device)
    total = torch.zeros(k, dtype=torch.float64, device=device)
    nan = torch.zeros(k, dtype=torch.int64, device=device)
    fin = torch.zeros(k, dtype=torch.int64, device=device)
    for pieces in _pieces([f.numel() for f in flats], chunk):
        parts = [flats[slot][first:first + count] for slot, first, count in pieces]
        x = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(torch.float64)
        slots, _ = _segments(pieces, x.numel(), device)
        finite = torch.isfinite(x)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        lo.scatter_reduce_(0, slots, torch.where(finite, x, torch.inf), "amin")
        hi.scatter_reduce_(0, slots, torch.where(finite, x, -torch.inf), "amax")
        absmax.scatter_reduce_(0, slots, torch.where(finite, x.abs(), zero), "amax")
        total.index_add_(0, slots, torch.where(finite, x, zero))
        nan.index_add_(0, slots, torch.isnan(x).to(torch.int64))
        fin.index_add_(0, slots, finite.to(torch.int64))
    numel = array.array("q", (f.numel() for f in flats))
    rows_f[:, 0] = lo
    rows_f[:, 1] = hi
    rows_f[:, 2] = total / fin.clamp(min=1)
    rows_f[:, 3] = absmax
    rows_i[:, 0] = nan
    rows_i[:, 1] = _to_device(numel, device) - nan - fin


def _values(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values, flat (bool as 0/1 bytes, as the kernel reads them)."""
    x = t.detach().reshape(-1)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    return x
