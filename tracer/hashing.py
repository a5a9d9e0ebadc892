"""Checksums and stats of tensors, kept off the training thread's critical path where possible.

MD5 is of the tensor's logical contents in its own dtype, row-major, as bytes: equal to
``hashlib.md5(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()).hexdigest()``.
Shape and dtype are recorded beside the hash, not in it.

How the bytes get hashed:
- CPU, small tensors: hashed at once (cheaper than any hand-off).
- CPU, large tensors: the bytes are snapshotted (a copy, so a later in-place change cannot alter
  what gets hashed) and MD5 runs on a pool of worker threads (``hashlib`` releases the GIL).
- CUDA: the bytes are copied on a side stream into pinned host memory, an event marks the copy,
  and a worker thread waits on that event and hashes. The training thread never synchronises.
In-flight bytes are bounded (back-pressure): when the budget is used, ``submit`` waits for the
oldest job, so memory stays bounded on a step that makes many gigabytes of tensors.

Stats (min, max, mean, absmax over finite values; NaN and Inf counts) are computed on the
tensor's own device as one small tensor each and fetched in one batch per device at ``drain``.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tracer.model import Stats, TensorRecord

HASH_ALGORITHMS = ("md5", "fast", "none")
INLINE_BYTES = 256 * 1024
DEFAULT_INFLIGHT_BYTES = 512 * 1024 * 1024
STATS_BATCH_BYTES = 64 * 1024 * 1024
FAST_BATCH_MAX_BYTES = 256 * 1024

_ALLOWED_TYPES = (torch.Tensor, torch.nn.Parameter)


def unhashable_reason(t: torch.Tensor) -> str | None:
    """Why a tensor's bytes cannot be hashed, or None when they can."""
    if type(t) not in _ALLOWED_TYPES:
        name = type(t).__name__
        if name == "FakeTensor":
            return "fake tensor (no data)"
        if name == "FunctionalTensor":
            return "functional tensor (no data)"
        return f"tensor subclass {name}"
    if t.is_meta:
        return "meta tensor (no data)"
    if t.layout != torch.strided:
        return f"{str(t.layout).replace('torch.', '')} layout"
    if t.is_quantized:
        return "quantized tensor"
    if getattr(t, "is_nested", False):
        return "nested tensor"
    if t.device.type not in ("cpu", "cuda"):
        return f"device {t.device.type} not supported for hashing"
    return None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical contents as a flat contiguous uint8 tensor on its own device."""
    x = t.detach()
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    return x.contiguous().reshape(-1).view(torch.uint8)


def host_bytes(b: torch.Tensor) -> memoryview:
    """A zero-copy read-only view of a contiguous CPU uint8 tensor's bytes, for hashlib.

    Not ``.numpy()``: that marks the storage non-resizable, and code such as FSDP2 resizes the
    storages of tensors the trace hashes (it failed with "Trying to resize storage that is not
    resizable"). The view is valid while ``b`` is alive, which callers guarantee.
    """
    n = b.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(b.data_ptr())).cast("B")


def md5_of(t: torch.Tensor) -> str:
    """Synchronous reference MD5 of a tensor (copies to host)."""
    b = as_bytes(t)
    if b.device.type != "cpu":
        b = b.cpu()
    return hashlib.md5(host_bytes(b)).hexdigest()


def stats_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """[min, max, mean, absmax, nan, inf, n_finite] of one tensor as float64 on its device.

    The reference for the batched path (``_reduce_batch``), used by tests and for one-off checks.
    """
    flat = _stats_input(t)
    if flat is None:
        return None
    return _reduce_batch([flat])[0]


def cpu_stats(t: torch.Tensor) -> Stats | None:
    """Stats of a CPU tensor now: one fused min/max pass and one sum when all values are finite
    (min and max reveal any NaN or Inf), the masked reduction only when they are not."""
    x = t.detach()
    if x.numel() == 0:
        return None
    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj())
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    x = x.reshape(-1)
    if (x.is_floating_point() and x.element_size() < 4) or not (x.is_floating_point() or x.dtype in _AMINMAX_INT):
        x = x.float()
    lo, hi = torch.aminmax(x)
    lo_f, hi_f = float(lo), float(hi)
    if math.isfinite(lo_f) and math.isfinite(hi_f):
        mean = float(x.sum(dtype=torch.float64)) / x.numel()
        return Stats(lo_f, hi_f, mean, max(abs(lo_f), abs(hi_f)), 0, 0)
    return _stats_from_row(_reduce_one(x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)).tolist())


_AMINMAX_INT = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})


def _stats_input(t: torch.Tensor) -> torch.Tensor | None:
    """A flat contiguous float copy of ``t`` (a snapshot: later in-place changes don't reach it)."""
    x = t.detach()
    if x.numel() == 0:
        return None
    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj())
    target = torch.float64 if x.dtype in _WIDE else torch.float32
    return x.reshape(-1).to(target, copy=True)


_WIDE = frozenset({torch.float64, torch.int64, torch.int32, *(getattr(torch, n) for n in ("uint32", "uint64")
                                                            if hasattr(torch, n))})


SMALL_NUMEL = 1 << 16  # tensors up to this size are reduced together, larger ones alone


def _reduce_batch(flats: list[torch.Tensor]) -> torch.Tensor:
    """Stats of many flat tensors (same device and dtype) as a float64 tensor [k, 7] on that device.

    Small tensors (most of a step's tensors, by count) are concatenated and reduced together with
    ``scatter_reduce`` — a dozen kernels for hundreds of tensors instead of a dozen each. Large
    tensors get ordinary reductions of their own: per-segment reductions such as
    ``segment_reduce`` walk each segment serially on CUDA, which is hopeless for a 100M-element
    activation. Nothing here synchronises.
    """
    rows: list[torch.Tensor | None] = [None] * len(flats)
    small = [i for i, f in enumerate(flats) if f.numel() <= SMALL_NUMEL]
    for i, f in enumerate(flats):
        if f.numel() > SMALL_NUMEL:
            rows[i] = _reduce_one(f)
    if small:
        result = _reduce_small([flats[i] for i in small])
        for j, i in enumerate(small):
            rows[i] = result[j]
    return torch.stack([r for r in rows if r is not None])


def _reduce_one(data: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(data)
    zero = torch.zeros((), dtype=data.dtype, device=data.device)
    n_fin = finite.sum(dtype=torch.float64)
    n_nan = torch.isnan(data).sum(dtype=torch.float64)
    lo = torch.where(finite, data, torch.inf).amin().double()
    hi = torch.where(finite, data, -torch.inf).amax().double()
    total = torch.where(finite, data, zero).sum(dtype=torch.float64)
    absmax = torch.where(finite, data.abs(), zero).amax().double()
    n_inf = data.numel() - n_fin - n_nan
    return torch.stack([lo, hi, total / n_fin.clamp(min=1), absmax, n_nan, n_inf, n_fin])


def pad_rows(flats: list[torch.Tensor], fill: float | int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Small flat tensors as padded rows, one matrix per power-of-two size class.

    Returns ``(which, rows, lengths)`` per class: ``rows[j, :lengths[j]]`` is ``flats[which[j]]``
    and the rest is ``fill``. Reducing along rows is an ordinary parallel reduction, with no
    two threads writing one address (scatter-style segment reductions funnel a whole segment
    into one atomic target and serialise on the GPU). Padding at most doubles the elements.
    """
    classes: dict[int, list[int]] = {}
    for i, f in enumerate(flats):
        classes.setdefault(max(1, f.numel() - 1).bit_length(), []).append(i)
    out = []
    for bits, which in sorted(classes.items()):
        width = 1 << bits
        parts = [flats[i] for i in which]
        dev, dtype = parts[0].device, parts[0].dtype
        lengths = torch.tensor([p.numel() for p in parts], device=dev)
        data = parts[0] if len(parts) == 1 else torch.cat(parts)
        rows = torch.full((len(parts), width), fill, dtype=dtype, device=dev)
        seg = torch.repeat_interleave(torch.arange(len(parts), device=dev), lengths, output_size=data.numel())
        starts = torch.cumsum(lengths, 0) - lengths
        col = torch.arange(data.numel(), device=dev) - starts[seg]
        rows.view(-1)[seg * width + col] = data
        out.append((which, rows, lengths))
    return out


def _reduce_small(flats: list[torch.Tensor]) -> torch.Tensor:
    """Stats of small flat float tensors, [k, 7]. Padding is NaN, which the finite mask drops."""
    k = len(flats)
    result = torch.empty((k, 7), dtype=torch.float64, device=flats[0].device)
    for which, rows, lengths in pad_rows(flats, float("nan")):
        finite = torch.isfinite(rows)
        zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
        lo = torch.where(finite, rows, torch.inf).amin(dim=1).double()
        hi = torch.where(finite, rows, -torch.inf).amax(dim=1).double()
        absmax = torch.where(finite, rows.abs(), zero).amax(dim=1).double()
        total = torch.where(finite, rows, zero).sum(dim=1, dtype=torch.float64)
        n_fin = finite.sum(dim=1, dtype=torch.float64)
        pad = rows.shape[1] - lengths.double()
        n_nan = torch.isnan(rows).sum(dim=1, dtype=torch.float64) - pad
        n_inf = lengths.double() - n_fin - n_nan
        idx = torch.tensor(which, device=rows.device)
        result[idx] = torch.stack([lo, hi, total / n_fin.clamp(min=1), absmax, n_nan, n_inf, n_fin], dim=1)
    return result


def _stats_from_row(row: list[float]) -> Stats:
    lo, hi, mean, absmax, nan, inf, n_fin = row
    if n_fin == 0:  # no finite value at all: min/max/mean have no meaning
        return Stats(None, None, None, None, int(nan), int(inf))
    return Stats(lo, hi, mean, absmax, int(nan), int(inf))


class Hasher:
    """Queues checksum and stats work for tensor records and fills the records in when done."""

    def __init__(self, algorithm: str = "md5", stats: bool = True, workers: int | None = None,
                 max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> None:
        if algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash must be one of {', '.join(HASH_ALGORITHMS)}, got {algorithm!r}")
        self.algorithm = algorithm
        self.want_stats = stats
        self.max_inflight = max_inflight_bytes
        self._workers = workers or max(1, (os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: deque[tuple[TensorRecord, Future[str], int]] = deque()
        self._inflight = 0
        # Stats wait in groups of same device and dtype and are reduced together; a group is
        # reduced (on its device, without a sync) once it holds STATS_BATCH_BYTES, bounding the
        # memory its snapshots take.
        self._stat_groups: dict[tuple[torch.device, torch.dtype], list[tuple[TensorRecord, torch.Tensor]]] = {}
        self._stat_bytes: dict[tuple[torch.device, torch.dtype], int] = {}
        self._stat_results: list[tuple[list[TensorRecord], torch.Tensor]] = []
        self._fingerprints: list[tuple[TensorRecord, torch.Tensor]] = []
        self._fast_batches: dict[torch.device, list[tuple[TensorRecord, torch.Tensor]]] = {}
        self._fast_bytes: dict[torch.device, int] = {}
        self._lock = threading.Lock()
        self._side_streams: dict[int, Any] = {}
        self.capturing_skipped = 0
        self.hashed_bytes = 0

    # ---- submission (training thread or autograd threads) ---------------------------------------
    def submit(self, rec: TensorRecord, t: torch.Tensor) -> None:
        reason = unhashable_reason(t)
        if reason is not None:
            rec.hash_note = f"not hashed: {reason}"
            return
        if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            rec.hash_note = "not hashed: CUDA graph capture in progress"
            self.capturing_skipped += 1
            return
        with torch._C.DisableTorchFunction():
            if t.device.type == "cpu":
                # On the CPU reading a result costs no sync: stats now, from the tensor itself
                # (no snapshot), with the cheap all-finite path.
                if self.want_stats:
                    rec.stats = cpu_stats(t)
                if self.algorithm == "md5":
                    self._submit_md5(rec, t)
                elif self.algorithm == "fast":
                    self._submit_fast(rec, t)
                return
            flat = _stats_input(t) if self.want_stats else None
            if flat is not None:
                key = (flat.device, flat.dtype)
                with self._lock:
                    self._stat_groups.setdefault(key, []).append((rec, flat))
                    size = self._stat_bytes.get(key, 0) + flat.numel() * flat.element_size()
                    self._stat_bytes[key] = size
                if size >= STATS_BATCH_BYTES:
                    self._reduce_group(key)
            if self.algorithm == "fast":
                self._submit_fast(rec, t)
            elif self.algorithm == "md5":
                # A float32 snapshot already holds the exact bytes: hash it, skip another copy.
                if flat is not None and flat.dtype == t.dtype and flat.device.type == "cpu" and not t.is_conj() \
                        and not t.is_neg() and flat.numel() * flat.element_size() <= INLINE_BYTES:
                    self.hashed_bytes += flat.numel() * flat.element_size()
                    rec.md5 = hashlib.md5(host_bytes(flat.view(torch.uint8))).hexdigest()
                else:
                    self._submit_md5(rec, t)

    def _submit_fast(self, rec: TensorRecord, t: torch.Tensor) -> None:
        from tracer.fingerprint import fingerprint_tensor

        b = as_bytes(t)
        if b.numel() > FAST_BATCH_MAX_BYTES:  # large: its own few kernels are worth it
            fp = fingerprint_tensor(t)
            with self._lock:
                self._fingerprints.append((rec, fp))
            return
        # Small: snapshot the bytes (one copy) and fingerprint a whole batch in one pass later.
        snap = b.clone() if b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else b
        with self._lock:
            batch = self._fast_batches.setdefault(snap.device, [])
            batch.append((rec, snap))
            size = self._fast_bytes.get(snap.device, 0) + snap.numel()
            self._fast_bytes[snap.device] = size
        if size >= STATS_BATCH_BYTES:
            self._reduce_fast(snap.device)

    def _reduce_fast(self, device: torch.device) -> None:
        from tracer.fingerprint import fingerprint_batch

        with self._lock:
            items = self._fast_batches.pop(device, [])
            self._fast_bytes.pop(device, None)
        if not items:
            return
        with torch._C.DisableTorchFunction():
            lanes = fingerprint_batch([b for _, b in items])
        with self._lock:
            self._fingerprints.extend((rec, lanes[i]) for i, (rec, _) in enumerate(items))

    def _reduce_group(self, key: tuple[torch.device, torch.dtype]) -> None:
        with self._lock:
            items = self._stat_groups.pop(key, [])
            self._stat_bytes.pop(key, None)
        if items:
            with torch._C.DisableTorchFunction():
                result = _reduce_batch([f for _, f in items])
            with self._lock:
                self._stat_results.append(([r for r, _ in items], result))

    def _pool_get(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="gradtrace-md5")
        return self._pool

    def _submit_md5(self, rec: TensorRecord, t: torch.Tensor) -> None:
        b = as_bytes(t)
        n = b.numel()
        self.hashed_bytes += n
        if b.device.type == "cpu":
            if n <= INLINE_BYTES:
                rec.md5 = hashlib.md5(host_bytes(b)).hexdigest()
                return
            # Snapshot: the caller may change the tensor in place right after this call.
            shares = b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            snap = b.clone() if shares else b
            self._reserve(n)
            fut = self._pool_get().submit(_md5_host, snap, None)
        else:
            host, event = self._copy_to_host(b)
            self._reserve(n)
            fut = self._pool_get().submit(_md5_host, host, event)
        with self._lock:
            self._jobs.append((rec, fut, n))
            self._inflight += n

    def _copy_to_host(self, b: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dev = b.device
        key = dev.index if dev.index is not None else torch.cuda.current_device()
        stream = self._side_streams.get(key)
        if stream is None:
            stream = self._side_streams[key] = torch.cuda.Stream(device=dev)
        current = torch.cuda.current_stream(dev)
        stream.wait_stream(current)
        host = torch.empty(b.numel(), dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(b, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        # The device bytes must outlive the copy even if the training thread frees them.
        b.record_stream(stream)
        return host, event

    def _reserve(self, n: int) -> None:
        # Back-pressure: wait for the oldest jobs until the new one fits in the budget.
        while True:
            with self._lock:
                if self._inflight + n <= self.max_inflight or not self._jobs:
                    return
                rec, fut, size = self._jobs.popleft()
                self._inflight -= size
            rec.md5 = fut.result()

    # ---- completion ---------------------------------------------------------------------------
    def drain(self, wait: bool = False) -> None:
        """Fill in finished checksums (all of them if ``wait``) and every pending stat."""
        for key in list(self._stat_groups):
            self._reduce_group(key)
        for device in list(self._fast_batches):
            self._reduce_fast(device)
        with self._lock:
            results, self._stat_results = self._stat_results, []
            fps, self._fingerprints = self._fingerprints, []
        if fps:
            from tracer.fingerprint import fingerprint_hex

            by_device: dict[torch.device, list[tuple[TensorRecord, torch.Tensor]]] = {}
            for rec, fp in fps:
                by_device.setdefault(fp.device, []).append((rec, fp))
            with torch._C.DisableTorchFunction():
                for items in by_device.values():
                    rows = torch.stack([fp for _, fp in items]).cpu().tolist()  # one fetch per device
                    for (rec, _), row in zip(items, rows):
                        rec.fingerprint = fingerprint_hex(row)
        with torch._C.DisableTorchFunction():
            for recs, result in results:
                for rec, row in zip(recs, result.cpu().tolist()):  # one fetch per batch
                    rec.stats = _stats_from_row(row)
        while True:
            with self._lock:
                if not self._jobs:
                    return
                rec, fut, size = self._jobs[0]
                if not wait and not fut.done():
                    return
                self._jobs.popleft()
                self._inflight -= size
            rec.md5 = fut.result()

    def pending(self) -> set[int]:
        with self._lock:
            waiting = {id(r) for r, _, _ in self._jobs} | {id(r) for r, _ in self._fingerprints}
            for items in self._fast_batches.values():
                waiting.update(id(r) for r, _ in items)
            for items in self._stat_groups.values():
                waiting.update(id(r) for r, _ in items)
            for recs, _ in self._stat_results:
                waiting.update(id(r) for r in recs)
            return waiting

    def close(self) -> None:
        self.drain(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _md5_host(buf: torch.Tensor, event: Any) -> str:
    if event is not None:
        event.synchronize()
    return hashlib.md5(host_bytes(buf)).hexdigest()
