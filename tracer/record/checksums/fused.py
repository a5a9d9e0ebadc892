"""Stats and fast fingerprints of many CUDA tensors per kernel launch (Triton).

A training step makes thousands of tensors; one launch each would cost more CPU time than the
step itself. So tensors wait in a batch (per device, dtype and stream) and one kernel reads
them all: each tensor gets one program per 256 KiB (at most ``MAX_PROGRAMS``), every program
reads its bytes once and writes partial stats and partial fingerprint lane sums, and a second,
tiny kernel folds the partials into one row per tensor. Nothing synchronises: rows stay on the
device until the trace fetches them all at its end.

While a tensor waits, its bytes must not change and its memory must not be reused:
- the batch holds a reference to every waiting tensor (freeing one would let the caching
  allocator hand its block to a later op that runs before our kernel). Never a gradient that
  autograd takes next (``Hasher.let_go``): a leaf's accumulator keeps a gradient as ``.grad``,
  and an input buffer sums another into it in place, only when nobody else holds it (its
  tensor, its storage); a held reference changed what the program got (other ``.grad``
  tensors and version counters, more memory). Such a gradient is snapshotted (``release``):
  the batch keeps a copy instead and keeps filling (a launch there, hundreds a step, cost
  more host time than the rest of a step's batching);
- the recorder calls ``flush`` before any call that may write anything (custom Functions,
  ``out=``, ops whose writes no schema names) and around backward passes and custom backward
  code; before an op whose schema names what it writes (in-place ops, batch norm's running
  stats) it calls ``protect`` with those tensors, which snapshots the waiting tensors they
  reach. So no recorded code can change a waiting tensor, and an in-place op does not cut every
  batch short (on Llama-style and ResNet-50 steps that was a launch for nearly every op);
- a batch is flushed when it holds ``MAX_TENSORS`` tensors or ``DEFAULT_MAX_BYTES`` bytes
  (``max_bytes`` in ``Fused``), which bounds the memory kept alive.

A list of tensors read again and again (the step log's parameters and gradients, every
optimizer step) takes a ``Plan`` instead (``Fused.plan``, ``Fused.launch``): its metadata is
built and copied to the device once, and each later reading checks that every tensor still lies
where it lay, then launches at once (nothing waits in a batch, nothing is held).

The kernel implements exactly ``tracer.record.checksums.fingerprint`` (tests compare it with the Python
reference) and the stats of ``tracer.record.checksums.hasher.stats_tensor``: min, max, absmax and the sum over
finite values (float32 for 16-bit floats, float64 for 64-bit and 32-bit integer types), NaN and
finite counts. The sum is reduced in a fixed order, so the same bytes give the same mean.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import ctypes
import functools
import importlib.util
import operator
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tracer.model import TensorRecord
from tracer.record.checksums.launcher import WARMUP, FastLaunch, fast_launcher
from tracer.record.checksums.prewarm import triton_switched_off
from tracer.record.own_work import HOST
from tracer.record.tensors import storage_start

# Tuned on an H200 with benchmarks/fused_kernel.py: 8 KiB steps and 256 KiB per program read
# 1.23 TB/s with stats and fingerprints together, against 0.95 TB/s for 4 KiB and 64 KiB (8 warps
# or 16 KiB steps were slower: the per-thread accumulators spill).
CHUNK_BYTES = 8192  # bytes one program reads per loop step
NUM_WARPS = 4
BYTES_PER_PROGRAM = 256 * 1024
MAX_PROGRAMS = 8192  # per tensor: a large tensor is spread over every SM, in short loops
MAX_TENSORS = 512  # per batch
DEFAULT_MAX_BYTES = 2 << 30  # bytes a batch keeps alive before it is flushed
# Bytes of snapshots (copies made by ``protect``/``release``) a batch may hold: beyond this it is
# launched instead, so the GPU memory a trace adds stays small beside the step's own.
SNAPSHOT_MAX_BYTES = 256 << 20
# Plans read_now keeps, most recently used first (an optimizer's lists before and after its
# step, of a few optimizers): a list that matches none gets a new plan, the oldest are dropped
# past this many or past this many bytes of device buffers (a plan holds 64 bytes per 256 KiB it
# reads: ~20 MiB for the state of a 7B-parameter model under AdamW).
LIST_PLANS_KEPT = 16
LIST_PLANS_MAX_BYTES = 64 << 20
# Stats alone read a non-contiguous tensor that fills a span of memory where it lies (False:
# packed like any other; benchmarks/lever_ab.py turns it off to measure what it saves).
READ_DENSE_IN_PLACE = True
# A gradient a leaf's accumulator takes is held through an alias of its storage, not copied
# (False: copied like a summed one; benchmarks/lever_ab.py turns it off to measure it).
ALIAS_INTO_GRAD = True
_LOG2_MAX_TENSORS = 10  # binary-search steps over a batch's tensors (2^10 > MAX_TENSORS)
_PBLOCK = 1024  # partial rows the finalize kernel folds per step

# torch dtype -> (Triton element type name, element size, accumulate in float64)
_SPECS: dict[torch.dtype, tuple[str, int, bool]] = {
    torch.float32: ("float32", 4, False), torch.float16: ("float16", 2, False),
    torch.bfloat16: ("bfloat16", 2, False), torch.float64: ("float64", 8, True),
    torch.int64: ("int64", 8, True), torch.int32: ("int32", 4, True), torch.int16: ("int16", 2, False),
    torch.int8: ("int8", 1, False), torch.uint8: ("uint8", 1, False), torch.bool: ("uint8", 1, False),
}
_COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def triton_usable() -> bool:
    """Triton importable and not switched off (``GRADTRACE_TRITON=0``)."""
    if triton_switched_off():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def kernels(interpret: bool = False) -> tuple[Any, Any]:
    """The two kernels, built once per process. ``interpret`` loads a second copy of the kernel
    module under Triton's CPU interpreter (tests on machines without a GPU); Triton reads
    ``TRITON_INTERPRET`` when the kernels are decorated, i.e. at import."""
    if not interpret:
        from tracer.record.checksums import triton_kernels as mod  # imports triton
    else:
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            path = os.path.join(os.path.dirname(__file__), "triton_kernels.py")
            spec = importlib.util.spec_from_file_location("tracer.record.checksums.triton_kernels_interpreted", path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        finally:
            if saved is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return mod.partials, mod.finalize


# Compiled ahead when a trace starts on a GPU, commonest first (the others compile on first use).
WARM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def warm_up(index: int, stats: bool, fingerprint: bool) -> list[tuple[int, torch.dtype, bool, bool]]:
    """Compile the kernels of the common dtypes for CUDA device ``index`` on a background thread
    (``launcher.Warmup``); their tensors take the torch path until they are ready. Returns the
    warm-up's keys (none where Triton is not usable)."""
    if not triton_usable():
        return []
    # Keyed by what the kernels are compiled for: a later trace with other options warms its own.
    keys = [(index, dtype, stats, fingerprint) for dtype in WARM_DTYPES]
    WARMUP.start(index, [(key, functools.partial(_compile, *key)) for key in keys])
    return keys


def _compile(index: int, dtype: torch.dtype, stats: bool, fingerprint: bool) -> dict[tuple[Any, ...], Any]:
    """The compiled kernels one batch of ``dtype`` launches, under the keys ``Fused._launch`` uses
    (aligned tensors: the common case). Torch dtypes stand in for the pointer arguments (Triton
    takes them as 16-byte aligned, as every buffer ``_launch`` passes is), and the batch's size
    is 3: an integer Triton does not specialise on, so the kernel serves every size."""
    import triton.language as tl  # an optional dependency, loaded with the kernels

    partials, finalize = kernels()
    name, esize, wide = _SPECS[dtype]
    ptrs = (torch.int64, torch.float64, torch.int64)
    compiled_p = partials.warmup(*ptrs, 3, EDT=getattr(tl, name), ESIZE=esize, ACC=tl.float64 if wide else tl.float32,
                                 STATS=stats, FP=fingerprint, SQ=False, CHUNK=CHUNK_BYTES, LOG2B=_LOG2_MAX_TENSORS, ALIGNED=True,
                                 num_warps=NUM_WARPS, grid=(1,))
    compiled_f = finalize.warmup(*ptrs, torch.float64, torch.int64, esize, PBLOCK=_PBLOCK, grid=(1,))
    for compiled in (compiled_p, compiled_f):
        # Load each onto the device here too (Triton otherwise does it at the first launch, on
        # the training thread; FastLaunch calls the same idempotent method where it exists).
        load = getattr(compiled, "_init_handles", None)
        if callable(load):
            load()
    return {("partials", index, name, esize, wide, stats, fingerprint, False, True): compiled_p,
            ("finalize", index): compiled_f}


# CUDA devices whose fetch kernels ``Fused.prepare`` has loaded in this process.
_FETCH_LOADED: set[int] = set()


def _int_class(n: int) -> int:
    """What Triton's specialisation reads off an integer argument: 1, a multiple of 16, or neither."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


_P_CONSTEXPRS = ("EDT", "ESIZE", "ACC", "STATS", "FP", "SQ", "CHUNK", "LOG2B", "ALIGNED")
_F_CONSTEXPRS = ("PBLOCK",)
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_get_device = torch.Tensor.get_device
_is_contiguous = torch.Tensor.is_contiguous
_is_neg = torch.Tensor.is_neg
_dtype_of = operator.attrgetter("dtype")


# read_now's plans, shared by every trace of the process: ((length, stats, fingerprint, squares,
# interpret), plan), most recently used first.
_LIST_PLANS: list[tuple[tuple[int, bool, bool, bool, bool], Plan]] = []
_LIST_PLANS_LOCK = threading.Lock()


def _drop_old_plans() -> None:
    """Keep the newest plans within ``LIST_PLANS_KEPT`` and ``LIST_PLANS_MAX_BYTES`` (the newest
    one always: it is about to be launched)."""
    total = 0
    for i, (_, plan) in enumerate(_LIST_PLANS):
        total += plan.device_bytes
        if i and (i >= LIST_PLANS_KEPT or total > LIST_PLANS_MAX_BYTES):
            del _LIST_PLANS[i:]
            return


class _PlanLaunch:
    """One launch pair of a plan: rows ``first`` to ``first + k`` (one dtype, at most
    ``MAX_TENSORS``), every argument ready."""

    __slots__ = ("aligned", "f_args", "f_key", "first", "k", "p_args", "p_key", "programs", "warm_key")

    def __init__(self, first: int, k: int, programs: int, aligned: bool, p_key: tuple[Any, ...],
                 p_args: tuple[Any, ...], f_key: tuple[Any, ...], f_args: tuple[Any, ...],
                 warm_key: tuple[int, torch.dtype, bool, bool]) -> None:
        self.first, self.k, self.programs, self.aligned = first, k, programs, aligned
        self.p_key, self.p_args, self.f_key, self.f_args = p_key, p_args, f_key, f_args
        self.warm_key = warm_key


class Plan:
    """The launches that read one list of tensors: made once (``Fused.plan``), then launched
    again (``Fused.launch``) after each ``Fused.follow`` of the list's tensors of the moment.

    The step log reads the same tensors at every optimizer step: the parameters, which never
    move, and their gradients, which the caching allocator mostly hands the same blocks step
    after step. ``add`` per tensor (about 2 µs of host time: a dict, a sorted list, a metadata
    row), the metadata's copy to the device and the buffers are then paid once; a reading
    checks a few facts per tensor (one ``map`` of a C method each, about 0.1 µs a tensor) and
    launches. Tensors that moved (gradients the allocator placed elsewhere) only change the
    addresses in the metadata: one small copy to the device.

    ``rows``: the result rows (tensors with the same bytes share one); ``row_of[i]``: tensor
    ``i``'s row. The results of a launch are one int64 tensor of ``8 * rows`` values: each
    row's four integers (NaN count, finite count, lane A, lane B), then each row's four floats
    (min, max, sum or sum of squares, absmax) as float64 bits. It is the same tensor at every
    launch: the next launch overwrites it, on the same stream, so a copy queued before that
    (a non-blocking copy right after the launch) reads this launch's results."""

    __slots__ = ("device_bytes", "devices", "dtypes", "index", "launches", "meta", "meta_dev", "numels", "out",
                 "ptrs", "reps", "row_of", "rows", "stream")

    def __init__(self, ptrs: list[int], dtypes: list[torch.dtype], numels: list[int], devices: list[int],
                 index: int, stream: int) -> None:
        self.ptrs, self.dtypes, self.numels, self.devices = ptrs, dtypes, numels, devices
        self.index = index
        self.stream = stream
        self.row_of: list[int] = []
        self.reps: list[int] = []  # per row: the first tensor it reads
        self.rows = 0
        self.meta = array.array("q")  # as in a batch: addr, numel, programs, first program; per row
        self.meta_dev: torch.Tensor | None = None
        self.launches: list[_PlanLaunch] = []
        self.out: torch.Tensor | None = None
        self.device_bytes = 0  # of its buffers on the device (metadata, partial rows, results)


class _Batch:
    __slots__ = ("aligned", "by_addr", "copied", "dtype", "held", "meta", "nbytes", "programs", "slots", "spec",
                 "starts", "stream")

    def __init__(self, dtype: torch.dtype, spec: tuple[str, int, bool], stream: Any) -> None:
        self.dtype = dtype
        self.spec = spec
        self.stream = stream
        # addr, numel, programs, first program: four per tensor. An int64 array: the launch
        # hands its buffer to torch without converting a Python list element by element.
        self.meta = array.array("q")
        self.slots: list[list[TensorRecord]] = []  # records sharing each tensor's row
        self.held: list[torch.Tensor] = []  # keeps the bytes alive until the kernel has run
        self.by_addr: dict[tuple[int, int], int] = {}
        # (first byte, slot) of every waiting tensor, sorted: which ones a write reaches is a
        # binary search (``Fused.protect`` runs before every in-place op).
        self.starts: list[tuple[int, int]] = []
        self.programs = 0
        self.nbytes = 0
        self.copied = 0  # bytes of the snapshots held (Fused._snapshot)
        self.aligned = True  # every tensor starts on a 16-byte boundary (allows wide loads)


class _PinnedSlots:
    """Pinned host buffers for the batches' metadata, reused once the copy out of them is done.

    ``pin_memory()`` per launch took ~100 µs of host time once batches held hundreds of
    tensors (the caching host allocator cannot hand back a block whose copy may still be
    queued). Here a slot is reused when the event recorded after its batch's kernels has
    completed, which is long before the ring comes round again; a busy slot is skipped."""

    SLOTS = 16
    SLOT_WORDS = MAX_TENSORS * 4  # a full batch's metadata

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._next = 0
        self._refused = False

    def allocate(self) -> bool:
        """Pin the buffers if not done yet; False where pinning is refused."""
        if self._buffers or self._refused:
            return not self._refused
        try:
            # Normal tensors even under torch.inference_mode: every later batch writes into them.
            with torch.inference_mode(False):
                self._buffers = [torch.empty(self.SLOT_WORDS, dtype=torch.int64, device=HOST, pin_memory=True)
                                 for _ in range(self.SLOTS)]
        except RuntimeError:  # pinning refused: the caller's path, from now on
            self._refused = True
            return False
        self._events = [None] * self.SLOTS
        return True

    def stage(self, meta: array.array[int]) -> tuple[torch.Tensor, int] | None:
        """``meta`` copied into a free pinned slot: a view of its first words and the slot's
        index (for ``used_until``), or None."""
        n = len(meta)
        if n > self.SLOT_WORDS or not self.allocate():
            return None
        for _ in range(self.SLOTS):
            i = self._next
            self._next = (i + 1) % self.SLOTS
            event = self._events[i]
            if event is None or event.query():
                buf = self._buffers[i]
                ctypes.memmove(buf.data_ptr(), meta.buffer_info()[0], n * 8)
                self._events[i] = None
                return buf[:n], i
        return None

    def used_until(self, slot: int, event: Any) -> None:
        """The copy out of ``slot`` is done once ``event`` has completed."""
        self._events[slot] = event


class Fused:
    """Batches CUDA tensors and computes their stats and/or fingerprints with Triton."""

    def __init__(self, stats: bool, fingerprint: bool, max_bytes: int | None = None,
                 interpret: bool = False, squares: bool = False) -> None:
        if squares and stats:
            raise ValueError("Fused: squares take the place of the stats' sum; ask for one of them")
        self.stats = stats
        self.fingerprint = fingerprint
        # The sum of each tensor's squared elements in the float results' third column (the step
        # log's L2 norms, read in the fingerprint's pass). Never warmed up: compiled at first use.
        self.squares = squares
        self.max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        self.interpret = interpret
        self._batches: dict[tuple[int, int, torch.dtype], _Batch] = {}
        # Launched batches: the records of each row, the [k, 4] float / [k, 4] int results on the
        # device, and an event marking the kernels' end (None on the CPU).
        self.done: list[tuple[list[list[TensorRecord]], torch.Tensor, torch.Tensor, Any]] = []
        self.launches = 0
        self.fast_launches = 0  # of those, through a cached launcher (launcher.FastLaunch)
        # The last launch's end per (device, stream): a writer on another stream waits for it.
        self.events: dict[tuple[torch.device, int], Any] = {}
        # Per kernel specialisation: its launcher, once a normal launch or the warm-up compiled it
        # (None: compiled, but launched the normal way).
        self._fast: dict[tuple[Any, ...], FastLaunch | None] = {}
        self._pinned = _PinnedSlots()

    def add(self, rec: TensorRecord, t: torch.Tensor) -> bool:
        """Queue ``t`` for ``rec``; False when this path cannot take it (the caller falls back).

        Runs for every tensor a traced step makes (thousands): each tensor attribute read is a
        C call, so each is read once."""
        dtype = t.dtype
        spec = _SPECS.get(dtype)
        if spec is None:
            if dtype not in _COMPLEX or t.is_conj():
                return False
            with torch._C.DisableTorchFunction():
                t = torch.view_as_real(t)
            dtype = t.dtype
            spec = _SPECS[dtype]
        numel = t.numel()
        if not numel or t.is_neg():
            return False
        index = t.get_device()
        if WARMUP.compiling and WARMUP.wanted(warm_key := (index, dtype, self.stats, self.fingerprint)) \
                and not WARMUP.ready(warm_key):
            # Its kernels are still compiling in the background: the torch path. (Waiting for them
            # at the first launch instead was no faster with a warm Triton cache, on GPT-2 small
            # and ResNet-50 on the H200, and 1.6x slower with a cold one. Once Triton's own
            # start-up is done, the trace's start waits for them instead: Hasher.prepare.)
            return False
        addr = t.data_ptr()
        # Stats alone do not depend on the elements' order: a tensor whose elements fill a span
        # of memory exactly (a transposed or permuted layout: a weight's gradient from
        # MmBackward, attention's transposes) is read where it lies. Otherwise (and always for a
        # fingerprint, which reads the logical order) the batch holds a packed copy.
        if (not t.is_contiguous() or (self.fingerprint and addr & 3)) \
                and (self.fingerprint or not READ_DENSE_IN_PLACE or not _fills_its_span(t)):
            with torch._C.DisableTorchFunction():
                t = t.clone(memory_format=torch.contiguous_format)
            addr = t.data_ptr()
        # (device, stream of the producer, dtype), flat: one tuple per tensor, not two.
        key = (index, _stream_handle(index), dtype)
        batch = self._batches.get(key)
        if batch is None:
            stream = torch.cuda.current_stream(t.device) if index >= 0 else None
            batch = self._batches[key] = _Batch(dtype, spec, stream)
        nbytes = numel * spec[1]
        by_addr = batch.by_addr
        slot = by_addr.get((addr, nbytes))
        if slot is not None:  # a view with the same bytes as one already waiting: same row
            batch.slots[slot].append(rec)
            return True
        programs = nbytes // BYTES_PER_PROGRAM
        programs = 1 if programs < 1 else (MAX_PROGRAMS if programs > MAX_PROGRAMS else programs)
        slot = len(batch.slots)
        by_addr[(addr, nbytes)] = slot
        bisect.insort(batch.starts, (addr, slot))
        batch.meta.extend((addr, numel, programs, batch.programs))
        batch.slots.append([rec])
        batch.held.append(t)
        batch.programs += programs
        batch.nbytes += nbytes
        if addr & 15:
            batch.aligned = False
        if len(batch.slots) >= MAX_TENSORS or batch.nbytes >= self.max_bytes:
            with torch._C.DisableTorchFunction():
                self._launch(key)
        return True

    def plan(self, tensors: Sequence[torch.Tensor]) -> Plan | None:
        """A ``Plan`` that reads ``tensors``: plain contiguous non-empty tensors of the kernel's
        dtypes on one device (CUDA; the CPU only under the interpreter), none lazily negated;
        None for any other list (``add`` takes them). Copies the metadata to the device (pinned,
        non-blocking: no synchronisation) and allocates the plan's buffers."""
        if not tensors:
            return None
        try:
            ptrs = list(map(_data_ptr, tensors))
            dtypes = list(map(_dtype_of, tensors))
            numels = list(map(_numel, tensors))
            devices = list(map(_get_device, tensors))
            plain = all(map(_is_contiguous, tensors)) and not any(map(_is_neg, tensors))
        except RuntimeError:  # no data pointer (sparse, a freed storage)
            return None
        index = devices[0]
        if not plain or any(d != index for d in devices) or (index < 0 and not self.interpret):
            return None
        if any(dtype not in _SPECS for dtype in dtypes) or not all(numels) or not self._readable_at(ptrs):
            return None
        if self._compiling_any(index, dtypes):
            return None
        plan = Plan(ptrs, dtypes, numels, devices, index, _stream_handle(index))
        with torch._C.DisableTorchFunction():
            self._lay_out(plan, tensors[0].device)
        return plan

    def follow(self, plan: Plan, tensors: Sequence[torch.Tensor]) -> bool:
        """Make ``plan`` read ``tensors`` (the list it was made for, as it is now): True when
        each tensor is of the dtype, size and device it was, contiguous and not lazily negated,
        on the plan's stream, and the tensors that shared bytes still do; then the plan reads
        exactly the bytes ``add`` would read. Tensors that moved have their new addresses
        copied to the device (pinned, non-blocking). False: a new plan is needed."""
        if len(tensors) != len(plan.ptrs):
            return False
        try:
            ptrs = list(map(_data_ptr, tensors))
            if not (list(map(_dtype_of, tensors)) == plan.dtypes and list(map(_numel, tensors)) == plan.numels
                    and all(map(_is_contiguous, tensors)) and not any(map(_is_neg, tensors))
                    and list(map(_get_device, tensors)) == plan.devices and _stream_handle(plan.index) == plan.stream):
                return False
        except RuntimeError:  # no data pointer (sparse, a freed storage): not the plan's tensors
            return False
        return ptrs == plan.ptrs or self._move(plan, ptrs)

    def _move(self, plan: Plan, ptrs: list[int]) -> bool:
        """Point ``plan``'s rows at the tensors' new addresses ``ptrs`` (False where a row's
        tensors no longer share their bytes, or an address needs another kernel variant)."""
        addrs = [ptrs[i] for i in plan.reps]
        if [addrs[r] for r in plan.row_of] != ptrs or not self._readable_at(addrs):
            return False
        for launch in plan.launches:
            if launch.aligned != all(not a & 15 for a in addrs[launch.first:launch.first + launch.k]):
                return False
        plan.meta[0::4] = array.array("q", addrs)
        assert plan.meta_dev is not None
        with torch._C.DisableTorchFunction():
            if plan.meta_dev.device.type != "cuda":
                plan.meta_dev.copy_(torch.frombuffer(plan.meta, dtype=torch.int64))
            else:  # queued behind the last launch that read the old addresses (same stream)
                staged = self._pinned.stage(plan.meta)
                if staged is None:
                    plan.meta_dev.copy_(torch.frombuffer(plan.meta, dtype=torch.int64).pin_memory(), non_blocking=True)
                else:
                    plan.meta_dev.copy_(staged[0], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                    self._pinned.used_until(staged[1], event)
        plan.ptrs = ptrs
        return True

    def _readable_at(self, addrs: list[int]) -> bool:
        """Addresses the kernel reads (fingerprints: words, so 4-byte aligned; ``add`` copies the
        others first)."""
        return all(addrs) and not (self.fingerprint and any(a & 3 for a in addrs))

    def _compiling_any(self, index: int, dtypes: list[torch.dtype]) -> bool:
        """Whether the background warm-up is still compiling some of these dtypes' kernels
        (``add`` leaves their tensors to the torch path meanwhile)."""
        if not WARMUP.compiling:
            return False
        for dtype in set(dtypes):
            key = (index, dtype, self.stats, self.fingerprint)
            if WARMUP.wanted(key) and not WARMUP.ready(key):
                return True
        return False

    def _lay_out(self, plan: Plan, dev: torch.device) -> None:
        """The plan's rows (one per distinct bytes, grouped by dtype, ``MAX_TENSORS`` per launch),
        its metadata on the device and its buffers."""
        by_dtype: dict[torch.dtype, dict[tuple[int, int], int]] = {}  # dtype -> (addr, nbytes) -> tensor
        for i, (ptr, dtype, numel) in enumerate(zip(plan.ptrs, plan.dtypes, plan.numels)):
            by_dtype.setdefault(dtype, {}).setdefault((ptr, numel * _SPECS[dtype][1]), i)
        row_of_tensor: dict[int, int] = {}  # the first tensor of each row -> its row
        pieces: list[tuple[torch.dtype, int, int, int, bool]] = []  # dtype, first row, k, programs, aligned
        meta = plan.meta
        for dtype, rows in by_dtype.items():
            keys = list(rows.items())
            esize = _SPECS[dtype][1]
            for start in range(0, len(keys), MAX_TENSORS):
                chunk = keys[start:start + MAX_TENSORS]
                first_row, programs = plan.rows, 0
                for (addr, nbytes), first in chunk:
                    n = min(max(nbytes // BYTES_PER_PROGRAM, 1), MAX_PROGRAMS)
                    meta.extend((addr, nbytes // esize, n, programs))
                    programs += n
                    row_of_tensor[first] = plan.rows
                    plan.reps.append(first)
                    plan.rows += 1
                pieces.append((dtype, first_row, len(chunk), programs, all(not addr & 15 for (addr, _), _ in chunk)))
        plan.row_of = [row_of_tensor[by_dtype[dtype][(ptr, numel * _SPECS[dtype][1])]]
                       for ptr, dtype, numel in zip(plan.ptrs, plan.dtypes, plan.numels)]
        total = sum(p[3] for p in pieces)
        # Normal tensors even under torch.inference_mode: every later launch writes into them.
        with torch.inference_mode(False):
            meta_host = torch.frombuffer(meta, dtype=torch.int64).clone()
            meta_dev = plan.meta_dev = meta_host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" \
                else meta_host
            partials_buf = torch.empty(total * 8, dtype=torch.int64, device=dev)  # ints, then floats
            out = plan.out = torch.empty(plan.rows * 8, dtype=torch.int64, device=dev)
        plan.device_bytes = 8 * (len(meta) + total * 8 + plan.rows * 8)
        part_i_all, part_f_all = partials_buf[:total * 4], partials_buf[total * 4:].view(torch.float64)
        res_i_all, res_f_all = out[:plan.rows * 4], out[plan.rows * 4:].view(torch.float64)
        at = 0  # first partial row of the launch
        for dtype, row, k, programs, aligned in pieces:
            m = meta_dev[row * 4:(row + k) * 4]
            part_f, part_i = part_f_all[at * 4:(at + programs) * 4], part_i_all[at * 4:(at + programs) * 4]
            at += programs
            res_f, res_i = res_f_all[row * 4:(row + k) * 4].view(k, 4), res_i_all[row * 4:(row + k) * 4].view(k, 4)
            p_key, p_args, f_key, f_args = self._kernel_args(plan.index, _SPECS[dtype], aligned, m, part_f, part_i,
                                                             res_f, res_i)
            plan.launches.append(_PlanLaunch(row, k, programs, aligned, p_key, p_args, f_key, f_args,
                                             (plan.index, dtype, self.stats, self.fingerprint)))

    def read_now(self, recs: Sequence[TensorRecord], tensors: Sequence[torch.Tensor]) -> bool:
        """Read ``tensors`` for ``recs`` (one record each) now, through a plan of the list: one
        launch pair per dtype, queued behind the tensors' producers on the current stream, and
        nothing held (no batch keeps them, so no write or gradient handed on has to copy them
        out). False, with nothing done, where no plan can read the list (see ``plan``): the
        caller then ``add``s them one by one.

        For the long lists a recorded call hands over at once (an AdamW step over ResNet-50: its
        161 parameters, their gradients and 322 state tensors before the step, and again after):
        ``add`` costs a few µs of host time per tensor, a plan followed again a fraction of a µs.
        The plans are kept across traces (a trace per step is common), so the next step's list,
        the same tensors or ones of the same dtypes and sizes elsewhere, reuses one
        (``follow``); nothing of a trace is in a plan but the tensors' addresses."""
        key = (len(tensors), self.stats, self.fingerprint, self.squares, self.interpret)
        with _LIST_PLANS_LOCK:  # one launch and its copy at a time: the next overwrites the results
            plan = None
            for i, (known_key, known) in enumerate(_LIST_PLANS):
                if known_key == key and self.follow(known, tensors):
                    plan = known
                    if i:
                        _LIST_PLANS.insert(0, _LIST_PLANS.pop(i))
                    break
            if plan is None:
                plan = self.plan(tensors)
                if plan is None:
                    return False
                _LIST_PLANS.insert(0, (key, plan))
                _drop_old_plans()
            out = self.launch(plan)
            if out is None:  # its kernels are still compiling
                return False
            with torch._C.DisableTorchFunction():
                # The plan's results are overwritten by its next launch: this launch's, copied
                # out behind it on the same stream, are what the records wait for.
                results = out.clone()
                event = None
                if results.device.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                    # As a batch's launch: a write on another stream waits for these reads
                    # (Hasher._order_after_reads), since nothing holds the tensors.
                    self.events[(results.device, plan.stream)] = event
        rows = plan.rows
        slots: list[list[TensorRecord]] = [[] for _ in range(rows)]
        for rec, row in zip(recs, plan.row_of):
            slots[row].append(rec)
        res_i = results[:rows * 4].view(rows, 4)
        res_f = results[rows * 4:].view(torch.float64).view(rows, 4)
        self.done.append((slots, res_f, res_i, event))
        return True

    def read_listed(self, recs: Sequence[TensorRecord], tensors: Sequence[torch.Tensor]) -> list[int]:
        """``read_now`` of those of ``tensors`` a plan can read (contiguous, non-empty, of the
        kernels' dtypes, readable where they lie), one list per device; the positions of the
        ones read. The others are left to the caller, as is everything where no plan reads."""
        by_device: dict[int, list[int]] = {}
        for i, t in enumerate(tensors):
            try:
                if t.dtype in _SPECS and t.is_contiguous() and not t.is_neg() and t.numel() \
                        and self._readable_at([t.data_ptr()]):
                    by_device.setdefault(t.get_device(), []).append(i)
            except RuntimeError:  # no data pointer (a freed storage)
                continue
        read: list[int] = []
        for index, positions in by_device.items():
            if (index >= 0 or self.interpret) and \
                    self.read_now([recs[i] for i in positions], [tensors[i] for i in positions]):
                read += positions
        return read

    def launch(self, plan: Plan) -> torch.Tensor | None:
        """Launch ``plan`` on the current stream (after a ``follow`` of the tensors it reads):
        its results tensor (see ``Plan``), or None while the warm-up is compiling one of its
        kernels (``add`` then takes the tensors). Nothing waits and nothing is held: the kernels
        are queued behind the tensors' producers on their stream."""
        if self._compiling_any(plan.index, plan.dtypes):
            return None
        partials, finalize = kernels(self.interpret)
        with torch._C.DisableTorchFunction():
            for launch in plan.launches:
                self._run(launch.p_key, partials, launch.programs, plan.stream, launch.p_args, _P_CONSTEXPRS,
                          launch.warm_key)
                self._run(launch.f_key, finalize, launch.k, plan.stream, launch.f_args, _F_CONSTEXPRS,
                          launch.warm_key)
        self.launches += 2 * len(plan.launches)
        return plan.out

    def prepare(self, index: int) -> None:
        """First-time work of CUDA device ``index``, done before a step needs it: the metadata's
        pinned buffers, and the CUDA kernels of ``take``'s concatenations, which the first launch
        of each loads (a process's first float64 ``torch.cat`` took 9 ms on an H200). Tiny
        tensors on the current stream, nothing waited for."""
        self._pinned.allocate()
        if index not in _FETCH_LOADED:
            _FETCH_LOADED.add(index)
            for dtype in (torch.float64, torch.int64):
                part = torch.zeros((1, 4), dtype=dtype, device=torch.device("cuda", index))
                torch.cat([part, part])

    def flush(self) -> None:
        """Launch every waiting batch (no sync): afterwards the waiting tensors may change."""
        if not self._batches:
            return
        # Our own tensor ops must not be recorded (flush runs from hooks in user context too).
        with torch._C.DisableTorchFunction():
            for key in list(self._batches):
                self._launch(key)

    def protect(self, written: list[torch.Tensor]) -> None:
        """``written`` are about to change in place: every waiting tensor whose bytes lie in their
        storages is read first. On the current stream it is snapshotted (a copy the batch holds
        instead: one copy kernel, and the batch keeps filling); a batch that runs on another
        stream is launched now (the copy would not be ordered before its kernel), as is a batch
        whose snapshots would hold more than ``SNAPSHOT_MAX_BYTES``.

        A waiting tensor is reached when its first byte lies between the start of a written
        tensor's storage and the end of the written tensor's last element: storages are separate
        allocations, a tensor lies inside its own, and a write stays inside the tensor written.
        (The one waiting tensor that starts just below is checked too, for memory aliased from
        outside torch's allocator, e.g. through DLPack.) Read off the tensors, never through
        ``untyped_storage()``, which would change how autograd treats the program's gradients
        (see ``tracer.record.tensors.storage_key``)."""
        spans = _spans_of(written)
        if spans is None:  # no storage to compare (a wrapper subclass, sparse): be safe
            self.flush()
            return
        self.protect_spans(spans)

    def protect_spans(self, spans: list[tuple[int, int]]) -> None:
        """``protect`` for the byte ``spans`` [start, end) about to change, or to be freed (a
        storage resized: ``Hasher.before_free``)."""
        if not spans:
            return
        with torch._C.DisableTorchFunction():
            for key in list(self._batches):
                batch = self._batches[key]
                hits = _reached(batch, spans)
                if not hits:
                    continue
                # A batch of another stream is launched (a copy here would not be ordered before
                # its kernel), and one whose snapshots would pass their bound.
                esize = batch.spec[1]
                copies = sum(batch.meta[4 * slot + 1] for slot in hits) * esize
                if _stream_handle(key[0]) != key[1] or batch.copied + copies > SNAPSHOT_MAX_BYTES:
                    self._launch(key)
                    continue
                for slot in hits:
                    self._snapshot(batch, slot)
                batch.copied += copies

    def release(self, taken: list[torch.Tensor]) -> None:
        """Autograd is about to take ``taken`` (an input buffer sums into one in place only when
        nobody else holds its tensor or its storage): no waiting tensor in their storages stays
        held. Each is snapshotted as before a write (``protect``), so the batch keeps filling
        instead of launching; the copy holds the bytes as they are now, whatever autograd does
        next. (For a leaf's accumulator, which tests the tensor alone: ``hold_storage_only``.)"""
        self.protect(taken)

    def hold_storage_only(self, taken: list[torch.Tensor]) -> None:
        """A leaf's accumulator takes ``taken`` next: it keeps a gradient itself as ``.grad``
        only when nobody else holds that tensor (its storage may be shared), or adds it into an
        existing ``.grad`` (only reading it). So each waiting tensor in their storages is held
        through a detached alias instead: the same bytes and storage, not the tensor (nor, for a
        view, its base). No copy: the accumulator writes none of these bytes, and any later
        write into them (an in-place op, the next accumulation into that ``.grad``) is protected
        like any other (``protect``). Where a tensor's address cannot be read, copies, as
        ``release``."""
        if not ALIAS_INTO_GRAD:
            self.release(taken)
            return
        spans = _spans_of(taken)
        if spans is None:  # no storage to compare (a wrapper subclass, sparse)
            self.release(taken)
            return
        with torch._C.DisableTorchFunction():
            for batch in self._batches.values():
                held = batch.held
                for slot in _reached(batch, spans):
                    held[slot] = held[slot].detach()

    @staticmethod
    def _snapshot(batch: _Batch, slot: int) -> None:
        """Replace waiting tensor ``slot`` by a copy of its bytes (on the current stream)."""
        old = batch.held[slot]
        # The same layout as the original (clone keeps a dense tensor's strides): contiguous, or
        # dense in another order (add() packed any other layout), so its bytes are one span too.
        copy = old.clone()
        meta = batch.meta
        old_addr = meta[4 * slot]
        nbytes = meta[4 * slot + 1] * batch.spec[1]
        del batch.by_addr[(old_addr, nbytes)]
        starts = batch.starts
        del starts[bisect.bisect_left(starts, (old_addr, slot))]
        addr = copy.data_ptr()
        meta[4 * slot] = addr
        batch.by_addr[(addr, nbytes)] = slot
        bisect.insort(starts, (addr, slot))
        batch.held[slot] = copy

    @property
    def has_waiting(self) -> bool:
        return bool(self._batches)

    def take_events(self) -> list[tuple[tuple[torch.device, int], Any]]:
        """The launches' end events per (device, stream) since the last call."""
        events = list(self.events.items())
        self.events.clear()
        return events

    def _launch(self, key: tuple[int, int, torch.dtype]) -> None:
        batch = self._batches.pop(key)
        if not batch.slots:
            return
        partials, finalize = kernels(self.interpret)
        dev = batch.held[0].device
        k = len(batch.slots)
        # The kernels must run after the tensors' producers: on the stream they were made on
        # (usually the current one: then no stream switch, which costs ~40 µs of host time).
        # Their buffers and the metadata's copy are queued on that stream too, before them.
        index, handle, dtype = key
        warm_key = (index, dtype, self.stats, self.fingerprint)
        ctx = contextlib.nullcontext() if batch.stream is None or _stream_handle(index) == handle \
            else torch.cuda.stream(batch.stream)
        with ctx:
            # Pinned and non-blocking: a pageable copy would synchronise. (CPU: the interpreter, in tests.)
            staged = self._pinned.stage(batch.meta) if dev.type == "cuda" else None
            if staged is None:
                meta_host = torch.frombuffer(batch.meta, dtype=torch.int64)
                meta = meta_host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else meta_host
            else:
                meta = torch.empty(len(batch.meta), dtype=torch.int64, device=dev)
                meta.copy_(staged[0], non_blocking=True)
            # One buffer per result type: the partials, then the k final rows (two allocations, not four).
            buf_f = torch.empty((batch.programs + k) * 4, dtype=torch.float64, device=dev)
            buf_i = torch.empty((batch.programs + k) * 4, dtype=torch.int64, device=dev)
            at = batch.programs * 4
            res_f = buf_f[at:].view(k, 4)
            res_i = buf_i[at:].view(k, 4)
            p_key, p_args, f_key, f_args = self._kernel_args(index, batch.spec, batch.aligned, meta, buf_f, buf_i,
                                                             res_f, res_i)
            stream = _stream_handle(index)
            self._run(p_key, partials, batch.programs, stream, p_args, _P_CONSTEXPRS, warm_key)
            self._run(f_key, finalize, k, stream, f_args, _F_CONSTEXPRS, warm_key)
            event = None
            if dev.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                self.events[(dev, handle)] = event
                if staged is not None:
                    self._pinned.used_until(staged[1], event)
        self.launches += 2
        self.done.append((batch.slots, res_f, res_i, event))

    def _kernel_args(self, index: int, spec: tuple[str, int, bool], aligned: bool, meta: torch.Tensor,
                     part_f: torch.Tensor, part_i: torch.Tensor, res_f: torch.Tensor, res_i: torch.Tensor,
                     ) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
        """The two kernels' cache keys and argument lists, every parameter in order, constexprs
        included (the fast launcher's argument list): one place for the kernels' signatures, used
        by a batch's launch and a plan's layout. ``res_f``/``res_i``: the final rows, [k, 4]."""
        import triton.language as tl  # an optional dependency, loaded with the kernels

        name, esize, wide = spec
        p_args = (meta, part_f, part_i, res_f.shape[0], getattr(tl, name), esize, tl.float64 if wide else tl.float32,
                  self.stats, self.fingerprint, self.squares, CHUNK_BYTES, _LOG2_MAX_TENSORS, aligned)
        f_args = (meta, part_f, part_i, res_f, res_i, esize, _PBLOCK)
        p_key = ("partials", index, name, esize, wide, self.stats, self.fingerprint, self.squares, aligned)
        return p_key, p_args, ("finalize", index), f_args

    def _run(self, key: tuple[Any, ...], kernel: Any, grid: int, stream: int, args: tuple[Any, ...],
             constexprs: tuple[str, ...], warm_key: tuple[int, torch.dtype, bool, bool]) -> None:
        """Launch one kernel: through its cached launcher, else the normal way (which compiles
        it the first time), keeping what that returns for the next launch.

        A launch compiles for what Triton reads off its integer arguments (16 | n, and n == 1 on
        some versions), so a cached launcher serves only calls of the same class: ``key`` gets
        each integer's class. Pointers need no class: every buffer here is a fresh allocation
        (the caching allocator aligns to 512 bytes) or a view at a multiple of 32 bytes into one.
        The warm-up compiles with n = 3 (no integer specialisation): valid for every class."""
        n_plain = len(args) - len(constexprs)
        classes = tuple(_int_class(a) for a in args[:n_plain] if type(a) is int)
        full_key = key + classes
        fast = self._fast.get(full_key)
        if fast is None and full_key not in self._fast and WARMUP.ready(warm_key):
            compiled = (WARMUP.result(warm_key) or {}).get(key)  # what the warm-up compiled
            if compiled is not None:
                fast = self._fast[full_key] = fast_launcher(compiled)
        if fast is not None and FastLaunch.usable:
            try:
                fast(grid, stream, args)
                self.fast_launches += 1
                return
            except (TypeError, ValueError, AttributeError):  # this Triton's launcher differs: never again
                FastLaunch.usable = False
        kwargs = dict(zip(constexprs, args[n_plain:]))
        if key[0] == "partials":
            kwargs["num_warps"] = NUM_WARPS
        compiled = kernel[(grid,)](*args[:n_plain], **kwargs)
        if full_key not in self._fast and not self.interpret:
            self._fast[full_key] = fast_launcher(compiled)

    def take(self, wait: bool) -> list[tuple[list[list[TensorRecord]], list[list[float]], list[list[int]]]]:
        """Fetch launched results: all of them (``wait``: one copy per device, the trace's one
        synchronisation), or only batches whose kernels have finished (no waiting)."""
        ready = [d for d in self.done if wait or d[3] is None or d[3].query()]
        if not ready:
            return []
        taken = {id(d) for d in ready}
        self.done = [d for d in self.done if id(d) not in taken]
        out = []
        with torch._C.DisableTorchFunction():
            by_device: dict[torch.device, list[tuple[list[list[TensorRecord]], torch.Tensor, torch.Tensor, Any]]] = {}
            for d in ready:
                by_device.setdefault(d[1].device, []).append(d)
            for items in by_device.values():
                floats = torch.cat([d[1] for d in items]).cpu().tolist()
                ints = torch.cat([d[2] for d in items]).cpu().tolist()
                at = 0
                for slots, *_ in items:
                    out.append((slots, floats[at:at + len(slots)], ints[at:at + len(slots)]))
                    at += len(slots)
        return out

    def pending(self) -> set[int]:
        """ids of the records still waiting for a result."""
        waiting = {id(r) for b in self._batches.values() for recs in b.slots for r in recs}
        waiting.update(id(r) for d in self.done for recs in d[0] for r in recs)
        return waiting


def _fills_its_span(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill the ``numel`` elements from its first one without gaps or
    overlaps (non-overlapping and dense: some order of its dimensions is contiguous), so its
    first element is its lowest address (strides are never negative)."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _spans_of(tensors: list[torch.Tensor]) -> list[tuple[int, int]] | None:
    """The byte spans writes into ``tensors`` can reach (``_write_span``; the empty ones left
    out), or None where one has no readable address (a wrapper subclass, sparse)."""
    spans = []
    for t in tensors:
        try:
            span = _write_span(t)
        except Exception:
            return None
        if span is not None:
            spans.append(span)
    return spans


def _write_span(w: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a write into ``w`` can reach, from the start of its storage (None: it has no
    elements). Raises where ``w`` has no readable address (a wrapper subclass, sparse)."""
    if w.layout != torch.strided:
        raise RuntimeError("no strided storage")
    if not w.numel():
        return None
    start = storage_start(w)
    if not start:
        raise RuntimeError("no memory (a freed storage)")
    last = sum((size - 1) * stride for size, stride in zip(w.shape, w.stride()))
    return start, int(w.data_ptr()) + (last + 1) * w.element_size()


def _reached(batch: _Batch, spans: list[tuple[int, int]]) -> list[int]:
    """Slots of ``batch`` whose waiting tensor a write into the byte ``spans`` reaches."""
    starts, meta, esize = batch.starts, batch.meta, batch.spec[1]
    hits: list[int] = []
    for start, end in spans:
        i = bisect.bisect_left(starts, (start, -1))
        if i:  # the one just below: does it reach into the span?
            addr, slot = starts[i - 1]
            if addr + meta[4 * slot + 1] * esize > start:
                hits.append(slot)
        while i < len(starts) and starts[i][0] < end:
            hits.append(starts[i][1])
            i += 1
    return sorted(set(hits)) if len(spans) > 1 else hits


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_handle(index: int) -> int:
    """The current stream's handle on CUDA device ``index`` (0 for the CPU, ``index`` -1): which
    queue of work the tensor's producer used. The raw-handle lookup is private torch API; the
    public (slower) path is the fallback."""
    if index < 0:
        return 0
    if _raw_stream is not None:
        return int(_raw_stream(index))
    return int(torch.cuda.current_stream(index).cuda_stream)
