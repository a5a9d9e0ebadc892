"""Stats of small CPU tensors, computed in batches.

A step makes thousands of small tensors (biases, norms' outputs, gradients of small layers,
AdamW's state of small parameters), and ``stats.cpu_stats`` spends a few torch calls on each:
host time that dominates ``check_numerics`` on a CPU. Here a small floating tensor's values
are copied (converted to float32: the dtype ``cpu_stats`` reduces half types in) into one staging
buffer, and the stats of up to ``STAGE_ELEMS`` values come from one set of segmented reductions.
The copy is a snapshot, so later in-place writes do not reach it; the stats are filled in at the
next ``flush`` (the hasher's drain), as the CPU fingerprints of ``host_batch`` are.

A tensor with a NaN or an Inf takes ``cpu_stats`` over its staged values (the masked
reduction), so the counts and the finite min/max/mean are those of the direct path.
"""

from __future__ import annotations

import torch

from tracer.model import Stats, TensorRecord
from tracer.record.checksums.stats import cpu_stats

STAGE_ELEMS = 1 << 18  # float32 values per batch (1 MiB)
MAX_ELEMS = 1 << 13  # a larger tensor's own reductions cost little beside reading it: direct
STAGED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def stageable(t: torch.Tensor) -> bool:
    """Whether ``HostStats.add`` takes ``t`` (a plain small floating CPU tensor, not empty)."""
    return t.dtype in STAGED_DTYPES and 0 < t.numel() <= MAX_ELEMS


class HostStats:
    """Staged CPU stats; ``add`` copies the values now, ``flush`` fills in the records."""

    def __init__(self) -> None:
        self._stage = torch.empty(STAGE_ELEMS, dtype=torch.float32)
        self._used = 0
        self._waiting: list[tuple[TensorRecord, int]] = []

    def add(self, rec: TensorRecord, t: torch.Tensor) -> None:
        n = t.numel()
        if self._used + n > STAGE_ELEMS:
            self.flush()
        # One copy, whatever the strides and dtype of ``t`` (the view has its shape).
        self._stage.narrow(0, self._used, n).view(t.shape).copy_(t.detach())
        self._used += n
        self._waiting.append((rec, n))

    def pending(self) -> list[TensorRecord]:
        """Records whose stats are not filled in yet."""
        return [rec for rec, _ in self._waiting]

    def flush(self) -> None:
        """Fill in the stats of every staged tensor: five reductions over the whole batch."""
        waiting, self._waiting = self._waiting, []
        used, self._used = self._used, 0
        if not waiting:
            return
        data = self._stage[:used]
        lengths = torch.tensor([n for _, n in waiting], dtype=torch.int64)
        lo = torch.segment_reduce(data, "min", lengths=lengths).tolist()
        hi = torch.segment_reduce(data, "max", lengths=lengths).tolist()
        total = torch.segment_reduce(data.double(), "sum", lengths=lengths).tolist()
        bad = torch.segment_reduce(torch.isfinite(data).logical_not_().float(), "sum", lengths=lengths).tolist()
        at = 0
        for (rec, n), lo_i, hi_i, sum_i, bad_i in zip(waiting, lo, hi, total, bad):
            if bad_i:
                rec.stats = cpu_stats(data[at:at + n])
            else:
                rec.stats = Stats(lo_i, hi_i, sum_i / n, hi_i if hi_i >= -lo_i else -lo_i, 0, 0)
            at += n
