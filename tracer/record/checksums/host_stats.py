"""Stats of small CPU tensors, computed in batches.

A step makes thousands of small tensors (biases, norms' outputs, gradients of small layers,
AdamW's state of small parameters), and ``stats.cpu_stats`` spends a few torch calls on each:
host time that dominates ``check_numerics`` on a CPU. Here a small floating tensor's values
are copied (converted to float32: the dtype ``cpu_stats`` reduces half types in) into one staging
buffer, and the stats of up to ``STAGE_ELEMS`` values come from one set of segmented reductions.
The copy is a snapshot, so later in-place writes do not reach it; the stats are filled in at the
next ``flush`` (the hasher's drain), as the CPU fingerprints of ``host_batch`` are.

Each tensor starts on a block of ``BLOCK`` values and the rest of its last block is filled
with its first value, so the stage reads as [blocks, BLOCK]: per block one min, one max and one
float64 sum (three plain reductions over the whole stage: ``torch.segment_reduce`` took ~14x
longer for the same values), folded per tensor in Python. The padding changes no min or max,
and its share of the sum (first value x pad count, exact in float64) is subtracted.

A tensor with a NaN or an Inf (its blocks' sum is not finite) takes ``cpu_stats`` over its
staged values (the masked reduction), so the counts and the finite min/max/mean are those of
the direct path.
"""

from __future__ import annotations

import math

import torch

from tracer.model import Stats, TensorRecord
from tracer.record.checksums.stats import cpu_stats

STAGE_ELEMS = 1 << 18  # float32 values per batch (1 MiB)
BLOCK = 256  # values per block: a tensor's staged values start on a block boundary
MAX_ELEMS = 1 << 13  # a larger tensor's own reductions cost little beside reading it: direct
STAGED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def stageable(t: torch.Tensor) -> bool:
    """Whether ``HostStats.add`` takes ``t`` (a plain small floating CPU tensor, not empty)."""
    return t.dtype in STAGED_DTYPES and 0 < t.numel() <= MAX_ELEMS


class HostStats:
    """Staged CPU stats; ``add`` copies the values now, ``flush`` fills in the records."""

    def __init__(self) -> None:
        self._stage = torch.empty(STAGE_ELEMS, dtype=torch.float32)
        self._used = 0  # blocks
        self._waiting: list[tuple[TensorRecord, int, int]] = []  # (record, first block, values)

    def add(self, rec: TensorRecord, t: torch.Tensor) -> None:
        n = t.numel()
        blocks = -(-n // BLOCK)
        if (self._used + blocks) * BLOCK > STAGE_ELEMS:
            self.flush()
        at = self._used * BLOCK
        # One copy, whatever the strides and dtype of ``t`` (the view has its shape).
        self._stage.narrow(0, at, n).view(t.shape).copy_(t.detach())
        pad = blocks * BLOCK - n
        if pad:  # the first value again: no effect on min or max (see the module's docstring)
            self._stage.narrow(0, at + n, pad).fill_(self._stage[at])
        self._waiting.append((rec, self._used, n))
        self._used += blocks

    def pending(self) -> list[TensorRecord]:
        """Records whose stats are not filled in yet."""
        return [w[0] for w in self._waiting]

    def flush(self) -> None:
        """Fill in the stats of every staged tensor: three reductions over the staged blocks."""
        waiting, self._waiting = self._waiting, []
        used, self._used = self._used, 0
        if not waiting:
            return
        data = self._stage[:used * BLOCK]
        blocks = data.view(used, BLOCK)
        lo = blocks.amin(1).tolist()
        hi = blocks.amax(1).tolist()
        total = blocks.sum(1, dtype=torch.float64).tolist()
        firsts = blocks[:, 0].tolist()  # each block's first value: a tensor's pad value
        for rec, first, n in waiting:
            end = first + -(-n // BLOCK)
            sum_i = sum(total[first:end])
            if not math.isfinite(sum_i):  # a NaN or an Inf (float32 values cannot overflow it)
                at = first * BLOCK
                rec.stats = cpu_stats(data[at:at + n])
                continue
            lo_i, hi_i = min(lo[first:end]), max(hi[first:end])
            pad = (end - first) * BLOCK - n
            if pad:
                sum_i -= pad * firsts[first]
            rec.stats = Stats(lo_i, hi_i, sum_i / n, hi_i if hi_i >= -lo_i else -lo_i, 0, 0)
