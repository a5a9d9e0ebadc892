"""Element-wise differences of one tensor's kept values in two traces (``trace(keep_values=...)``),
and the words every diff view uses for a difference: element-wise, or of the stats only.

Differences are computed in float64 from the kept bytes (``tracer.model.values``): a float32
``a - b`` is exact there, so ``max_abs`` is the true largest difference, not a rounded one. The
relative difference of an element is ``|a - b| / max(|a|, |b|)``. NaN against NaN is equal; a
NaN or an infinity against anything else is a difference of ``inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tracer.model.display import format_number, json_number
from tracer.model.values import DTYPE_SIZES, as_floats

INF = math.inf
_BLOCK = 4096  # components per block; of one dtype, equal blocks are compared as bytes, never decoded
STATS_WORDS = "min/max/mean/absmax, not element-wise"
ONLY_STATS = ("only checksums and stats are known: no tensor values were kept, so a difference shown is "
              f"of the stats ({STATS_WORDS}); record with tracer.trace(keep_values=[...]) for element-wise "
              "differences")


@dataclass(frozen=True)
class ElementDiff:
    """How two kept values of one shape and dtype differ, element by element.

    ``differing`` of ``total`` elements differ (complex: components); ``first`` is the index of
    the first (row-major); ``beyond`` counts those outside the tolerance it was computed with
    (all differing ones without a tolerance). ``max_abs``/``max_rel`` are None for dtypes compared
    only as bytes (float8).
    """

    total: int
    differing: int
    first: tuple[int, ...] | None
    max_abs: float | None
    max_rel: float | None
    beyond: int

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "differing": self.differing,
                "first": None if self.first is None else list(self.first),
                "max_abs": json_number(self.max_abs), "max_rel": json_number(self.max_rel), "beyond": self.beyond}


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(flat % s if s else 0)
        flat = flat // s if s else 0
    return tuple(reversed(out))


def comparable(dtype_a: str, dtype_b: str) -> bool:
    """Whether kept values of these dtypes compare element by element: the same dtype, or two
    dtypes read as numbers with as many components per element (float32 against bfloat16)."""
    if dtype_a == dtype_b:
        return dtype_a in DTYPE_SIZES
    numeric = as_floats(b"", dtype_a) is not None and as_floats(b"", dtype_b) is not None
    return numeric and dtype_a.startswith("complex") == dtype_b.startswith("complex")


def element_diff(a: bytes, b: bytes, dtype: str, shape: tuple[int, ...],
                 rtol: float = 0.0, atol: float = 0.0, dtype_b: str | None = None) -> ElementDiff:
    """Compare two kept values of ``shape``: ``a`` of ``dtype``, ``b`` of ``dtype_b`` (default: the
    same; else see ``comparable``). Lengths match the dtypes and shape (checked on load)."""
    dtype_b = dtype_b or dtype
    parts = 2 if dtype.startswith("complex") else 1
    step_a, step_b = DTYPE_SIZES[dtype] // parts, DTYPE_SIZES[dtype_b] // parts  # bytes per component
    total = len(a) // step_a
    same = dtype == dtype_b
    if same and a == b:
        return ElementDiff(total, 0, None, 0.0, 0.0, 0)
    numeric = as_floats(b"", dtype) is not None
    differing = beyond = 0
    first: int | None = None
    worst_abs = worst_rel = 0.0
    d: float
    rel: float
    isnan, isinf = math.isnan, math.isinf
    for base in range(0, total, _BLOCK):
        sa = a[base * step_a:(base + _BLOCK) * step_a]
        sb = b[base * step_b:(base + _BLOCK) * step_b]
        if same and sa == sb:
            continue
        if not numeric:  # float8: which bytes differ, no magnitude
            for i, (x, y) in enumerate(zip(sa, sb)):
                if x != y:
                    differing += 1
                    beyond += 1
                    first = base + i if first is None else first
            continue
        xs, ys = as_floats(sa, dtype), as_floats(sb, dtype_b)
        assert xs is not None and ys is not None
        for i, (u, v) in enumerate(zip(xs, ys)):
            if u == v:
                continue
            if isnan(u) and isnan(v):
                continue
            differing += 1
            if first is None:
                first = base + i
            if isnan(u) or isnan(v) or isinf(u) or isinf(v):
                d = rel = INF
                beyond += 1  # never within a tolerance, whatever rtol * inf says
            else:
                d = abs(float(u) - float(v))
                rel = d / max(abs(u), abs(v))
                if d > atol + rtol * abs(v):
                    beyond += 1
            worst_abs = max(worst_abs, d)
            worst_rel = max(worst_rel, rel)
    where = None if first is None else _unravel(first // parts, shape)
    if numeric:
        return ElementDiff(total, differing, where, worst_abs, worst_rel, beyond)
    return ElementDiff(total, differing, where, None, None, beyond)


# ---- words ----------------------------------------------------------------------------------------
def elements_text(e: ElementDiff) -> str:
    """``1 of 768 elements differ, first at [0, 0]``."""
    if not e.differing:
        return f"all {e.total} elements equal"
    first = "" if e.first is None else f", first at {list(e.first)}"
    return f"{e.differing} of {e.total} element{'s' if e.total != 1 else ''} differ{first}"


def difference_text(max_abs: float | None, max_rel: float | None, basis: str,
                    elements: ElementDiff | None = None) -> str:
    """A measured difference in the words of where it came from: ``element-wise: max abs 3.1e-04,
    max rel 2.0e-03; 1 of 768 elements differ, first at [0, 0]`` from kept values, ``stats differ:
    max |Δ| 4.0e-08, rel 1.0e-07 (min/max/mean/absmax, not element-wise)`` from stats."""
    if max_abs is None and elements is None:
        return ""
    if basis == "values":
        size = "" if max_abs is None else f"max abs {format_number(max_abs, 3)}, max rel {format_number(max_rel, 3)}"
        tail = "" if elements is None else elements_text(elements)
        return "element-wise: " + "; ".join(x for x in (size, tail) if x)
    if basis == "stats" and max_abs == 0:
        return f"stats equal ({STATS_WORDS}): only the checksums differ"
    rel = "" if max_rel is None else f", rel {format_number(max_rel, 3)}"
    what = STATS_WORDS if basis == "stats" else f"{STATS_WORDS} for some tensors, element-wise for others"
    return f"stats differ: max |Δ| {format_number(max_abs, 3)}{rel} ({what})"


__all__ = ["ONLY_STATS", "STATS_WORDS", "ElementDiff", "comparable", "difference_text", "element_diff", "elements_text"]
