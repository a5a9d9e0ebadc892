"""Compare two traces (``diff``): the first divergence, forward and backward, with its call stacks.

``diff(a, b)`` aligns the two runs (``export.diff.align``: a sequence alignment on keys that survive
inserted or removed work), compares every aligned record's tensors and finds, separately for the
forward API calls and for the backward grad-node executions, the **origin**: the first aligned
record whose inputs match but whose outputs differ. Every later record with a differing output is
*contaminated* (counted per module). A parameter, buffer or input that already differs enters at
the first call that reads it: that call is the origin. A record that differs only because it reads
a gradient (an optimizer step after a nondeterministic backward) is counted apart, so "forward
matches" stays true when only backward went astray. The forward section holds every API call of
the block but those a backward made, whatever their ``Call.phase`` (forward, the optimizer's, one
a newer file names); the backward section every grad-node execution, matched by node name through
the call alignment, with the origin's reason telling a node whose saved forward values differ from
a backward-only difference. How each record is classified (its status and note) is one registry
of named rules, ``export.diff.rules``; the engine gathers the facts a rule reads.

Parameters and buffers are compared by name at the value the step read (the first call that
reads one without changing it), also where the block made them (a model built inside the traced
step: ``gradtrace run --steps 0``), then by their gradient and their value after the step. Every
parameter already different as the step began, in values from before it, means the runs parted
at an earlier step: the verdict says so first (``DiffResult.parted_earlier``).

Comparisons are bit-exact by default (MD5 of each tensor). With ``rtol``/``atol`` they use the
recorded stats (min, max, mean, absmax and NaN/Inf counts): a record is within tolerance when for
every stat ``|a - b| <= atol + rtol * scale``, where ``scale`` is the larger absmax of the two
tensors. The relative error reported is ``max|a - b| / scale``. Measuring every stat against the
tensor's magnitude, not against the stat itself, keeps a mean near zero from reporting a huge
relative error for a difference far below the tensor's precision. Every number derived from stats
says so (``basis`` ``stats``): it is a difference of summaries, not of elements. Where both traces
kept a tensor's values (``trace(keep_values=...)``), that tensor is compared element by element
instead (``export.diff.elements``: max abs, max rel, how many elements differ and the first).

Traces made with different hash algorithms or trace-format versions are refused (``DiffError``,
exit status 2), never called equal.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from export.diff.align import Pair, align_calls, align_steps, call_mapping, pair_runs
from export.diff.elements import ONLY_STATS, STATS_WORDS, comparable, element_diff
from export.diff.result import (
    LATER_DIFFERING,
    Compared,
    DiffResult,
    Divergence,
    ModuleStat,
    ParamDiff,
    Row,
    Tolerance,
)
from export.diff.rules import (
    BACKWARD,
    CAST_APIS,
    CAST_NODES,
    FORWARD,
    SOURCE,
    STRUCTURE,
    Facts,
    classify,
    random_op,
)
from export.errors import DiffError
from export.load import load_with_notes
from export.views import checksum
from tracer.model import SCHEMA_VERSION, Call, GradNode, NodeRun, Stats, TensorRecord, Trace
from tracer.model.display import args_pair, param_module, plural
from tracer.model.names import base_name, gradient_of

INF = math.inf
_STATS = ("min", "max", "mean", "absmax")
# Below this share of aligned forward calls two traces are not two runs of one program: the
# verdict says so instead of listing every call as inserted or removed. Runs of one program that
# diverge (an extra op, a changed branch, fp32 against bf16 autocast) align far above it.
UNRELATED_SHARE = 0.10
SAME_MODEL_SHARE = 0.9  # of the parameters matching by name and shape: one model, whatever the calls


# ---- comparing two tensors ---------------------------------------------------------------------
def stat_diff(sa: Stats | None, sb: Stats | None) -> tuple[float, float, float] | None:
    """(largest absolute stat difference, relative to scale, scale), or None without stats."""
    if sa is None or sb is None:
        return None
    if sa.nan != sb.nan or sa.inf != sb.inf:
        return INF, INF, INF
    scale = max(abs(sa.absmax or 0.0), abs(sb.absmax or 0.0))
    worst = 0.0
    for f in _STATS:
        x, y = getattr(sa, f), getattr(sb, f)
        if x is None and y is None:  # no finite value at all in either
            continue
        if x is None or y is None:
            return INF, INF, INF
        worst = max(worst, abs(float(x) - float(y)))
    rel = worst / scale if scale > 0 else (0.0 if worst == 0 else INF)
    return worst, rel, scale


class Comparer:
    """Compares tensors of A and B by name, bit-exact (digests) or within a tolerance (stats)."""

    def __init__(self, a: Trace, b: Trace, tol: Tolerance | None) -> None:
        self.a, self.b, self.tol = a, b, tol
        self._cache: dict[tuple[str, str], Compared] = {}

    def __call__(self, na: str, nb: str) -> Compared:
        key = (na, nb)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._compare(self.a.tensors.get(na), self.b.tensors.get(nb))
        return hit

    def _compare(self, ra: TensorRecord | None, rb: TensorRecord | None) -> Compared:
        if ra is None or rb is None:
            return Compared("unknown", why="not recorded")
        if ra.uninitialized or rb.uninitialized:  # memory nobody wrote (torch.empty_like): never compared
            return Compared("skipped", why="uninitialised memory")
        if ra.shape != rb.shape:
            # No number: tensors of two shapes are not an infinite difference apart, and an inf
            # would win every "largest difference" (a module's max abs, the verdict's largest).
            return Compared("differ", None, None, f"shape {list(ra.shape)} vs {list(rb.shape)}", mismatch=True,
                            shapes_differ=True)
        da, db = checksum(ra), checksum(rb)
        if ra.values is not None and rb.values is not None and comparable(ra.dtype, rb.dtype):
            return self._compare_values(ra, rb, da, db)
        sd = stat_diff(ra.stats, rb.stats)
        ab, rel = (None, None) if sd is None else (sd[0], sd[1])
        basis = "" if sd is None else "stats"
        if self.tol is None:
            if ra.dtype != rb.dtype:
                return Compared("differ", ab, rel, f"dtype {ra.dtype} vs {rb.dtype}", basis, mismatch=True)
            if da and db:
                return Compared("equal" if da == db else "differ", ab, rel, "" if da == db else "checksum", basis)
            if sd is not None and sd[0] > 0:  # stats differ: the values differ, hashed or not
                return Compared("differ", ab, rel, "stats", basis)
            return Compared("unknown", ab, rel, ra.hash_note or rb.hash_note or "no checksum", basis)
        if da and db and da == db and ra.dtype == rb.dtype:
            return Compared("equal", 0.0, 0.0)
        if 0 in ra.shape:  # no elements (of the same shape): nothing to differ
            return Compared("equal", 0.0, 0.0)
        if sd is None:
            return Compared("unknown", why="no stats")
        within = sd[0] <= self.tol.atol + self.tol.rtol * sd[2]
        return Compared("equal" if within else "differ", ab, rel, "" if within else "beyond tolerance", basis)

    def _compare_values(self, ra: TensorRecord, rb: TensorRecord, da: str | None, db: str | None) -> Compared:
        """Both traces kept this tensor's values: element-wise, exact or within the tolerance
        (``|a - b| <= atol + rtol * |b|`` for every element, as ``torch.allclose``); also across
        dtypes read as numbers (float32 against bfloat16 under autocast)."""
        assert ra.values is not None and rb.values is not None
        tol = self.tol or Tolerance()
        e = element_diff(ra.values, rb.values, ra.dtype, ra.shape, tol.rtol, tol.atol, rb.dtype)
        if self.tol is None:
            if ra.dtype != rb.dtype:  # never bit-identical; the numbers say how far apart
                return Compared("differ", e.max_abs, e.max_rel, f"dtype {ra.dtype} vs {rb.dtype}", "values", e,
                                mismatch=True)
            same = e.differing == 0 and not (da and db and da != db)
            return Compared("equal" if same else "differ", e.max_abs, e.max_rel, "" if same else "values", "values", e)
        within = e.beyond == 0
        return Compared("equal" if within else "differ", e.max_abs, e.max_rel, "" if within else "beyond tolerance",
                        "values", e)


# ---- helpers -----------------------------------------------------------------------------------
def _max_opt(x: float | None, y: float | None) -> float | None:
    if x is None:
        return y
    if y is None:
        return x
    return max(x, y)


def _mismatch(outs: list[tuple[str | None, str | None, Compared]]) -> str:
    """The first differing output's shape or dtype mismatch in words (``dtype float32 vs
    bfloat16``), or ``""``."""
    first = next((c for _, _, c in outs if c.status == "differ"), None)
    return first.why if first is not None and first.mismatch else ""


def _classify(row: Row, facts: Facts) -> str:
    """Give ``row`` the status and note of the rule its facts match (``export.diff.rules``);
    returns the status."""
    rule = classify(facts)
    row.status, row.rule, row.note = rule.status, rule.name, rule.note(facts)
    return row.status


def _only_row(row: Row, side: str, is_cast: bool, cmp: Comparer) -> Row:
    """A record only one trace has: inserted, removed, or a cast one side made."""
    _classify(row, Facts("only", row.a or row.b or "", row.what, tolerance=cmp.tol is not None, only_in=side,
                         cast=is_cast))
    return row


def _post_order(trace: Trace) -> dict[int, int]:
    """Rank of each call in completion order: a custom Function after the calls inside it.

    Calls are in start order, so a Function precedes its nested calls; but the difference enters
    inside it, and the innermost call is the useful origin.
    """
    order: list[int] = []
    stack: list[int] = []
    for i, c in enumerate(trace.calls):
        while stack and trace.calls[stack[-1]].name != c.parent:
            order.append(stack.pop())
        stack.append(i)
    order += reversed(stack)
    return {i: k for k, i in enumerate(order)}


def _compare_lists(cmp: Comparer, xs: Sequence[str | None], ys: Sequence[str | None]
                   ) -> list[tuple[str | None, str | None, Compared]]:
    out = []
    for x, y in zip(xs, ys):
        if x is None and y is None:
            continue
        if x is None or y is None:
            out.append((x, y, Compared("differ", None, None, "missing on one side")))
        else:
            out.append((x, y, cmp(x, y)))
    if len(xs) != len(ys):
        out.append((None, None, Compared("differ", None, None, "different number of tensors")))
    return out


class _Section:
    """Shared bookkeeping of one section while its rows are evaluated in order."""

    def __init__(self, name: str) -> None:
        self.div = Divergence(name)
        self.candidates: list[tuple[int, Row, str]] = []  # (rank, row, reason)

    def finish_row(self, row: Row, outs: list[tuple[str | None, str | None, Compared]]) -> None:
        for _, _, c in outs:
            row.absorb(c)

    def close(self) -> Divergence:
        d = self.div
        if self.candidates:
            self.candidates.sort(key=lambda t: t[0])
            _, origin, reason = self.candidates[0]
            origin.status = "origin"
            d.origin, d.reason = origin, reason
            d.independent = [r.a for _, r, _ in self.candidates[1:] if r.a is not None]
        contaminated: Counter[str] = Counter()
        from_backward: Counter[str] = Counter()
        seen_origin = d.origin is None
        for r in d.rows:
            if r is d.origin:
                seen_origin = True
            if r.status in LATER_DIFFERING:
                contaminated[r.module] += 1
            elif r.status == "gradient":
                from_backward[r.module] += 1
            if r.status == "inserted" and r.b is not None:
                d.inserted.append(r.b)
            elif r.status == "removed" and r.a is not None:
                d.removed.append(r.a)
            elif r.status == "cast":
                d.casts.append(r.a or r.b or "")
            if r.a is not None and r.b is not None:
                d.per_module.setdefault(r.module, ModuleStat()).add(r)
                if r.max_rel is not None and (d.largest is None or r.max_rel > (d.largest.max_rel or 0.0)):
                    d.largest = r
                if not seen_origin and r.max_rel is not None:
                    d.before_origin = _max_opt(d.before_origin, r.max_rel)
        d.contaminated, d.from_backward = dict(contaminated), dict(from_backward)
        if d.origin is not None and d.before_origin is None:
            d.before_origin = 0.0
        return d


# ---- forward ------------------------------------------------------------------------------------
def _forward(a: Trace, b: Trace, cmp: Comparer, rows: list[Pair]) -> tuple[Divergence, dict[str, str]]:
    """Evaluate aligned calls; also returns, per A call, whether any of its tensors differ."""
    sec = _Section("forward")
    d = sec.div
    a_calls = {c.name for c in a.calls}
    removed_a = {a.calls[r.a].name for r in rows if r.b is None and r.a is not None}
    inserted_b = {b.calls[r.b].name for r in rows if r.a is None and r.b is not None}
    cause: dict[str, str] = {}  # A call -> why its outputs differ
    touched: dict[str, str] = {}  # A call -> what of it differs ("" when nothing)
    ranks = _post_order(a)
    first_reader: dict[str, str] = {}  # A tensor -> the first call outside backward that read it
    for c in a.calls:
        if c.phase != "backward":
            for i in c.inputs:
                first_reader.setdefault(i, c.name)

    def input_cause(na: str | None, nb: str | None) -> tuple[str, str]:
        ra = a.tensors.get(na) if na else None
        rb = b.tensors.get(nb) if nb else None
        pa = ra.producer if ra else None
        pb = rb.producer if rb else None
        if (pb is not None and pb in inserted_b) or (pa is not None and pa in removed_a):
            return STRUCTURE, f"reads {nb or na}, made by a call only one trace has"
        if pa is not None and pa in a_calls:
            return cause.get(pa, FORWARD), ""
        if (ra is not None and ra.role == "grad") or pa is not None:  # made by a grad node
            return BACKWARD, ""
        # A parameter, buffer, input or optimizer state that existed before the block: a
        # difference in it is where a divergence enters, not something an earlier call caused.
        role = ra.role if ra is not None else "tensor"
        return SOURCE, f"{role} {na}"

    # Random calls only one trace made, so far: each drew from the RNG, so a later random op
    # both traces call draws other numbers for a known reason (B's extra layer's init first).
    random_only: dict[str, list[str]] = {"A": [], "B": []}

    def rng_advanced_by() -> str:
        return "; ".join(f"{', '.join(names[:2])}{f' … {len(names) - 2} more' if len(names) > 2 else ''} "
                         f"(only in {side})" for side, names in random_only.items() if names)

    for r in rows:
        # Calls a grad node's own code made (a custom backward) belong to the backward section;
        # every other phase's calls (forward, the optimizer's, any later one) to this one.
        if (r.a is not None and a.calls[r.a].phase == "backward") or (r.b is not None and b.calls[r.b].phase == "backward"):
            continue
        if r.b is None:
            assert r.a is not None
            c = a.calls[r.a]
            d.rows.append(_only_row(Row(c.name, None, c.module, c.api, phase=c.phase), "A", c.api in CAST_APIS, cmp))
            if random_op(c.api) is not None:
                random_only["A"].append(c.name)
            continue
        if r.a is None:
            c = b.calls[r.b]
            d.rows.append(_only_row(Row(None, c.name, c.module, c.api, phase=c.phase), "B", c.api in CAST_APIS, cmp))
            if random_op(c.api) is not None:
                random_only["B"].append(c.name)
            continue
        ca, cb = a.calls[r.a], b.calls[r.b]
        row = Row(ca.name, cb.name, ca.module, ca.api, phase=ca.phase)
        d.rows.append(row)
        d.compared += 1
        ins = _compare_lists(cmp, ca.inputs, cb.inputs)
        outs = _compare_lists(cmp, ca.outputs, cb.outputs)
        sec.finish_row(row, outs)
        diff_in = [(x, y) for x, y, c in ins if c.status == "differ"]
        diff_out = [x for x, _, c in outs if c.status == "differ"]
        touched[ca.name] = (f"its input {', '.join(x or y or '?' for x, y in diff_in)} differs" if diff_in
                            else "its outputs differ" if diff_out else "")
        if not diff_out:
            if any(c.status == "unknown" for _, _, c in outs):
                row.status = "unknown"
                d.unknown += 1
            continue
        causes = [input_cause(x, y) for x, y in diff_in]
        kinds = frozenset(k for k, _ in causes)
        changed = [x or y or "?" for (x, y), (k, _) in zip(diff_in, causes) if k == SOURCE]
        facts = Facts("call", ca.name, ca.api, kinds, cmp.tol is not None, row.max_rel, _mismatch(outs),
                      unknown=tuple(f"{x or y} ({c.why or 'not compared'})" for x, y, c in ins if c.status == "unknown"),
                      # (an index or a scalar the program chose differently)
                      args=args_pair(ca.args, cb.args) if ca.args != cb.args else "",
                      sources=tuple(t for k, t in causes if k == SOURCE),
                      read_first_by=tuple(sorted({first_reader[n] for n in changed
                                                  if first_reader.get(n, ca.name) != ca.name})),
                      structure=next((t for k, t in causes if k == STRUCTURE), ""),
                      rng_advanced_by=rng_advanced_by())
        status = _classify(row, facts)
        if status == "new":
            cause[ca.name] = FORWARD
            sec.candidates.append((ranks[r.a], row, row.note))
        elif status == "contaminated":
            cause[ca.name] = FORWARD if FORWARD in kinds else STRUCTURE
        elif status == "unknown":  # (rule unknown-input) its outputs differ as what it could not compare
            d.unknown += 1
            unknown_kinds = {input_cause(x, y)[0] for x, y, c in ins if c.status == "unknown"}
            cause[ca.name] = next((k for k in (FORWARD, STRUCTURE) if k in unknown_kinds), BACKWARD)
        else:
            cause[ca.name] = BACKWARD
    sec.close()
    if d.origin is not None:
        oa, ob = a.get(d.origin.a or ""), b.get(d.origin.b or "")
        d.stack_a = getattr(oa, "stack", ())
        d.stack_b = getattr(ob, "stack", ())
    return d, touched


# ---- backward -----------------------------------------------------------------------------------
def _node_module(trace: Trace, node: GradNode | None) -> str:
    if node is None:
        return ""
    if node.call is not None:
        c = trace.get(node.call)
        return getattr(c, "module", "")
    return param_module(node.param) if node.param else ""


def _node_kind(trace: Trace, name: str) -> tuple[GradNode | None, str]:
    n = trace.get(name)
    if isinstance(n, GradNode):
        return n, n.kind
    return None, name.rsplit("/", 1)[-1]


def _missing_gradients(a: Trace, b: Trace, sa: NodeRun, sb: NodeRun) -> str:
    """The gradients a node makes on one side only, in words: ``B makes no gradient for 0.bias
    (A does)`` (a bias frozen in B: autograd gives its slot no edge). Named by the tensor the
    gradient is of, else by the accumulator its edge leads to, else by the output's place."""
    out = []
    for i, (x, y) in enumerate(zip(sa.grads_out, sb.grads_out)):
        if (x is None) == (y is None):
            continue
        trace, name, node, none, made = (a, x, sa.node, "B", "A") if y is None else (b, y, sb.node, "A", "B")
        assert name is not None
        target = gradient_of(name)
        if target is None:
            g = trace.get(node)
            nxt = g.next[i] if isinstance(g, GradNode) and i < len(g.next) else None
            leaf = trace.get(nxt) if nxt else None
            target = leaf.param if isinstance(leaf, GradNode) and leaf.param else None
        out.append(f"{none} makes no gradient for {target or f'its output {i}'} ({made} does)")
    return ", ".join(out)


def _unaligned_call(b: Trace, call: str | None, sb: NodeRun, calls: dict[str, str], b_aligned: set[str]) -> str:
    """``cross_entropy0 is only in A's forward, cross_entropy0 only in B's``: the node's forward
    call, where it did not align with a call of B (another batch size changes its inputs'
    shapes), else ``""``. Nothing then says the forward matched."""
    if call is None or call in calls:
        return ""
    nb = b.get(sb.node)
    cb = nb.call if isinstance(nb, GradNode) else None
    return f"{call} is only in A's forward" + (f", {cb} only in B's" if cb and cb not in b_aligned else "")


def _backward(a: Trace, b: Trace, cmp: Comparer, calls: dict[str, str],
              touched: dict[str, str]) -> Divergence:
    sec = _Section("backward")
    d = sec.div
    cause: dict[str, str] = {}  # A node -> cause of its differing gradients
    hooked: set[str] = set()  # nodes whose hooks' calls were compared (at their first run)
    by_name = _Calls.of(a, b)
    b_aligned = set(calls.values())
    rank = 0
    ranks: dict[int, int] = {}
    for ra, rb in pair_runs(a, b, calls):
        only = ra if rb is None else rb if ra is None else None
        if only is not None:
            d.notes.append(f"backward run {only.name} is only in {'A' if rb is None else 'B'}")
        a_steps = ra.steps if ra is not None else []
        b_steps = rb.steps if rb is not None else []
        # The run's seed gradients (loss.backward(g)); any other gradient no node made is a sum
        # the engine took of several edges' gradients, which differs because they do.
        seeds = {f"{r}@grad" for r in (ra.roots if ra is not None else [])}
        inserted_b: set[str] = set()
        pairs = align_steps([s.node for s in a_steps], [s.node for s in b_steps], a, calls)
        for p in pairs:
            if p.a is None:
                assert p.b is not None
                inserted_b.add(b_steps[p.b].node)
        for p in pairs:
            if p.b is None:
                assert p.a is not None
                node, kind = _node_kind(a, a_steps[p.a].node)
                d.rows.append(_only_row(Row(a_steps[p.a].node, None, _node_module(a, node), kind, phase="backward"),
                                        "A", kind in CAST_NODES, cmp))
                continue
            if p.a is None:
                node, kind = _node_kind(b, b_steps[p.b].node)
                d.rows.append(_only_row(Row(None, b_steps[p.b].node, _node_module(b, node), kind, phase="backward"),
                                        "B", kind in CAST_NODES, cmp))
                continue
            sa, sb = a_steps[p.a], b_steps[p.b]
            node, kind = _node_kind(a, sa.node)
            # The node's hooks' and own code's calls first (a tensor or module backward hook, the
            # ops of a custom backward): the first of them whose inputs match but outputs differ
            # is where the difference entered.
            inner = _inner_origin(cmp, sa, calls, d, hooked, by_name)
            if inner is not None:
                ranks[id(inner[0])] = rank
                rank += 1
            row = Row(sa.node, sb.node, _node_module(a, node), kind, phase="backward")
            d.rows.append(row)
            d.compared += 1
            ranks[id(row)] = rank
            rank += 1
            ins = _compare_lists(cmp, sa.grads_in, sb.grads_in)
            outs = _compare_lists(cmp, sa.grads_out, sb.grads_out)
            sec.finish_row(row, outs)
            row.missing = _missing_gradients(a, b, sa, sb)
            # Gradients in that differ only because the node's own hooks made them (a tensor hook's
            # result is what the node receives) leave the hook's call the origin.
            ins_match = not any(c.status == "differ" and not by_name.made_inside(a, x, sa.node) for x, _, c in ins)
            call = node.call if node is not None else None
            touched_call = touched.get(call, "") if call is not None else ""
            unaligned = _unaligned_call(b, call, sb, calls, b_aligned)
            if inner is not None and ins_match and not any(c.status == "differ" for _, _, c in outs):
                # (a hook of an accumulator, which produces nothing: its leaf's .grad differs)
                irow, facts = inner
                _classify(irow, facts)
                sec.candidates.append((ranks[id(irow)], irow, irow.note))
                continue
            if not any(c.status == "differ" for _, _, c in outs):
                if any(c.status == "unknown" for _, _, c in outs):
                    row.status = "unknown"
                    d.unknown += 1
                continue
            if inner is not None and ins_match:
                irow, facts = inner
                _classify(irow, replace(facts, node_call=call, call_touched=touched_call, call_unaligned=unaligned))
                cause[sa.node] = BACKWARD
                row.status = "contaminated"
                sec.candidates.append((ranks[id(irow)], irow, irow.note))
                continue
            kinds = set()
            for x, y, c in ins:
                if c.status != "differ":
                    continue
                ta = a.tensors.get(x) if x else None
                tb = b.tensors.get(y) if y else None
                if tb is not None and tb.producer in inserted_b:
                    kinds.add(STRUCTURE)
                elif ta is not None and ta.producer is not None:
                    kinds.add(cause.get(ta.producer, BACKWARD))
                elif ta is None or (x or "").split("#")[0] in seeds:
                    kinds.add(SOURCE)  # the seed gradient of the run (loss.backward(g))
                else:
                    kinds.add(BACKWARD)  # a sum of edges' gradients (their nodes differ)
            facts = Facts("node", sa.node, kind, frozenset(kinds), cmp.tol is not None, row.max_rel, _mismatch(outs),
                          node_call=call, call_touched=touched_call, missing=row.missing, call_unaligned=unaligned)
            if _classify(row, facts) == "new":
                cause[sa.node] = BACKWARD
                sec.candidates.append((ranks[id(row)], row, row.note))
            else:
                cause[sa.node] = STRUCTURE if kinds == {STRUCTURE} else BACKWARD
    sec.close()
    if d.origin is not None:
        na, nb = a.get(d.origin.a or ""), b.get(d.origin.b or "")
        d.stack_a = getattr(na, "stack", ())
        d.stack_b = getattr(nb, "stack", ())
    return d


@dataclass
class _Calls:
    """The calls of A and B by name, and A's by parent: built once per diff."""

    a: dict[str, Call]
    b: dict[str, Call]
    children: dict[str, list[Call]]

    @classmethod
    def of(cls, a: Trace, b: Trace) -> _Calls:
        children: dict[str, list[Call]] = {}
        for c in a.calls:
            if c.parent is not None:
                children.setdefault(c.parent, []).append(c)
        return cls({c.name: c for c in a.calls}, {c.name: c for c in b.calls}, children)

    def made_inside(self, a: Trace, tensor: str | None, node: str) -> bool:
        """Whether A's ``tensor`` was made by a call of ``node``'s hooks or own code."""
        rec = a.tensors.get(tensor) if tensor else None
        call = self.a.get(rec.producer) if rec is not None and rec.producer else None
        return call is not None and call.parent == node


def _inner_origin(cmp: Comparer, sa: NodeRun, calls: dict[str, str], d: Divergence, hooked: set[str],
                  by_name: _Calls) -> tuple[Row, Facts] | None:
    """The first call of a node's hooks (a tensor hook on its forward output, a hook on a leaf,
    a module backward hook: at the node's first run) or of its own code (nested calls first)
    whose inputs match but whose outputs differ: a row for it (added to ``d``, classified by the
    caller, who knows the node's forward call) and its facts, or None."""
    children, a_calls, b_calls = by_name.children, by_name.a, by_name.b
    names = list(sa.calls)
    if sa.node not in hooked:
        hooked.add(sa.node)
        own = set(sa.calls)
        names[:0] = [c.name for c in children.get(sa.node, ()) if c.name not in own]
    if not names:
        return None

    def post_order(names: list[str]) -> list[Call]:
        out: list[Call] = []
        for n in names:
            c = a_calls.get(n)
            if c is not None:
                out += post_order([k.name for k in children.get(n, [])])
                out.append(c)
        return out

    for ca in post_order(names):
        cb = b_calls.get(calls.get(ca.name, ""))
        if cb is None:
            continue
        ins = _compare_lists(cmp, ca.inputs, cb.inputs)
        outs = _compare_lists(cmp, ca.outputs, cb.outputs)
        if any(x.status == "differ" for _, _, x in outs) and not any(x.status == "differ" for _, _, x in ins):
            row = Row(ca.name, cb.name, ca.module, ca.api, phase=ca.phase)
            for _, _, x in outs:
                row.absorb(x)
            d.rows.append(row)
            in_own_code = ca.name in sa.calls or _nested_in(ca, set(sa.calls), a_calls)
            return row, Facts("call", ca.name, ca.api, frozenset(), cmp.tol is not None, row.max_rel, _mismatch(outs),
                              inside=sa.node, hook=not in_own_code,
                              args=args_pair(ca.args, cb.args) if ca.args != cb.args else "")
    return None


def _nested_in(call: Call, names: set[str], calls: dict[str, Call]) -> bool:
    """Whether ``call`` runs inside one of the calls ``names`` (a parent chain reaches one)."""
    parent = call.parent
    while parent is not None and parent in calls:
        if parent in names:
            return True
        parent = calls[parent].parent
    return False


# ---- parameters ----------------------------------------------------------------------------------
def _param_names(t: Trace) -> list[str]:
    """Every parameter and buffer of the trace by name, in the order the trace met them: those
    from before the block, and those the block made (a model built inside the traced step:
    ``gradtrace run --steps 0``), whose first record names a value an init call produced."""
    return [r.name for r in t.tensors_in_order()
            if r.role in ("param", "buffer") and base_name(r.name) == r.name and gradient_of(r.name) is None]


def _values_read(t: Trace, params: set[str]) -> dict[str, str]:
    """Per parameter, the version the step read: the first input of a call that reads it without
    changing it (an in-place init of a weight reads the value it overwrites: the next reader's
    value is the one the step computed with). A parameter no call reads keeps its own name."""
    # One that came from before the block is read as it was: nothing in the step made it (batch
    # norm's running stats change in its forward, and a later reader would read the new value).
    made_here = {p for p in params if (r := t.tensors.get(p)) is not None and (r.producer is not None or r.uninitialized)}
    read: dict[str, str] = {p: p for p in params if p not in made_here}
    for c in t.calls:
        changed = {base_name(m) for m in c.mutated}
        for i in c.inputs:
            p = base_name(i)
            if p in made_here and p not in read and p not in changed:
                read[p] = i
    return read


def _grad_name(t: Trace, p: str) -> str | None:
    """The gradient of ``p`` that the optimizer step read (with gradient accumulation, the sum of
    the micro-batches' gradients), else the last value of ``p``'s gradient in the trace."""
    for c in t.calls:
        if c.kind == "optimizer":
            for i in c.inputs:
                if gradient_of(i) == p:
                    return i
    last = None
    for n, rec in t.tensors.items():  # in recording order
        if rec.role == "grad" and gradient_of(n) == p and "#" not in n:
            last = n
    return last if last is not None else (f"{p}@grad" if f"{p}@grad" in t.tensors else None)


def _step_versions(t: Trace) -> dict[str, list[str]]:
    """Per parameter, the versions the optimizer steps made, in order."""
    out: dict[str, list[str]] = {}
    for c in t.calls:
        if c.kind == "optimizer":
            for m in c.mutated:
                rec = t.tensors.get(m)
                if rec is not None and rec.role in ("param", "buffer"):
                    out.setdefault(m.split("@v")[0], []).append(m)
    return out


def _last_version(t: Trace, p: str) -> str | None:
    best, name = 0, None
    prefix = f"{p}@v"
    for n in t.tensors:
        if n.startswith(prefix) and n[len(prefix):].isdigit() and int(n[len(prefix):]) > best:
            best, name = int(n[len(prefix):]), n
    return name


def _params(a: Trace, b: Trace, cmp: Comparer, notes: list[str]) -> list[ParamDiff]:
    pa, pb = _param_names(a), _param_names(b)
    in_b = set(pb)
    read_a, read_b = _values_read(a, set(pa)), _values_read(b, in_b)
    out = []
    # Runs of different lengths: each parameter after the last optimizer step both made.
    steps_a = sum(1 for c in a.calls if c.kind == "optimizer")
    steps_b = sum(1 for c in b.calls if c.kind == "optimizer")
    common = min(steps_a, steps_b)
    made_a, made_b = (_step_versions(a), _step_versions(b)) if steps_a != steps_b and common else ({}, {})
    if made_a:
        notes.append(f"A made {plural(steps_a, 'optimizer step')}, B {steps_b}: each parameter is compared "
                     f"after step {common}, the last both made")
    for p in pa:
        if p not in in_b:  # (a buffer only one trace has is counted as a buffer, not a parameter)
            out.append(ParamDiff(p, Compared("unknown"), only_in="A", buffer=a.tensors[p].role == "buffer"))
            continue
        # The value the step read (a model built inside the step: the one its init made).
        seen_a, seen_b = read_a.get(p, p), read_b.get(p, p)
        made = [t.tensors[v].producer for t, v in ((a, seen_a), (b, seen_b)) if v in t.tensors]
        pd = ParamDiff(p, cmp(seen_a, seen_b), read=seen_a, made_in_step=any(m is not None for m in made),
                       buffer=a.tensors[p].role == "buffer")
        ga, gb = _grad_name(a, p), _grad_name(b, p)
        if ga or gb:
            pd.grad = cmp(ga, gb) if ga and gb else Compared("differ", why="gradient only on one side")
        va, vb = made_a.get(p, []), made_b.get(p, [])
        ua: str | None
        ub: str | None
        if len(va) >= common and len(vb) >= common and made_a:
            ua, ub = va[common - 1], vb[common - 1]
        else:
            ua, ub = _last_version(a, p), _last_version(b, p)
        if ua or ub:
            pd.updated = cmp(ua, ub) if ua and ub else Compared("differ", why="updated on one side only")
        out.append(pd)
    in_a = set(pa)
    out += [ParamDiff(p, Compared("unknown"), only_in="B", buffer=b.tensors[p].role == "buffer")
            for p in pb if p not in in_a]
    return out


# ---- entry points --------------------------------------------------------------------------------
def _load(x: Trace | str | os.PathLike[str], label: str, notes: list[str]) -> tuple[Trace, str]:
    if isinstance(x, Trace):
        return x, label
    path = os.fspath(x)
    t, messages = load_with_notes(path)
    notes += [f"{label}: {m}" for m in messages]
    return t, path


def _version(t: Trace) -> Any:
    return t.header.get("version", SCHEMA_VERSION)


def check_comparable(a: Trace, b: Trace, tol: Tolerance | None) -> None:
    """Refuse pairs that cannot be compared honestly (``DiffError``)."""
    if _version(a) != _version(b):
        raise DiffError(f"trace format versions differ (A: {_version(a)}, B: {_version(b)}); "
                        "record both with the same gradtrace version")
    ha, hb = a.hash_algorithm, b.hash_algorithm
    if ha != hb:
        raise DiffError(f"traces use different hash algorithms (A: {ha}, B: {hb}); their checksums "
                        "cannot be compared: record both with the same tracer.trace(hash=...)")
    fa, fb = a.header.get("fingerprint"), b.header.get("fingerprint")
    if ha == "fast" and fa != fb:
        raise DiffError(f"traces use different fingerprint algorithms (A: {fa}, B: {fb}), written by "
                        "different gradtrace versions; record both with the same version")
    has_stats = bool(a.header.get("stats")) and bool(b.header.get("stats"))
    if ha == "none":
        if tol is None:
            raise DiffError("checksums are unavailable (both traces were recorded with hash='none'); "
                            "pass --rtol/--atol to compare by stats")
        if not has_stats:
            raise DiffError("traces have neither checksums nor stats (hash='none', stats=False): nothing to compare")
    elif tol is not None and not has_stats:
        raise DiffError("a tolerance needs stats, but a trace was recorded with stats=False")


def diff(a: Trace | str | os.PathLike[str], b: Trace | str | os.PathLike[str], *,
         rtol: float | None = None, atol: float | None = None) -> DiffResult:
    """Compare trace ``a`` with trace ``b`` (objects or paths); see the module docstring."""
    for label, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise DiffError(f"{label} must be a finite number >= 0, got {v}")
    tol = None if rtol is None and atol is None else Tolerance(rtol or 0.0, atol or 0.0)
    notes: list[str] = []
    ta, la = _load(a, "A", notes)
    tb, lb = _load(b, "B", notes)
    check_comparable(ta, tb, tol)
    for label, t in (("A", ta), ("B", tb)):
        if t.status != "ok":
            what = t.error.get("type", "") if t.error else ""
            notes.append(f"{label} is {t.status}{': ' + what if what else ''}; records past that point are missing")
    for label, t in (("A", ta), ("B", tb)):  # a bound reached (max_calls): the rest is missing
        notes += [f"{label}: {n}" for n in t.notes if n.startswith("recording stopped")]
    if ta.header.get("torch") != tb.header.get("torch"):
        notes.append(f"torch versions differ (A: {ta.header.get('torch')}, B: {tb.header.get('torch')})")
    cmp = Comparer(ta, tb, tol)
    rows = align_calls(ta, tb)
    calls = call_mapping(ta, tb, rows)
    fwd, touched = _forward(ta, tb, cmp, rows)
    bwd = _backward(ta, tb, cmp, calls, touched)
    fwd.unrelated = unrelated(ta, tb, fwd)
    params = _params(ta, tb, cmp, notes)
    result = DiffResult(la, lb, tol, fwd, bwd, params, notes, ta, tb)
    if not result.equal or tol is not None:
        kept = [any(r.values is not None for r in t.tensors.values()) for t in (ta, tb)]
        if not any(kept):
            notes.insert(0, ONLY_STATS)
        elif not all(kept):
            side, other = ("A", "B") if kept[0] else ("B", "A")
            notes.insert(0, f"tensor values were kept in {side} only: element-wise differences need them in "
                            f"{other} too (tracer.trace(keep_values=...)); the differences shown are of the stats "
                            f"({STATS_WORDS})")
    return result


def unrelated(a: Trace, b: Trace, fwd: Divergence) -> str:
    """The one line for two traces that next to nothing aligns between (fewer than
    ``UNRELATED_SHARE`` of the larger one's forward calls), else ``""``. Two runs of one program
    that diverge still align almost everywhere; an alignment this poor means two programs, and
    a list of insertions and removals would only hide that."""
    n_a = sum(1 for c in a.calls if c.phase != "backward")  # the calls the forward section aligns
    n_b = sum(1 for c in b.calls if c.phase != "backward")
    aligned = sum(1 for r in fwd.rows if r.a is not None and r.b is not None)
    total = max(n_a, n_b)
    if total == 0 or aligned >= UNRELATED_SHARE * total:
        return ""
    if min(n_a, n_b) == 0:
        side = "A" if n_a == 0 else "B"
        return f"{side} recorded no forward calls ({max(n_a, n_b)} in the other): an empty or cut-off trace?"
    shapes_a = {p: a.tensors[p].shape for p in _param_names(a)}
    shapes_b = {p: b.tensors[p].shape for p in _param_names(b)}
    same = sum(1 for p, shape in shapes_a.items() if shapes_b.get(p) == shape)
    if shapes_a and same >= SAME_MODEL_SHARE * max(len(shapes_a), len(shapes_b)):
        # One model run with other shapes (batch sizes, a different number of micro-batches):
        # the calls do not align, the parameters do, and they are what to read.
        fwd.notes.append(f"few calls align ({aligned} of {total} by module, op and shapes), but {same} of "
                         f"{max(len(shapes_a), len(shapes_b))} parameters match by name and shape: the same "
                         "model run with other shapes (batch size, micro-batches?); read the parameters")
        return ""
    if aligned == 0:
        return (f"these traces share no calls: different models or programs? (A: {n_a} calls, B: {n_b}; "
                "none align by module, op and shapes)")
    return (f"these traces share almost no calls ({aligned} of {total} align by module, op and shapes): "
            "different models or programs?")
