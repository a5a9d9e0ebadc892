"""Sequence alignment of two traces' calls and backward steps, robust to inserted/removed work.

Names are per-API counters, so one extra ``add`` shifts every later ``addN`` in the trace: names
cannot be the join key between two runs. Calls are aligned instead on a key that survives that
drift, ``(phase, kind, module path, api, input shapes, returned output shapes)``, by a longest-matching
sequence alignment (``difflib.SequenceMatcher`` without its popularity heuristic, which would
otherwise ignore the frequent keys a transformer repeats). The position of a call among its
same-API siblings is left out of the key on purpose: the alignment itself supplies order, and a
position would shift with the very insertion we want to tolerate.

Where work repeats (micro-batches, steps), an inserted or removed stretch could sit at several
places that align equally well by structure: B's extra micro-batch at the start or at the end.
The run of insertions is slid to the place where the most paired calls read and make the same
checksums, and, where checksums do not tell (none taken, or equal everywhere), to the last place:
the extra work is taken to come after the work both runs did (git's diff slides the same way).

Grad nodes are named after the call that created them (``linear3/AddmmBackward0``), so once the
calls are aligned a node name in A is translated into B's namespace and backward steps align by
those translated names. Leaf accumulators (``<param>/AccumulateGrad``) and nodes made before the
traced block (``external/...``) keep their names.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from tracer.model import BackwardRun, Call, GradNode, Trace


@dataclass(frozen=True)
class Pair:
    """One row of an alignment: indices into A and B; one side is None for an insertion/removal."""

    a: int | None
    b: int | None


def align(keys_a: Sequence[Hashable], keys_b: Sequence[Hashable],
          agree: Callable[[int, int], int] | None = None) -> list[Pair]:
    """Align two key sequences; rows come in execution order of both sides.

    A ``replace`` block (the same stretch holds different work in A and B) becomes its removals
    followed by its insertions: pairing unlike calls would make their values look comparable.
    ``agree(i, j)``: how far A's ``i`` and B's ``j`` agree in content (checksums equal); a run of
    insertions or removals goes where the pairs agree most, else as late as it can (``_slide``).
    """
    sm = difflib.SequenceMatcher(a=list(keys_a), b=list(keys_b), autojunk=False)
    rows: list[Pair] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            rows += [Pair(i1 + k, j1 + k) for k in range(i2 - i1)]
        else:
            rows += [Pair(i, None) for i in range(i1, i2)]
            rows += [Pair(None, j) for j in range(j1, j2)]
    rows = _slide(rows, keys_a, keys_b, agree or _no_content)
    flipped = [Pair(r.b, r.a) for r in rows]  # removals: the same slide with A and B swapped
    rows = _slide(flipped, keys_b, keys_a, lambda j, i: (agree or _no_content)(i, j))
    return [Pair(r.b, r.a) for r in rows]


def _no_content(i: int, j: int) -> int:
    return 0


def _slide(rows: list[Pair], keys_a: Sequence[Hashable], keys_b: Sequence[Hashable],
           agree: Callable[[int, int], int]) -> list[Pair]:
    """Move each run of B-only rows along the paired rows around it, as far as the keys allow,
    to the place where the pairs agree most in content (ties: the last place). Linear in the rows."""
    out = list(rows)
    p = 0
    while p < len(out):
        if out[p].a is not None or out[p].b is None:
            p += 1
            continue
        q = p
        while q < len(out) and out[q].a is None and out[q].b is not None:
            q += 1
        run = q - p
        # The paired rows around the run whose B indices continue the run's without a gap.
        lo = p
        while lo > 0 and out[lo - 1].a is not None and out[lo - 1].b == out[p].b - (p - lo) - 1:  # type: ignore[operator]
            lo -= 1
        hi = q
        while hi < len(out) and out[hi].a is not None and out[hi].b == out[q - 1].b + (hi - q) + 1:  # type: ignore[operator]
            hi += 1
        a_idx = [r.a for r in out[lo:p]] + [r.a for r in out[q:hi]]
        if not a_idx:
            p = q
            continue
        b0 = out[lo].b if lo < p else out[p].b
        assert b0 is not None
        at = p - lo  # where the run starts among the window's paired rows
        # Score and validity of each start k, moving one step at a time from the aligner's own.
        best, best_k, score = 0, at, 0
        k = at
        while k < len(a_idx) and keys_a[a_idx[k]] == keys_b[b0 + k]:  # type: ignore[index]
            score += agree(a_idx[k], b0 + k) - agree(a_idx[k], b0 + k + run)  # type: ignore[arg-type]
            k += 1
            if score >= best:
                best, best_k = score, k
        score, k = 0, at
        while k > 0 and keys_a[a_idx[k - 1]] == keys_b[b0 + k - 1 + run]:  # type: ignore[index]
            score += agree(a_idx[k - 1], b0 + k - 1 + run) - agree(a_idx[k - 1], b0 + k - 1)  # type: ignore[arg-type]
            k -= 1
            if score > best:
                best, best_k = score, k
        if best_k != at:
            window = [Pair(a, b0 + t) for t, a in enumerate(a_idx[:best_k])]
            window += [Pair(None, b0 + best_k + t) for t in range(run)]
            window += [Pair(a, b0 + t + run) for t, a in enumerate(a_idx[best_k:], start=best_k)]
            out[lo:hi] = window
        p = hi
    return out


def _shapes(trace: Trace, names: Sequence[str]) -> tuple[tuple[int, ...] | None, ...]:
    out = []
    for n in names:
        rec = trace.tensors.get(n)
        out.append(None if rec is None else rec.shape)
    return tuple(out)


def call_key(trace: Trace, call: Call) -> Hashable:
    """What identifies a call across two runs of the same program (its name does not).

    Of its outputs, those it returned: the new versions of inputs it changed in place are left
    out. Their shapes are their inputs' (already in the key), and whether a call updates its
    inputs is what may differ between the runs: batch norm in ``train()`` updates its running
    stats, in ``eval()`` not; keyed on them, the two calls never aligned, and the difference was
    told as a removal and an insertion instead of ``arguments differ (training=True vs False)``."""
    changed = set(call.mutated)
    return (call.phase, call.kind, call.module, call.api,
            _shapes(trace, call.inputs), _shapes(trace, [o for o in call.outputs if o not in changed]))


def _checksums(trace: Trace, call: Call) -> tuple[str | None, ...]:
    out = []
    for n in (*call.inputs, *call.outputs):
        rec = trace.tensors.get(n)
        out.append(None if rec is None else rec.md5 or rec.fingerprint)
    return tuple(out)


def align_calls(a: Trace, b: Trace) -> list[Pair]:
    sums_a = [_checksums(a, c) for c in a.calls]
    sums_b = [_checksums(b, c) for c in b.calls]

    def agree(i: int, j: int) -> int:  # the checksums two calls share, place by place
        return sum(1 for x, y in zip(sums_a[i], sums_b[j]) if x is not None and x == y)

    return align([call_key(a, c) for c in a.calls], [call_key(b, c) for c in b.calls], agree)


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


def pair_runs(a: Trace, b: Trace, calls: dict[str, str]) -> list[tuple[BackwardRun | None, BackwardRun | None]]:
    """A's backward runs paired with B's: by what they start from (a root made by calls that
    align), so that an extra micro-batch's run in B pairs with nothing wherever it ran; runs
    whose roots tell nothing (made before the block, or by calls that do not align) pair in order
    among themselves. Rows in the order of A's runs, B's unpaired ones where they ran."""
    def producer(trace: Trace, tensor: str) -> str | None:
        rec = trace.tensors.get(tensor)
        return rec.producer if rec is not None else None

    by_root: dict[str, int] = {}
    for j, run in enumerate(b.backward_runs):
        for root in run.roots:
            made = producer(b, root)
            if made is not None:
                by_root.setdefault(made, j)
    matched: dict[int, int] = {}  # A run -> B run
    taken: set[int] = set()
    for i, run in enumerate(a.backward_runs):
        for root in run.roots:
            made = producer(a, root)
            partner = by_root.get(calls.get(made, "")) if made is not None else None
            if partner is not None and partner not in taken:
                matched[i] = partner
                taken.add(partner)
                break
    # The rest in order, each A run with the first free B run after the last one paired.
    free_b = [j for j in range(len(b.backward_runs)) if j not in taken]
    for i in range(len(a.backward_runs)):
        if i in matched:
            continue
        after = max((matched[k] for k in matched if k < i), default=-1)
        free = next((j for j in free_b if j > after and j not in taken), None)
        if free is not None:
            matched[i] = free
            taken.add(free)
    rows: list[tuple[BackwardRun | None, BackwardRun | None]] = []
    placed_b: set[int] = set()
    for i, run in enumerate(a.backward_runs):
        paired = matched.get(i)
        if paired is not None:
            # B's unpaired runs that ran before this one's partner come first.
            for k in range(paired):
                if k not in taken and k not in placed_b:
                    rows.append((None, b.backward_runs[k]))
                    placed_b.add(k)
            rows.append((run, b.backward_runs[paired]))
        else:
            rows.append((run, None))
    rows += [(None, b.backward_runs[k]) for k in range(len(b.backward_runs)) if k not in taken and k not in placed_b]
    return rows
