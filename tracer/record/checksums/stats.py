"""Stats of a tensor's values (min, max, mean, absmax over finite values; NaN and Inf counts):
the torch reference reduction, the CPU fast path, and a one-element tensor from its value."""

from __future__ import annotations

import math

import torch
import torch.autograd.forward_ad as forward_ad

from tracer.model import Stats


def _in_dual_level() -> bool:
    """Whether a forward-mode AD level is open (``forward_ad.dual_level``): a value may carry a
    tangent, and a reduction of it would be differentiated forward too (torch 2.11 has no
    forward derivative for ``aminmax``: the read failed). Private in torch; without it, always."""
    level = getattr(forward_ad, "_current_level", None)
    return not isinstance(level, int) or level >= 0


def stats_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """[min, max, mean, absmax, nan, inf, n_finite] of one tensor as float64 on its device.

    The torch path's reduction (also the reference the batched kernel is tested against).
    """
    flat = stats_input(t)
    if flat is None:
        return None
    return reduce_one(flat)


PRECISE_SUM_ELEMS = 1 << 13  # up to this many values, the sum is in float64 (cost: a few µs)


def cpu_stats(t: torch.Tensor) -> Stats | None:
    """Stats of a CPU tensor now: one fused min/max pass and one sum when all values are finite
    (min and max reveal any NaN or Inf), the masked reduction only when they are not."""
    # Read through a detached alias only where autograd would see the reductions (no grad node
    # is made, no sequence number taken, no tangent carried); most values a step makes do not
    # require grad, and no dual level is open.
    x = t.detach() if t.requires_grad or _in_dual_level() else t  # (detach drops a tangent too)
    if x.numel() == 0:
        return None
    if not x.is_contiguous():
        x = x.reshape(-1)  # summed in logical order: the same values give the same mean
    # float32, the common case, goes straight to the reductions (each check below is a C call,
    # a few per cent of a small tensor's cost).
    if x.dtype is not torch.float32:
        if x.is_complex():
            x = torch.view_as_real(x.resolve_conj())
        if x.dtype == torch.bool:
            x = x.view(torch.uint8)
        if (x.is_floating_point() and x.element_size() < 4) or not (x.is_floating_point() or x.dtype in _AMINMAX_INT):
            x = x.float()
    lo, hi = torch.aminmax(x)
    lo_f, hi_f = float(lo), float(hi)  # (float(): an integer tensor's too)
    if math.isfinite(lo_f) and math.isfinite(hi_f):
        # Large float32 tensors are summed in float32 (torch's cascade sum: ~40x faster on the
        # CPU than converting to float64 as it sums, and as precise as the CUDA kernel, which
        # accumulates float32 too); small ones, and any overflow, in float64, where a one-ulp
        # change of one value still moves the mean (what a diff by stats finds). (``.item()`` of
        # a floating sum: the float ``float()`` gives, one Python call fewer.)
        total = x.sum().item() if x.dtype == torch.float32 and x.numel() > PRECISE_SUM_ELEMS else math.inf
        if not math.isfinite(total):
            total = x.sum(dtype=torch.float64).item()
        mean = total / x.numel()
        # absmax reuses max's float object when max dominates (no new object per record).
        return Stats(lo_f, hi_f, mean, hi_f if hi_f >= -lo_f else -lo_f, 0, 0)
    return stats_from_row(reduce_one(x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)).tolist())


def cpu_stats_same_size(ts: list[torch.Tensor]) -> list[Stats | None]:
    """``cpu_stats`` of each of several contiguous float32 CPU tensors of one size (at least 2,
    at most ``PRECISE_SUM_ELEMS`` values), from one stacked copy: one ``aminmax`` and one float64 sum
    over its rows instead of a handful of torch calls per tensor (an optimizer step makes
    hundreds of these: every parameter and state tensor of a layer shape, once per layer).

    A row reduces in the same order as the tensor alone, so the results are equal to
    ``cpu_stats``' (tests/test_stats_batch.py checks it); a row with a NaN or Inf goes through
    ``cpu_stats`` itself."""
    rows = torch.stack([t.detach().view(-1) for t in ts])
    lo, hi = torch.aminmax(rows, dim=1)
    totals = rows.sum(dim=1, dtype=torch.float64).tolist()
    n = rows.shape[1]
    out: list[Stats | None] = []
    for t, lo_f, hi_f, total in zip(ts, lo.tolist(), hi.tolist(), totals):
        if math.isfinite(lo_f) and math.isfinite(hi_f) and math.isfinite(total):
            out.append(Stats(lo_f, hi_f, total / n, hi_f if hi_f >= -lo_f else -lo_f, 0, 0))
        else:
            out.append(cpu_stats(t))
    return out


_AMINMAX_INT = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})


def stats_input(t: torch.Tensor) -> torch.Tensor | None:
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


def reduce_one(data: torch.Tensor) -> torch.Tensor:
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


def stats_from_row(row: list[float]) -> Stats:
    lo, hi, mean, absmax, nan, inf, n_fin = row
    if n_fin == 0:  # no finite value at all: min/max/mean have no meaning
        return Stats(None, None, None, None, int(nan), int(inf))
    return Stats(lo, hi, mean, absmax, int(nan), int(inf))



# Dtypes whose one value cpu_stats turns into the same Python float as float(t.item()) (the
# unsigned 16/32/64-bit types go through float32 there, so they are left to it).
SCALAR_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
                            torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})


def scalar_stats(value: float | int | bool) -> Stats | None:
    """``cpu_stats`` of a one-element tensor from its value; None when it is NaN or infinite."""
    v = float(value)
    if not math.isfinite(v):
        return None
    # The mean as cpu_stats makes it: the sum of one value, which is 0.0 + v (so -0.0 gives
    # 0.0); absmax as there too.
    return Stats(v, v, 0.0 + v, v if v >= -v else -v, 0, 0)
