"""The module tree of a trace as the summary, the DOT picture and the HTML report see it.

Module paths are dotted (``transformer.h.0.mlp``; the root module is ``""``). These helpers
group calls by module, name modules for a label, and count parameters. How one path or name is
written (``module_depth``, ``within``, ``param_module``...) is ``tracer.model.display``'s.
"""

from __future__ import annotations

from collections import Counter

from tracer.model import TensorRecord, Trace
from tracer.model.names import base_name

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
    "complex32": 4, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2,
    "uint32": 4, "uint64": 8, "bool": 1, "qint32": 4, "qint8": 1, "quint8": 1, "quint4x2": 1, "quint2x4": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    **{f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)},
}  # every dtype of torch 2.13 (a trace is rendered without importing torch)


# ---- paths -------------------------------------------------------------------------------------------
def parent_path(path: str) -> str:
    """The enclosing module's path: ``h.0.mlp`` -> ``h.0``; a top-level module -> ``""``."""
    return path.rpartition(".")[0]


def prefixes(path: str) -> list[str]:
    """Every module from the top down to ``path``: ``h.0.mlp`` -> ``h``, ``h.0``, ``h.0.mlp``."""
    if not path:
        return []
    parts = path.split(".")
    return [".".join(parts[: k + 1]) for k in range(len(parts))]


def module_group(path: str, depth: int) -> str:
    """The first ``depth`` parts of a module path, keeping a list index with its list (``h.0``)."""
    parts = path.split(".")
    keep = min(depth, len(parts))
    while keep < len(parts) and parts[keep].isdigit():
        keep += 1
    return ".".join(parts[:keep])


def module_groups(paths: list[str], max_rows: int = 16) -> dict[str, str]:
    """Map each call's module path to the row it is counted in, top-level modules first.

    A group holding more than half of all calls is split into its children while the table stays
    short, so a model wrapped in a container (``GPT2LMHeadModel.transformer.h.0``) shows its
    blocks rather than one row holding everything. Calls made in the group module itself keep
    the group's row.
    """
    total = len(paths)
    group = {p: module_group(p, 1) if p else "" for p in set(paths)}
    while True:
        counts = Counter(group[p] for p in paths)
        big = [g for g, n in counts.items() if g and n * 2 > total
               and any(p != g and p.startswith(g + ".") for p in group if group[p] == g)]
        if not big:
            return group
        g = big[0]
        depth = g.count(".") + 2
        split = {p: (p if p == g else module_group(p, depth)) if k == g else k for p, k in group.items()}
        if len(set(split.values())) > max_rows:
            return group
        group = split


# ---- labels ------------------------------------------------------------------------------------------
def module_label(path: str) -> str:
    """A module's short name: its last path component, or the last two when the last is a list
    index (``h.3``, ``layers.0``)."""
    parts = path.split(".")
    if len(parts) >= 2 and parts[-1].isdigit():
        return ".".join(parts[-2:])
    return parts[-1]


def module_with_class(trace: Trace, path: str, *, outside: str = "(root)") -> str:
    """``h.0.mlp (MLP)``; the root module ``(root) (GPT)``. ``""`` with no class is code outside
    every module, shown as ``outside``."""
    cls = trace.modules.get(path)
    label = path or ("(root)" if cls else outside)
    return f"{label} ({cls})" if cls else label


# ---- tensors -----------------------------------------------------------------------------------------
def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype given by name (``float32`` -> 4); 0 when unknown."""
    return _ITEMSIZE.get(dtype, 0)


def checksum(rec: TensorRecord) -> str | None:
    """The tensor's checksum: its MD5, or with ``hash="fast"`` its fingerprint; None if unhashed."""
    return rec.md5 or rec.fingerprint


def first_params(trace: Trace) -> list[TensorRecord]:
    """The parameters as they entered the block (each once, before any in-place update)."""
    return [t for t in trace.tensors.values() if t.role == "param" and t.previous is None and "@v" not in t.name]


def param_totals(trace: Trace) -> tuple[int, int, int]:
    """(parameter tensors, elements, bytes), each parameter counted once at its first version."""
    seen: set[str] = set()
    count = numel = nbytes = 0
    for t in trace.tensors_in_order():
        if t.role != "param":
            continue
        base = base_name(t.name)
        if base in seen:
            continue
        seen.add(base)
        count += 1
        numel += t.numel
        nbytes += t.numel * itemsize(t.dtype)
    return count, numel, nbytes


def nonfinite(trace: Trace) -> list[TensorRecord]:
    """Tensors whose stats counted a NaN or an Inf, in creation order."""
    return [t for t in trace.tensors_in_order() if t.stats is not None and not t.stats.finite]


__all__ = ["checksum", "first_params", "itemsize", "module_group", "module_groups", "module_label", "module_with_class",
           "nonfinite", "param_totals", "parent_path", "prefixes"]
