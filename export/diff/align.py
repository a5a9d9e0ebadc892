"""Sequence alignment of two traces' calls and backward steps, robust to inserted/removed work.

Names are per-API counters, so one extra ``add`` shifts every later ``addN`` in the trace: names
cannot be the join key between two runs. Calls are aligned instead on a key that survives that
drift, ``(phase, kind, module path, api, input shapes, output shapes)``, by a longest-matching
sequence alignment (``difflib.SequenceMatcher`` without its popularity heuristic, which would
otherwise ignore the frequent keys a transformer repeats). The position of a call among its
same-API siblings is left out of the key on purpose: the alignment itself supplies order, and a
position would shift with the very insertion we want to tolerate.

Grad nodes are named after the call that created them (``linear3/AddmmBackward0``), so once the
calls are aligned a node name in A is translated into B's namespace and backward steps align by
those translated names. Leaf accumulators (``<param>/AccumulateGrad``) and nodes made before the
traced block (``external/...``) keep their names.
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tracer.model import Call, GradNode, Trace


@dataclass(frozen=True)
class Pair:
    """One row of an alignment: indices into A and B; one side is None for an insertion/removal."""

    a: int | None
    b: int | None


def align(keys_a: Sequence[Hashable], keys_b: Sequence[Hashable]) -> list[Pair]:
    """Align two key sequences; rows come in execution order of both sides.

    A ``replace`` block (the same stretch holds different work in A and B) becomes its removals
    followed by its insertions: pairing unlike calls would make their values look comparable.
    """
    sm = difflib.SequenceMatcher(a=list(keys_a), b=list(keys_b), autojunk=False)
    rows: list[Pair] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            rows += [Pair(i1 + k, j1 + k) for k in range(i2 - i1)]
        else:
            rows += [Pair(i, None) for i in range(i1, i2)]
            rows += [Pair(None, j) for j in range(j1, j2)]
    return rows


def _shapes(trace: Trace, names: Sequence[str]) -> tuple[tuple[int, ...] | None, ...]:
    out = []
    for n in names:
        rec = trace.tensors.get(n)
        out.append(None if rec is None else rec.shape)
    return tuple(out)


def call_key(trace: Trace, call: Call) -> Hashable:
    """What identifies a call across two runs of the same program (its name does not)."""
    return (call.phase, call.kind, call.module, call.api,
            _shapes(trace, call.inputs), _shapes(trace, call.outputs))


def align_calls(a: Trace, b: Trace) -> list[Pair]:
    return align([call_key(a, c) for c in a.calls], [call_key(b, c) for c in b.calls])


def call_mapping(a: Trace, b: Trace, rows: Sequence[Pair]) -> dict[str, str]:
    """A call name -> B call name for every aligned pair."""
    return {a.calls[r.a].name: b.calls[r.b].name for r in rows if r.a is not None and r.b is not None}


def translate_node(name: str, node: GradNode | None, calls: dict[str, str]) -> str:
    """A's grad node name in B's namespace: ``linear3/AddmmBackward0#1`` -> ``linear4/...#1``."""
    if node is not None and node.call is not None and name.startswith(node.call + "/"):
        mapped = calls.get(node.call)
        if mapped is not None:
            return mapped + name[len(node.call):]
    return name


def align_steps(a_nodes: Sequence[str], b_nodes: Sequence[str], a_trace: Trace,
                calls: dict[str, str]) -> list[Pair]:
    """Match two backward runs' executed nodes by translated name, in A's execution order.

    Node names are unique within a run, so matching is by name, not by order: the engine's order
    changes when the graph does (autocast adds cast nodes that reorder their neighbours), and an
    order-based alignment would then report matching nodes as removed and re-inserted. Nodes only
    B ran are placed before the first matched row that comes after them in B's order.
    """
    def node_of(n: str) -> GradNode | None:
        rec = a_trace.get(n)
        return rec if isinstance(rec, GradNode) else None

    where_b = {n: j for j, n in enumerate(b_nodes)}
    rows: list[Pair] = []
    used: set[int] = set()
    for i, n in enumerate(a_nodes):
        j = where_b.get(translate_node(n, node_of(n), calls))
        if j is None or j in used:
            rows.append(Pair(i, None))
        else:
            used.add(j)
            rows.append(Pair(i, j))
    only_b = [j for j in range(len(b_nodes)) if j not in used]
    if not only_b:
        return rows
    out: list[Pair] = []
    k = 0
    for r in rows:
        while r.b is not None and k < len(only_b) and only_b[k] < r.b:
            out.append(Pair(None, only_b[k]))
            k += 1
        out.append(r)
    out += [Pair(None, j) for j in only_b[k:]]
    return out
