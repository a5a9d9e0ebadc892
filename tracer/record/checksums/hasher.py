"""Checksums and stats of tensors, kept off the training thread's critical path where possible.

What is hashed is ``tracer.record.checksums.bytes``; the stats, ``tracer.record.checksums.stats``.

How the bytes get hashed:
- CPU, small tensors: hashed at once (cheaper than any hand-off).
- CPU, large tensors: the bytes are snapshotted (a copy, so a later in-place change cannot alter
  what gets hashed) and MD5 runs on a pool of worker threads (``hashlib`` releases the GIL).
- CUDA: the bytes are copied into pinned host memory on the stream that made them (so a later
  in-place write on that stream cannot overtake the copy; writers on other streams are ordered
  after it by ``before_write``), an event marks the copy, and a worker thread waits on that event
  and hashes. The training thread never synchronises.
In-flight bytes are bounded (back-pressure): when the budget (an eighth of the machine's memory,
at most 16 GiB) is used, ``submit`` waits for the oldest job, so memory stays bounded on a step
that makes many gigabytes of tensors.

Stats (min, max, mean, absmax over finite values; NaN and Inf counts) and ``hash="fast"``
fingerprints of CUDA tensors are computed on the device by batched Triton kernels
(``tracer.record.checksums.fused``) where Triton is installed, else by a few torch kernels per tensor; either way
the results stay on the device and are fetched in one copy per device at ``drain``. On the CPU
they are computed at once (reading a CPU result costs no sync).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tracer.model import Stats, TensorRecord
from tracer.options import HASH_ALGORITHMS
from tracer.record.checksums import fingerprint as fp
from tracer.record.checksums.bytes import ALLOWED_TYPES, as_bytes, host_bytes, plain_data, unhashable_reason
from tracer.record.checksums.fused import Fused, triton_usable, warm_up
from tracer.record.checksums.host_batch import HostFingerprints
from tracer.record.checksums.launcher import WARMUP
from tracer.record.checksums.prewarm import PREWARM
from tracer.record.checksums.stats import (
    SCALAR_DTYPES,
    cpu_stats,
    cpu_stats_same_size,
    reduce_one,
    scalar_stats,
    stats_from_row,
    stats_input,
)
from tracer.record.own_work import HOST, own_work
from tracer.record.sharding import local_shard
from tracer.record.transforms import is_wrapped, transforms_active, transforms_off, unwrap

INLINE_BYTES = 256 * 1024
# CPU hash="fast": tensors of at most this many bytes are fingerprinted in Python (cached by
# their bytes: step counts and flags recur), larger ones staged (a 64-byte tensor took 28 µs in
# Python, about a third of that staged).
TINY_BYTES = 8
# How long trace starts wait for the batched kernels once Triton's start-up is done (Hasher.prepare),
# in all, per set of kernels and process.
PREPARE_WAIT_S = 0.5


def _default_inflight() -> int:
    """Bytes of MD5 work in flight: enough that every core has large tensors to hash at once
    (a step's biggest tensors are GBs), bounded by a share of the machine's memory."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return max(512 << 20, min(16 << 30, ram // 8))


DEFAULT_INFLIGHT_BYTES = _default_inflight()

_STRIDED = torch.strided
_F32 = torch.float32
# Fewer new values than this in one call: submit_many submits them one by one.
BATCH_MIN = 8
# Device tensors from one call read through one plan (Fused.read_now) from this many on; fewer
# are added one by one (a plan's first layout costs more than a few adds). benchmarks/lever_ab.py
# sets it out of reach to measure what the plans save.
LIST_MIN = 32
# Stats reduced together: groups of at least this many float32 tensors of one size, up to this
# many values each (2-core host, 1 thread: 10 us a tensor alone, 3-5 us in groups of 20 of up
# to 512 values, 7 us at 1024 values; a stack's row reductions lose from 2048 values on).
BATCH_MIN_GROUP = 4
BATCH_MAX_ELEMS = 1024
# Whether the current CUDA stream is capturing a graph, without torch.cuda's Python wrapper
# (private; the public function is the fallback).
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


class Hasher:
    """Queues checksum and stats work for tensor records and fills the records in when done.

    CUDA stats and fingerprints go through ``tracer.record.checksums.fused`` (Triton, batched) where Triton is
    usable, else through per-tensor torch ops; both stay on the device until ``drain``.
    """

    def __init__(self, algorithm: str = "md5", stats: bool = True, workers: int | None = None,
                 max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> None:
        if algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash must be one of {', '.join(HASH_ALGORITHMS)}, got {algorithm!r}")
        self.algorithm = algorithm
        self.want_stats = stats
        # False when submit has nothing to do: the recorder then skips the call altogether.
        self.active = stats or algorithm != "none"
        self.max_inflight = max_inflight_bytes
        self._workers = workers or max(1, (os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: deque[tuple[TensorRecord, Future[str], int]] = deque()
        self._inflight = 0
        # Per-tensor device results of the torch path, fetched at drain.
        self._stat_rows: list[tuple[TensorRecord, torch.Tensor]] = []
        self._fingerprints: list[tuple[TensorRecord, torch.Tensor, int]] = []
        self._fused: Any = None  # tracer.record.checksums.fused.Fused, made on the first CUDA tensor
        self._fused_tried = False
        self._host_fp: HostFingerprints | None = None  # CPU hash="fast", made on first use
        # Tests only: CPU tensors through the batched kernels under Triton's CPU interpreter
        # (TRITON_INTERPRET=1 must be set before triton is first imported), so a machine
        # without a GPU exercises the batching and its flush rules end to end.
        self._interpret = os.environ.get("GRADTRACE_FUSED_INTERPRET") == "1"
        self._lock = threading.Lock()
        # The last MD5 copy queued per (device, stream): writers on other streams wait for it.
        self._copy_events: dict[tuple[torch.device, int], Any] = {}
        self.capturing_skipped = 0
        # Records of a value already submitted under another record: (copy, original), filled in
        # from the original once it is done (a gradient passed on unchanged: hashed once).
        self._same: list[tuple[TensorRecord, TensorRecord]] = []

    @own_work
    def prepare(self) -> None:
        """When a trace starts on a process that already uses CUDA: compile the batched kernels
        in the background, so the first traced step does not wait for Triton's compiler.
        (A process that has not touched CUDA yet is left alone: this must not initialise it.)"""
        if (self.want_stats or self.algorithm == "fast") and not self._interpret and torch.cuda.is_initialized():
            keys = warm_up(torch.cuda.current_device(), self.want_stats, self.algorithm == "fast")
            if PREWARM.done:
                # Triton's start-up is behind us (prewarm.py): with its on-disk cache warm, the
                # kernels load in ~45 ms, less than one tensor's first torch-path check costs
                # (its own kernels load too), and a step running meanwhile slowed the loading
                # 10-30x (ResNet-50). So wait here, up to a bound per process: a cold cache
                # (about a second per kernel) leaves the rest to the background and the torch
                # path, as before, and the traces that start while it compiles do not wait.
                self._meanwhile()
                WARMUP.wait_for(keys, PREPARE_WAIT_S)

    def _meanwhile(self) -> None:
        """While the warm-up thread loads the kernels, this thread does the batched path's other
        first-time work, which the first traced step paid otherwise (ResNet-50 on the H200: the
        first ``torch.cat`` of the end's fetch loaded its CUDA kernel in 9 ms)."""
        if _capturing():  # nothing may be launched into a graph being captured
            return
        fused = self._fused if self._fused_tried else self._make_fused()
        if fused is not None:
            fused.prepare(torch.cuda.current_device())

    # ---- submission (training thread or autograd threads) ---------------------------------------
    @own_work  # our reads are not the user's ops (tracer.record.own_work)
    def submit(self, rec: TensorRecord, t: torch.Tensor) -> None:
        if not self.active:
            return
        if transforms_active():  # inside torch.func.grad/vmap/jvp...: see tracer.record.transforms
            with transforms_off():
                self._submit_wrapped(rec, t)
            return
        # The common cases first, with as few tensor attribute reads as possible: this runs for
        # every tensor a step makes (thousands), and each read costs a fraction of a microsecond.
        # A plain tensor passes every check of unhashable_reason but the device's.
        plain = type(t) in ALLOWED_TYPES and t.layout is _STRIDED and not t.is_quantized and not t.is_nested
        if plain and t.is_cpu and not self._interpret:
            # A plain CPU tensor: _submit_slow's CPU part, inlined (a call less per value).
            try:
                if t.numel() == 1 and self._submit_scalar(rec, t):
                    return
                # Reading a CPU result costs no sync: stats now, from the tensor itself (no
                # snapshot), with the cheap all-finite path.
                if self.want_stats:
                    rec.stats = cpu_stats(t)
                if self.algorithm != "none":
                    self._checksum_cpu(rec, t)
            except RuntimeError as exc:
                self._not_read(rec, t, exc)
            return
        if plain and t.is_cuda and not self._interpret and self.algorithm != "md5":
            if _capturing():
                rec.hash_note = "not hashed: CUDA graph capture in progress"
                self.capturing_skipped += 1
                return
            fused = self._fused if self._fused_tried else self._make_fused()
            if fused is not None and fused.add(rec, t):
                return
        if not (plain and t.is_cpu):  # (a CPU tensor is not a meta tensor)
            data = plain_data(t) if type(t) not in ALLOWED_TYPES else None
            if data is not None:  # a subclass that only tags a plain tensor: its bytes
                self.submit(rec, data)
                return
            reason = unhashable_reason(t)
            if reason is not None:
                shard = local_shard(t)  # a DTensor: this rank's local shard is hashed, its layout recorded
                if shard is None:
                    rec.hash_note = f"not hashed: {reason}"
                    return
                t, rec.sharding = shard
                self.submit(rec, t)
                return
        try:
            self._submit_slow(rec, t)
        except RuntimeError as exc:
            self._not_read(rec, t, exc)

    def _not_read(self, rec: TensorRecord, t: torch.Tensor, exc: RuntimeError) -> None:
        """Reading ``t`` raised (e.g. a storage freed and not yet reallocated, FSDP): never an
        error in the user's code; the record says why it has no checksum."""
        if is_wrapped(t):  # a torch.func tensor that outlived its transform
            self._submit_wrapped(rec, t)
        else:
            rec.hash_note = f"not hashed: {_first_line(exc)}"

    def same_as(self, rec: TensorRecord, original: TensorRecord) -> None:
        """``rec`` holds the very value ``original`` was submitted with: it gets the original's
        checksum, stats and notes once those are known, with no work of its own."""
        if self.active:
            with self._lock:
                self._same.append((rec, original))

    def _fill_same(self, pending: set[int] | None) -> None:
        """Copy finished originals into their copies (all of them when ``pending`` is None)."""
        with self._lock:
            same, self._same = self._same, []
        keep = []
        kept: set[int] = set()  # copies still waiting: a copy of one of them waits too (a view of a view)
        for rec, original in same:
            if pending is not None and (id(original) in pending or id(original) in kept):
                keep.append((rec, original))
                kept.add(id(rec))
                continue
            rec.md5, rec.fingerprint, rec.stats = original.md5, original.fingerprint, original.stats
            rec.hash_note, rec.sharding = original.hash_note, original.sharding
        if keep:
            with self._lock:
                self._same[:0] = keep

    def _submit_wrapped(self, rec: TensorRecord, t: torch.Tensor) -> None:
        """A tensor met while a torch.func transform runs (the transforms are off): the plain
        tensor it wraps is hashed, with a note where that is not the tensor's own value (vmap's
        whole batch)."""
        plain, note = unwrap(t)
        if plain is None:
            rec.hash_note = f"not hashed: {note}"
            return
        reason = unhashable_reason(plain)
        if reason is not None:
            rec.hash_note = f"not hashed: {reason}"
            return
        try:
            self._submit_slow(rec, plain)
        except RuntimeError as exc:
            rec.hash_note = f"not hashed: {_first_line(exc)}"
            return
        if note is not None:
            rec.hash_note = note

    def _submit_slow(self, rec: TensorRecord, t: torch.Tensor) -> None:
        """Every tensor the batched CUDA path did not take."""
        on_cpu = t.is_cpu
        if on_cpu and not self._interpret:
            if t.numel() == 1 and self._submit_scalar(rec, t):
                return
            # On the CPU reading a result costs no sync: stats now, from the tensor itself
            # (no snapshot), with the cheap all-finite path.
            if self.want_stats:
                rec.stats = cpu_stats(t)
            self._checksum_cpu(rec, t)
            return
        if not on_cpu and torch.cuda.is_current_stream_capturing():
            rec.hash_note = "not hashed: CUDA graph capture in progress"
            self.capturing_skipped += 1
            return
        fast = self.algorithm == "fast"
        if (self.want_stats or fast) and t.numel():
            fused = self._fused if self._fused_tried else self._make_fused()
            if fused is None or not fused.add(rec, t):
                self._submit_torch(rec, t, self.want_stats, fast)
        elif fast:  # empty: nothing to read
            rec.fingerprint = fp.finish(0, 0, 0)
        if self.algorithm == "md5":
            self._submit_md5(rec, t)

    def _checksum_cpu(self, rec: TensorRecord, t: torch.Tensor) -> None:
        """The checksum of a plain CPU tensor (its stats are done): MD5 inline or on the pool,
        the fast fingerprint now or batched."""
        if self.algorithm == "md5":
            self._submit_md5(rec, t)
        elif self.algorithm == "fast":
            if t.numel() * t.element_size() <= TINY_BYTES:
                rec.fingerprint = _tiny_fingerprint(t)
            else:
                if self._host_fp is None:
                    self._host_fp = HostFingerprints()
                self._host_fp.add(rec, t)

    @own_work
    def submit_many(self, items: list[tuple[TensorRecord, torch.Tensor]]) -> None:
        """``submit`` of each (record, tensor), with the stats of small CPU float32 tensors of one
        size computed together (``cpu_stats_same_size``; one-element ones from one stacked read
        of their values). The recorder hands over a call's new values this way when there are
        many: an optimizer step's parameters and state, a foreach op's outputs."""
        if not self.active:
            return
        if len(items) >= LIST_MIN and self.algorithm != "md5" and not transforms_active():
            items = self._read_list(items)
        if not self.want_stats or self._interpret or len(items) < BATCH_MIN or transforms_active():
            for rec, t in items:
                self.submit(rec, t)
            return
        by_size: dict[int, list[tuple[TensorRecord, torch.Tensor]]] = {}
        rest: list[tuple[TensorRecord, torch.Tensor]] = []
        for rec, t in items:
            # What submit's CPU path would take, float32 and contiguous (a view that is is
            # read as it is: the stack copies its values in order).
            n = t.numel()
            if type(t) in ALLOWED_TYPES and t.dtype is _F32 and t.is_cpu and t.layout is _STRIDED \
                    and not t.is_nested and 0 < n <= BATCH_MAX_ELEMS and t.is_contiguous() and not t.is_neg():
                group = by_size.get(n)
                if group is None:
                    by_size[n] = [(rec, t)]
                else:
                    group.append((rec, t))
            else:
                rest.append((rec, t))
        for n, group in by_size.items():
            if len(group) < BATCH_MIN_GROUP:
                rest.extend(group)
                continue
            ts = [t for _, t in group]
            try:
                if n == 1:
                    stats: list[Stats | None] = [scalar_stats(v) for v in one_element_values(ts)]
                else:
                    stats = cpu_stats_same_size(ts)
            except RuntimeError:  # (a storage freed under a tensor, as submit's own guard)
                rest.extend(group)
                continue
            for (rec, t), st in zip(group, stats):
                if st is None:  # a NaN or Inf scalar: the general path counts it
                    rest.append((rec, t))
                elif n == 1:
                    self._scalar_checksum(rec, t)
                    rec.stats = st
                else:
                    rec.stats = st
                    self._checksum_cpu(rec, t)
        for rec, t in rest:
            self.submit(rec, t)

    def _read_list(self, items: list[tuple[TensorRecord, torch.Tensor]]) -> list[tuple[TensorRecord, torch.Tensor]]:
        """The plain device tensors of ``items`` read now through one plan of the list
        (``Fused.read_now``: a fraction of ``add``'s host time per tensor, nothing held);
        returns the items left for ``submit`` (all of them where no plan can read the list).
        Under the interpreter (tests) CPU tensors take this path, as they take ``add``.

        As with ``add``, the tensors are taken to be made on the current stream (the kernels are
        queued there, behind their producers); unlike ``add`` nothing holds them: the caching
        allocator hands their memory, if they are freed, only to later work of that stream."""
        split = self._listable(items)
        if split is None:
            return items
        fused, listed, rest = split
        if not fused.read_now([rec for rec, _ in listed], [t for _, t in listed]):
            return items
        return rest

    @own_work
    def read_ahead(self, items: list[tuple[TensorRecord, torch.Tensor]]) -> list[tuple[TensorRecord, torch.Tensor]]:
        """Read ``items`` now, through plans of the list (``Fused.read_listed``), where the batched
        device path is how they would be read; returns the items read. Nothing is done for the
        others (nor for any where no plan reads them, the MD5 path, a transform): the caller
        submits those as usual when their records are made.

        For values a step is likely to write in place before the batch that would hold them
        launches (a model's parameters and buffers: a batch norm's running statistics are
        written by the very call that first reads them): each write into a waiting value costs
        a snapshot copy (``Fused.protect``), and each such value an ``add``."""
        if not self.active or self.algorithm == "md5" or transforms_active():
            return []
        split = self._listable(items)
        if split is None:
            return []
        fused, listed, _ = split
        return [listed[i] for i in fused.read_listed([rec for rec, _ in listed], [t for _, t in listed])]

    def _listable(self, items: list[tuple[TensorRecord, torch.Tensor]],
                  ) -> tuple[Fused, list[tuple[TensorRecord, torch.Tensor]], list[tuple[TensorRecord, torch.Tensor]]] \
            | None:
        """The batched path and ``items`` split into the plain device tensors a list plan may
        read (CPU ones under the interpreter) and the rest; None where no list is read: fewer
        than ``LIST_MIN`` of them, a CUDA graph being captured, no batched path."""
        listed: list[tuple[TensorRecord, torch.Tensor]] = []
        rest: list[tuple[TensorRecord, torch.Tensor]] = []
        interpret = self._interpret
        for item in items:
            t = item[1]
            if type(t) in ALLOWED_TYPES and t.layout is _STRIDED and (t.is_cpu if interpret else t.is_cuda) \
                    and not t.is_quantized and not t.is_nested:
                listed.append(item)
            else:
                rest.append(item)
        if len(listed) < LIST_MIN or (not interpret and _capturing()):
            return None
        # (made only now: a CPU program's lists must not load Triton)
        fused = self._fused if self._fused_tried else self._make_fused()
        return None if fused is None else (fused, listed, rest)

    def _scalar_checksum(self, rec: TensorRecord, t: torch.Tensor) -> None:
        """The checksum of a one-element CPU tensor, from its bytes."""
        if self.algorithm != "none":
            data = ctypes.string_at(t.data_ptr(), t.element_size())
            if self.algorithm == "md5":
                rec.md5 = hashlib.md5(data).hexdigest()
            else:
                rec.fingerprint = _small_fingerprint(data)

    def _submit_scalar(self, rec: TensorRecord, t: torch.Tensor) -> bool:
        """A one-element CPU tensor (an optimizer's step count: hundreds per step) read straight
        from its bytes and its value, instead of the half-dozen torch calls of the general path.
        Gives exactly what that path gives; False (nothing done) where it cannot."""
        if t.dtype not in SCALAR_DTYPES or t.is_neg() or t.is_conj():
            return False
        value = t.item()
        if self.want_stats:
            stats = scalar_stats(value)
            if stats is None:  # NaN or Inf: the general path counts them
                return False
            rec.stats = stats
        self._scalar_checksum(rec, t)
        return True

    def _make_fused(self) -> Any:
        self._fused_tried = True
        if triton_usable():
            self._fused = Fused(stats=self.want_stats, fingerprint=self.algorithm == "fast",
                                interpret=self._interpret)
        return self._fused

    def _submit_torch(self, rec: TensorRecord, t: torch.Tensor, stats: bool, fast: bool) -> None:
        """The per-tensor path: a dozen torch kernels per tensor, results left on the device."""
        row = reduce_one(stats_input(t)) if stats else None  # type: ignore[arg-type]
        sums = None
        if fast:
            sums = fp.lane_sums(t)
        with self._lock:
            if row is not None:
                self._stat_rows.append((rec, row))
            if sums is not None:
                self._fingerprints.append((rec, sums, t.numel() * t.element_size()))

    @property
    def holds_tensors(self) -> bool:
        """Whether tensors wait in batches that hold them (``fused``: CUDA), until launched."""
        return self._fused is not None and self._fused.has_waiting

    def _waiting_batches(self) -> Any:
        """The batches (``Fused``) when tensors wait in them and may be read or copied now: None
        without any, and while a CUDA graph is captured (nothing may run in it)."""
        fused = self._fused
        if fused is None or not fused.has_waiting or (torch.cuda.is_initialized() and _capturing()):
            return None
        return fused

    @own_work
    def let_go(self, taken: list[torch.Tensor], into_grad: bool = False) -> None:
        """Autograd takes ``taken`` next, so no waiting batch may hold them: the engine sums a
        gradient into another in place only where nobody else holds it or its storage (its
        input buffers), and a leaf's accumulator keeps the gradient itself as ``.grad`` only
        when nobody else holds it. Held there, the program got other ``.grad`` tensors, other
        version counters and more memory than without the trace (see ``Graph.let_go_after``).
        The batches keep copies of them instead (``Fused.release``) and go on filling; for an
        accumulator (``into_grad``), whose test is on the tensor alone, they keep aliases of
        their storage, with no copy (``Fused.hold_storage_only``)."""
        fused = self._waiting_batches()
        if fused is None:
            return
        with transforms_off():
            if into_grad:
                fused.hold_storage_only(taken)
            else:
                fused.release(taken)

    @own_work
    def before_free(self, storage: Any) -> None:
        """``storage`` is about to be resized, which frees its memory (FSDP frees an unsharded
        parameter's storage with ``resize_(0)`` once its layer is done; a growing resize moves
        the bytes): values still waiting for their checksum in those bytes are read first (a
        snapshot on the current stream, before the memory can serve anything else; see
        ``Fused.protect``). Nothing a per-tensor read queued is affected: it was queued before."""
        fused = self._waiting_batches()
        if fused is None:
            return
        try:
            start, size = int(storage.data_ptr()), int(storage.nbytes())
        except (RuntimeError, AttributeError):  # no memory to read the address of: be safe
            with transforms_off():
                fused.flush()
            return
        if start and size:
            with transforms_off():
                fused.protect_spans([(start, start + size)])

    @own_work
    def flush(self) -> None:
        """Launch the batched kernels for every waiting tensor (no sync). The recorder calls this
        before code that may change a recorded tensor in place."""
        if self._fused is not None:
            with transforms_off():
                self._fused.flush()

    @own_work
    def before_write(self, written: list[torch.Tensor] | None = None) -> None:
        """Called by the recorder before code that may write into tensors it recorded (an op that
        writes an argument, a custom Function, backward, the optimizer step): every tensor still
        waiting for its checksum or stats is read first, on every stream (no host sync).

        ``written``: the tensors the code is known to write (an op's schema says which), when it
        writes nothing else. Then only waiting tensors whose bytes they share are read first,
        and most of those by a snapshot instead of a launch (``Fused.protect``): an in-place op
        no longer cuts every waiting batch short."""
        fused = self._fused
        if fused is None and not self._copy_events:
            return
        if transforms_active():
            with transforms_off():
                self._before_write(fused, written)
        else:
            self._before_write(fused, written)

    def _before_write(self, fused: Any, written: list[torch.Tensor] | None) -> None:
        if torch.cuda.is_initialized() and _capturing():
            # Nothing runs while a CUDA graph is captured (the writes happen at replay), and a
            # launch or a wait on uncaptured work would break the capture: later.
            return
        if fused is not None and fused.has_waiting:
            if written is None:
                fused.flush()
            else:
                fused.protect(written)
        if self._copy_events or (fused is not None and fused.events):
            self._order_after_reads()

    def _order_after_reads(self) -> None:
        """Make the current stream of each device wait until our reads of its tensors (MD5 copies,
        stats kernels) that were queued on *other* streams have run. A read queued on the
        current stream is already ordered before whatever the current stream runs next."""
        events = list(self._copy_events.items())
        if self._fused is not None:
            events += self._fused.take_events()
        self._copy_events.clear()
        for (device, stream), event in events:
            current = torch.cuda.current_stream(device)
            if current.cuda_stream != stream:
                current.wait_event(event)

    def _pool_get(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="gradtrace-md5")
        return self._pool

    def _submit_md5(self, rec: TensorRecord, t: torch.Tensor) -> None:
        b = as_bytes(t)
        n = b.numel()
        if b.device.type == "cpu":
            if n <= INLINE_BYTES:
                rec.md5 = hashlib.md5(host_bytes(b)).hexdigest()
                return
            # Snapshot: the caller may change the tensor in place right after this call. (``b``
            # is a view of ``t`` exactly when it starts at t's first byte: a copy is a new
            # allocation. Not compared by storages: see tracer.record.tensors.storage_key.)
            snap = b.clone() if b.data_ptr() == t.data_ptr() else b
            self._reserve(n)
            fut = self._pool_get().submit(_md5_host, snap, None)
        else:
            self._reserve(n)
            host, event = self._copy_to_host(b)
            fut = self._pool_get().submit(_md5_host, host, event)
        with self._lock:
            self._jobs.append((rec, fut, n))
            self._inflight += n

    def _copy_to_host(self, b: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Queue a copy of ``b``'s bytes into pinned host memory, on the current stream: after the
        op that made them, and before anything that stream runs next, so a later in-place write
        (``relu_``, a residual ``add_``, the optimizer) cannot reach the bytes first. Copying on
        a side stream, ordered only after the producer, raced with such writes. The copy is not
        waited for here; a worker thread waits on its event and hashes."""
        dev = b.device
        stream = torch.cuda.current_stream(dev)
        host = torch.empty(b.numel(), dtype=torch.uint8, device=HOST, pin_memory=True)
        host.copy_(b, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        # A writer on another stream is ordered after this copy by before_write().
        self._copy_events[(dev, stream.cuda_stream)] = event
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
    @own_work
    def drain(self, wait: bool = False, on_bytes: Callable[[int], None] | None = None) -> None:
        """Fill in finished checksums and stats: all of them if ``wait`` (one fetch per device,
        the only synchronisation), else those whose kernels or copies have already finished.
        ``on_bytes`` hears the size of each MD5 job collected (a progress bar)."""
        if transforms_active():  # a streamed file's flush inside torch.func.grad/vmap...
            with transforms_off():
                self._drain(wait, on_bytes)
        else:
            self._drain(wait, on_bytes)
        if self._same:
            self._fill_same(None if wait else self._pending_originals())

    def _drain(self, wait: bool, on_bytes: Callable[[int], None] | None = None) -> None:
        finish, hex_of = fp.finish, fp.hex_of
        if wait and self._host_fp is not None:
            self._host_fp.flush()
        fused = self._fused
        if fused is not None:
            fused.flush()
            want_stats, want_fp = fused.stats, fused.fingerprint
            isfinite = math.isfinite
            # Thousands of rows at the end of a block: one Stats object and one hex string per
            # row, shared by the records (views) of that row.
            for slots, res_f, res_i in fused.take(wait):
                for recs, (lo, hi, mean, absmax), (nan, inf, lane_a, lane_b) in zip(slots, res_f, res_i):
                    stats = (Stats(lo, hi, mean, absmax, nan, inf) if isfinite(lo)
                             else Stats(None, None, None, None, nan, inf)) if want_stats else None
                    digest = hex_of(lane_a, lane_b) if want_fp else None
                    for rec in recs:
                        if want_stats:
                            rec.stats = stats
                        if want_fp:
                            rec.fingerprint = digest
        if wait:
            with self._lock:
                rows, self._stat_rows = self._stat_rows, []
                fps, self._fingerprints = self._fingerprints, []
            for recs_rows in _by_device(rows):
                values = torch.stack([r for _, r in recs_rows]).cpu().tolist()  # one fetch
                for (rec, _), row in zip(recs_rows, values):
                    rec.stats = stats_from_row(row)
            for recs_fps in _by_device([(rec, sums) for rec, sums, _ in fps]):
                values = torch.stack([s for _, s in recs_fps]).cpu().tolist()
                sizes = {id(rec): n for rec, _, n in fps}
                for (rec, _), (a, b) in zip(recs_fps, values):
                    rec.fingerprint = finish(a, b, sizes[id(rec)])
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
            if on_bytes is not None:
                on_bytes(size)

    def queued_bytes(self) -> int:
        """Bytes of MD5 work queued and not yet collected: what ``close`` may wait for."""
        with self._lock:
            return self._inflight

    def pending(self) -> set[int]:
        waiting = self._pending_originals()
        with self._lock:
            waiting.update(id(rec) for rec, original in self._same)
        return waiting

    def _pending_originals(self) -> set[int]:
        with self._lock:
            waiting = {id(r) for r, _, _ in self._jobs} | {id(r) for r, _, _ in self._fingerprints}
            waiting.update(id(r) for r, _ in self._stat_rows)
        if self._host_fp is not None:
            waiting.update(id(r) for r in self._host_fp.pending())
        if self._fused is not None:
            waiting.update(self._fused.pending())
        return waiting

    def close(self, on_bytes: Callable[[int], None] | None = None) -> None:
        self.drain(wait=True, on_bytes=on_bytes)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def abandon(self) -> None:
        """Drop all queued work without waiting for it (after ``close`` failed): a later
        ``drain`` or ``close`` finds nothing to do, and nothing queued holds a tensor."""
        with self._lock:
            self._jobs.clear()
            self._inflight = 0
            self._stat_rows = []
            self._fingerprints = []
            self._same = []
        self._host_fp = None
        self._fused = None
        self._fused_tried = True  # not made again
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def one_element_values(ts: list[torch.Tensor]) -> list[float]:
    """The values of one-element tensors, read together: one stack when they have one shape (an
    optimizer's step counters are all zero-dim, which ``torch.cat`` refuses), else one
    concatenation of flat views."""
    try:
        return torch.stack(ts).tolist() if ts[0].dim() == 0 else torch.cat(ts).view(-1).tolist()
    except RuntimeError:  # shapes mixed: () and (1,), (1, 1)...
        return torch.cat([t.reshape(1) for t in ts]).tolist()


@functools.lru_cache(maxsize=4096)
def _small_fingerprint(data: bytes) -> str:
    """The fingerprint of a few bytes in plain Python; the same few values (step counts) recur."""
    return fp.fingerprint_reference(data)


def _tiny_fingerprint(t: torch.Tensor) -> str:
    """A few bytes' fingerprint (scalars such as an optimizer's step count) in plain Python,
    which beats any torch op."""
    b = as_bytes(t)  # alive while its bytes are read
    return _small_fingerprint(bytes(host_bytes(b)))


def _by_device(items: list[tuple[TensorRecord, torch.Tensor]]) -> list[list[tuple[TensorRecord, torch.Tensor]]]:
    groups: dict[torch.device, list[tuple[TensorRecord, torch.Tensor]]] = {}
    for rec, value in items:
        groups.setdefault(value.device, []).append((rec, value))
    return list(groups.values())


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _md5_host(buf: torch.Tensor, event: Any) -> str:
    if event is not None:
        event.synchronize()
    return hashlib.md5(host_bytes(buf)).hexdigest()
