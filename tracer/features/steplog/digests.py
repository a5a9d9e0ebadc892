"""Fingerprints and L2 norms of many tensors at once, on their own device, read later.

The step log fingerprints every parameter and every gradient at every optimizer step. On the
CPU that is done at once, in batches (``HostFingerprints``: one pass of about fifteen ops over
all the small tensors) and the norms by ``torch._foreach_norm``. On CUDA nothing is waited for:
the fingerprints and the norms are the Triton kernel the traces use (``Fused``: one launch for
up to 512 tensors, reading each byte once; here it sums each tensor's squares in the same pass),
and the results, lane sums and sums of squares together, are copied in one piece to pinned host
memory behind an event. A list read at every step (the parameters and their gradients:
``read(..., plan=...)``) goes through a ``Fused.plan`` instead: its launches are laid out once and
followed while its tensors stay where they were or only move (gradients the allocator placed
elsewhere), so a step costs a few C calls per tensor on the host, not a batcher's bookkeeping. The step log reads them once that event has completed, a step or more
later, so a step costs no synchronisation (the watch's sentinel works the same way).

The fingerprint is ``hash="fast"``'s (``gtfp2-fmix32x2-64``, ``tracer.record.checksums.fingerprint``):
the same bytes give the same 16 hexadecimal digits on any device. Where Triton is missing, a
CUDA tensor's lane sums take the plain torch path (``fingerprint.lane_sums``: about twenty small
kernels per tensor, still no synchronisation) and its norm ``_foreach_norm``.

A norm is accumulated in float32 for 16-bit and 32-bit floating tensors (float64 for float64 and
the wide integers) on every path, and returned as float64: it serves comparisons within a
tolerance (``gradtrace bisect --rtol/--atol``), never an exact one (the fingerprint is that).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.model import TensorRecord
from tracer.record.checksums import fingerprint as fp
from tracer.record.checksums.bytes import unhashable_reason
from tracer.record.checksums.fused import Fused, Plan, triton_usable
from tracer.record.checksums.host_batch import HostFingerprints

ALGORITHM = fp.ALGORITHM
_foreach_norm = getattr(torch, "_foreach_norm", None)  # private; per-tensor norms where missing
# Tensors a plan reads as they are (a subclass, a DTensor, takes the general path: ``_readable``).
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The log's own tensor work: no autograd, and invisible to a trace being recorded."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        yield


def _slot() -> TensorRecord:
    """A record for the fingerprint batchers to fill: they take records, the log needs only the
    fingerprint (``Fused`` and ``HostFingerprints`` are the traces' own, shared as they are)."""
    return TensorRecord("", (), "", "", "param")


@dataclass
class _DevicePart:
    """What one CUDA device computes for a reading: which tensor each row belongs to."""

    # (row, index in the reading, bytes to finish the row's lane sums with; None: the kernel
    # finished them, and the row's third value is the sum of the squares); a row may serve
    # several tensors (the same bytes twice)
    entries: list[tuple[int, int, int | None]]
    rows: int
    norm_positions: list[int]  # the tensors whose norm follows the rows (not the kernel's)
    host: torch.Tensor | None = None  # pinned: [lane_a, lane_b, sum of squares] per row, then norms
    event: Any = None
    norms: bool = True

    def fill(self, fingerprints: list[str | None], norms: list[float | None]) -> None:
        assert self.host is not None
        values = self.host.tolist()
        for row, at, n in self.entries:
            a, b = int(values[3 * row]), int(values[3 * row + 1])
            if n is None:
                fingerprints[at] = fp.hex_of(a, b)
                if self.norms:
                    norms[at] = math.sqrt(values[3 * row + 2])  # (NaN and Inf stay so)
            else:
                fingerprints[at] = fp.finish(a, b, n)
        for j, at in enumerate(self.norm_positions):
            norms[at] = values[3 * self.rows + j]


@dataclass
class _PlannedPart:
    """A reading launched through a ``Plan``: the plan's results as they came (``Plan``'s
    layout: four integers per row, then four float64 per row), pinned on CUDA."""

    positions: list[list[int]]  # per row: the indices in the reading of the tensors it serves
    host: torch.Tensor
    event: Any
    norms: bool

    def fill(self, fingerprints: list[str | None], norms: list[float | None]) -> None:
        rows = len(self.positions)
        for at, h in zip(self.positions, _hex_rows(self.host[:4 * rows].view(rows, 4))):
            for i in at:
                fingerprints[i] = h
        if self.norms:
            sqrt = math.sqrt
            for at, square in zip(self.positions, self.host[4 * rows:].view(torch.float64)[2::4].tolist()):
                norm = sqrt(square)  # (NaN and Inf stay so)
                for i in at:
                    norms[i] = norm


def _hex_rows(ints: torch.Tensor) -> list[str]:
    """Each row's fingerprint (``fp.hex_of`` of its lanes, columns 2 and 3 of the kernel's int64
    rows on the host): the low four bytes of each lane, most significant first, as hexadecimal
    in one pass over all rows (``hex_of`` per row took a third of a reading's host time)."""
    if sys.byteorder != "little":
        return [fp.hex_of(a, b) for a, b in ints[:, 2:4].tolist()]
    k = ints.shape[0]
    words = ints.view(torch.uint8).view(k, 4, 8)[:, 2:4, :4].flip(-1).contiguous()  # a copy, in row order
    text = ctypes.string_at(words.data_ptr(), 8 * k).hex()
    return [text[i:i + 16] for i in range(0, 16 * k, 16)]


@dataclass
class Reading:
    """The fingerprints and norms of a list of tensors (None where a tensor is None), complete
    once ``ready()``; ``result()`` waits for the device if it has to."""

    fingerprints: list[str | None]
    norms: list[float | None]
    parts: list[_DevicePart | _PlannedPart] = field(default_factory=list)

    def ready(self) -> bool:
        return all(p.event is None or p.event.query() for p in self.parts)

    def result(self) -> tuple[list[str | None], list[float | None]]:
        for part in self.parts:
            if part.event is not None:
                part.event.synchronize()  # this reading's copy only: later work stays queued
            part.fill(self.fingerprints, self.norms)
        self.parts = []
        return self.fingerprints, self.norms


@dataclass
class _Planned:
    """A list of tensors read through a ``Plan``: which entries of the list it reads."""

    types: list[type]  # of every entry (NoneType where None): the plan reads those not None
    plan: Plan
    positions: list[list[int]]  # per row of the plan: the entries it serves


class Digester:
    """Makes ``Reading``s; holds the batchers and their buffers for the whole log.

    ``interpret`` (tests; default: ``GRADTRACE_FUSED_INTERPRET=1``, as for traces): CPU tensors
    take the device path, through the kernels under Triton's CPU interpreter, so a machine
    without a GPU runs it end to end; ``triton=False`` makes the device path use the plain torch
    lane sums."""

    def __init__(self, *, interpret: bool | None = None, triton: bool | None = None) -> None:
        self._host: HostFingerprints | None = None
        self._fused: Fused | None = None
        self._interpret = os.environ.get("GRADTRACE_FUSED_INTERPRET") == "1" if interpret is None else interpret
        self._triton = triton
        self._plans: dict[str, _Planned] = {}

    def read(self, tensors: Sequence[torch.Tensor | None], norms: bool = True, plan: str | None = None) -> Reading:
        """Start computing the fingerprints (and L2 norms) of ``tensors``. ``plan``: the name of
        a list read again and again (the parameters and gradients at every step): on the device
        its launches are planned once and reused while its tensors stay where they were
        (``Fused.plan``); the results are the same."""
        if plan is not None:
            with quiet():
                reading = self._planned(plan, tensors, norms)
            if reading is not None:
                return reading
        n = len(tensors)
        reading = Reading([None] * n, [None] * n)
        by_device: dict[torch.device, list[int]] = {}
        with quiet():
            plain: dict[int, torch.Tensor] = {}
            for i, t in enumerate(tensors):
                readable = _readable(t)
                if readable is not None:
                    plain[i] = readable
                    by_device.setdefault(readable.device, []).append(i)
            for device, idx in by_device.items():
                ts = [plain[i] for i in idx]
                if device.type == "cuda" or self._interpret:
                    reading.parts.append(self._on_device(ts, idx, norms))
                else:
                    self._on_host(ts, idx, reading, norms)
        return reading

    # ---- a planned list: the device, launched at once -------------------------------------------------
    def _planned(self, name: str, tensors: Sequence[torch.Tensor | None], norms: bool) -> Reading | None:
        """The reading of ``tensors`` through the plan ``name`` (made or remade here), or None
        where no plan can read them (the general path then does)."""
        types = list(map(type, tensors))
        known = self._plans.get(name)
        if known is None or known.types != types or not self._follow(known, tensors):
            known = self._plan(types, tensors)
            if known is None:
                self._plans.pop(name, None)
                return None
            self._plans[name] = known
        fused = self._fused
        assert fused is not None
        out = fused.launch(known.plan)
        if out is None:  # its kernels are still compiling in the background
            return None
        if out.device.type != "cuda":  # the interpreter's CPU tensors (tests): the next launch reuses out
            part = _PlannedPart(known.positions, out.clone(), None, norms)
        else:
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            part = _PlannedPart(known.positions, host, event, norms)
        n = len(tensors)
        return Reading([None] * n, [None] * n, [part])

    def _follow(self, known: _Planned, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Whether ``known``'s plan reads ``tensors`` as they are now (``Fused.follow``)."""
        fused = self._fused
        assert fused is not None
        return fused.follow(known.plan, [t for t in tensors if t is not None])

    def _plan(self, types: list[type], tensors: Sequence[torch.Tensor | None]) -> _Planned | None:
        """A plan for ``tensors``, where one can read them: plain tensors (no subclass: a DTensor
        takes the general path, which reads its local shard) with bytes on the device path."""
        if any(k not in _PLAIN_TYPES and k is not type(None) for k in types):
            return None
        present = [i for i, t in enumerate(tensors) if t is not None]
        ts = [t for t in tensors if t is not None]
        if any(unhashable_reason(t) is not None or (t.device.type != "cuda" and not self._interpret) for t in ts):
            return None
        fused = self._batcher()
        plan = fused.plan(ts) if fused is not None else None
        if plan is None:
            return None
        positions: list[list[int]] = [[] for _ in range(plan.rows)]
        for i, row in zip(present, plan.row_of):
            positions[row].append(i)
        return _Planned(types, plan, positions)

    def _batcher(self) -> Fused | None:
        """The Triton batcher (None without Triton: the torch lane sums take its place)."""
        if self._triton is None:
            self._triton = triton_usable()
        if self._triton and self._fused is None:
            self._fused = Fused(stats=False, fingerprint=True, squares=True, interpret=self._interpret)
        return self._fused

    # ---- the CPU: now ----------------------------------------------------------------------------
    def _on_host(self, ts: list[torch.Tensor], idx: list[int], reading: Reading, norms: bool) -> None:
        if self._host is None:
            self._host = HostFingerprints()
        slots = [_slot() for _ in ts]
        for rec, t in zip(slots, ts):
            self._host.add(rec, t)
        self._host.flush()
        for at, rec in zip(idx, slots):
            reading.fingerprints[at] = rec.fingerprint
        if norms:
            values, order = _norms(ts)
            for k, v in zip(order, values.tolist()):
                reading.norms[idx[k]] = v

    # ---- CUDA: queued, read later -------------------------------------------------------------------
    def _on_device(self, ts: list[torch.Tensor], idx: list[int], norms: bool) -> _DevicePart:
        fused = self._batcher()
        rows: list[torch.Tensor] = []  # [k, 3]: the lanes, the sum of the squares
        entries: list[tuple[int, int, int | None]] = []
        count = 0  # rows so far
        slots: dict[int, int] = {}  # id(slot) -> index in the reading
        fallback: list[tuple[int, int, torch.Tensor]] = []
        fallback_tensors: list[torch.Tensor] = []
        for at, t in zip(idx, ts):
            size = t.numel() * t.element_size()
            rec = _slot()
            if fused is not None and fused.add(rec, t):
                slots[id(rec)] = at
            else:  # no Triton, a dtype its kernel does not read, its kernels still compiling
                fallback.append((at, size, fp.lane_sums(t)))
                fallback_tensors.append(t)
        if fused is not None and slots:
            fused.flush()
            done, fused.done = fused.done, []
            for batch_slots, res_f, res_i, _ in done:
                # ints (NaN count, Inf count, lane A, lane B): the finished lanes; floats
                # (min, max, sum of the squares, absmax): the third
                rows.append(torch.cat([res_i[:, 2:4].to(torch.float64), res_f[:, 2:3]], dim=1))
                for recs in batch_slots:
                    entries += [(count, slots[id(rec)], None) for rec in recs]
                    count += 1
        for at, size, sums in fallback:
            rows.append(torch.cat([sums.view(1, 2).to(torch.float64), sums.new_zeros((1, 1), dtype=torch.float64)], dim=1))
            entries.append((count, at, size))
            count += 1
        pieces = [torch.cat(rows).reshape(-1)] if rows else []
        norm_positions: list[int] = []
        if norms and fallback_tensors:
            values, order = _norms(fallback_tensors)
            pieces.append(values)
            norm_positions = [fallback[k][0] for k in order]
        vector = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if vector.device.type != "cuda":  # the interpreter's CPU tensors (tests): nothing to wait for
            return _DevicePart(entries, count, norm_positions, vector, norms=norms)
        host = torch.empty(vector.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(vector, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _DevicePart(entries, count, norm_positions, host, event, norms)


def _readable(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor whose bytes are read: a distributed tensor's local shard (FSDP2, tensor
    parallel); None for a tensor without plain bytes here (meta, sparse, quantized, ...): the log
    then says it has no fingerprint."""
    if t is None:
        return None
    to_local = getattr(t, "to_local", None)
    if callable(to_local) and type(t).__name__ == "DTensor":
        t = to_local()
    t = t.detach()
    return None if unhashable_reason(t) is not None else t


# Where a norm is accumulated wider than its tensor's dtype (as the batched kernel does): a 16-bit
# float's norm in float32, not rounded to 16 bits; integers and bool as floats.
_NORM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.int64: torch.float64,
               torch.int32: torch.float64}


def _norms(ts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The L2 norm of each tensor as float64, one ``_foreach_norm`` per dtype, and for each norm
    the index of its tensor in ``ts``."""
    out: list[torch.Tensor] = []
    order: list[int] = []
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ts):
        groups.setdefault(t.dtype, []).append(i)
    for dtype, members in groups.items():
        group = [ts[i] for i in members]
        if dtype.is_floating_point or dtype.is_complex:
            out.extend(_group_norms(group, _NORM_DTYPE.get(dtype)))
        else:  # (integers and bool: no norm kernel reads them; small tensors, in practice)
            out.extend(_group_norms([t.to(_NORM_DTYPE.get(dtype, torch.float32)) for t in group], None))
        order.extend(members)
    if not out:
        return torch.zeros(0, dtype=torch.float64), []
    return torch.stack([v.to(torch.float64) for v in out]), order


def _group_norms(group: list[torch.Tensor], wide: torch.dtype | None) -> list[torch.Tensor]:
    """The norms of tensors of one floating dtype, accumulated in ``wide`` where given (without a
    copy of the tensors: ``_foreach_norm``'s ``dtype``, which older torch lacks)."""
    if _foreach_norm is not None:
        try:
            return list(_foreach_norm(group, 2, dtype=wide) if wide is not None else _foreach_norm(group, 2))
        except (TypeError, RuntimeError):  # no dtype argument in this torch
            pass
    return [torch.linalg.vector_norm(t, dtype=wide) for t in group]
