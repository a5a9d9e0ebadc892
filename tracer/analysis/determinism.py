"""Which op is not deterministic: compare traces of the same step run from the same state, and
name the first op whose inputs are bit-equal and whose outputs are not.

``compare_runs(traces)`` takes two or more traces of one step (``tracer.check_determinism``
records them from one snapshot; ``gradtrace run --check-determinism`` from runs of the program
that agree up to the step) and walks them in execution order: the forward calls up to the first
backward, then each backward run's grad-node executions (the calls a custom ``backward`` made
first, then the node itself), then what came after (the optimizer step). Comparisons are by the
recorded checksums (``hash="fast"`` fingerprints or MD5), record by record in recording order:
runs of a deterministic program make the same records in the same order. The first record whose
inputs agree in every run and whose outputs do not is the answer; where the op is one of the usual
suspects its cause is named with what to set (``CAUSES``).

A step whose records or their inputs already differ before any op could have made the
difference (different parameters as the step begins, a different batch, another path through the
code) is reported as such: that is nondeterminism before the step, not in it. A record that reads
other tensors in two runs (other names: the parameters read in another order, as iterating a set
of names does) took another path; its inputs are not compared as values. A call whose inputs are
bit-equal and whose outputs differ, but which was given other non-tensor arguments (``Call.args``:
a warm-up factor from a Python counter, a learning rate a scheduler moved), is not a
nondeterministic op either: the runs read Python state that differs, and that is what is said.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tracer.model import Call, Frame, NodeRun, Trace
from tracer.model.display import args_pair, plural
from tracer.model.frames import FRAMEWORK, frame_class

SET_DETERMINISTIC = "torch.use_deterministic_algorithms(True)"
# A random op given its own generator: its args text names it (``generator=Generator``, see
# tracer.record.naming.short_args). Checked first: the op is random, whatever else it is.
PRIVATE_GENERATOR = (
    "a random op drawing from a torch.Generator of its own (generator=): the check puts torch's default "
    "generators back before each repeat, not a private one, so each repeat draws other numbers from where the "
    "last one left it",
    "re-seed the generator inside the step (g.manual_seed(seed)), or pass it so it can be restored: "
    "tracer.check_determinism(step_fn, ..., generators=[g])")
# (words found in the op's API or node class, or its arguments, the usual cause, what to set)
CAUSES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("generator=",), *PRIVATE_GENERATOR),
    (("index_add",), "index_add_ adds rows with atomic operations on CUDA: where indices repeat, the order of the "
                     "additions (and so the rounding) changes from run to run",
     f"{SET_DETERMINISTIC} (a deterministic kernel), or sum repeated indices in a fixed order"),
    (("scatter_add", "scatter_reduce", "index_reduce", "ScatterAdd"),
     "scatter_add_/scatter_reduce_ accumulate with atomic operations on CUDA: with repeated indices the order of "
     "the additions changes from run to run", f"{SET_DETERMINISTIC}"),
    (("index_put", "IndexPut"), "index_put_(accumulate=True) (x[idx] += v with repeated indices) accumulates with "
                                "atomic operations on CUDA", f"{SET_DETERMINISTIC}"),
    (("embedding", "Embedding"), "embedding's backward sums the gradients of repeated tokens with atomic operations "
                                 "on CUDA", f"{SET_DETERMINISTIC}"),
    (("scaled_dot_product", "flash", "Flash", "efficient_attention", "EfficientAttention"),
     "fused attention kernels (FlashAttention, memory-efficient attention) accumulate dQ in their backward with "
     "atomic operations", f"{SET_DETERMINISTIC}, or the math backend: "
                         "torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)"),
    (("matmul", "linear", ".mm", "addmm", "bmm", "baddbmm", "Mm", "Addmm", "Bmm", "Baddbmm", "einsum"),
     "cuBLAS may split a matrix product's reduction (split-K) over a workspace whose use varies between runs and "
     "streams", f"CUBLAS_WORKSPACE_CONFIG=:4096:8 (environment, before CUDA starts) with {SET_DETERMINISTIC}"),
    (("conv", "Convolution", "Conv"), "cuDNN picks convolution algorithms by timing them, and some are not "
                                      "deterministic", "torch.backends.cudnn.deterministic = True and "
                                                       "torch.backends.cudnn.benchmark = False"),
)
CUSTOM = ("a custom kernel (a custom op, or a custom Function's backward) that accumulates with atomic operations "
          "(atomicAdd, tl.atomic_add) sums in an order that changes from run to run", "accumulate in a fixed order (sort the indices, or a two-pass "
          "reduction), and branch on torch.are_deterministic_algorithms_enabled() for a deterministic path")


@dataclass
class Nondeterministic:
    """The first op whose inputs agree and whose outputs differ."""

    kind: str  # "call" or "node"
    name: str  # the call's or grad node's name in the first run
    what: str  # its API (a call) or PyTorch's node class (a node)
    phase: str  # forward or backward
    stack: tuple[Frame, ...]  # the call's stack (a node: the stack of the call that made it)
    outputs: list[str]  # its outputs that differ
    runs: tuple[int, int]  # which two runs differ there
    cause: str | None = None
    fix: str | None = None

    @property
    def line(self) -> Frame | None:
        """The innermost frame that is not PyTorch's or gradtrace's (the user's or a library's)."""
        return next((f for f in reversed(self.stack) if frame_class(f.file) != FRAMEWORK),
                    self.stack[-1] if self.stack else None)


@dataclass
class DeterminismReport:
    """What ``compare_runs`` (and ``tracer.check_determinism``) found; true when deterministic."""

    repeats: int
    compared: int  # records compared
    first: Nondeterministic | None = None
    before: str | None = None  # the runs differ already as the step begins, or took another path
    traces: list[Trace] = field(default_factory=list, repr=False)

    @property
    def deterministic(self) -> bool:
        return self.first is None and self.before is None

    def __bool__(self) -> bool:
        return self.deterministic

    def describe(self) -> str:
        if self.before is not None:
            return f"not comparable: {self.before}"
        f = self.first
        if f is None:
            return (f"deterministic: {plural(self.repeats, 'run')} of the step from the same state gave bit-equal "
                    f"results ({plural(self.compared, 'record')} compared)")
        where = f.line
        at = f" at {where.file}:{where.line} ({where.code.strip()})" if where is not None else ""
        role = f"the backward of {f.name} ({f.what})" if f.kind == "node" else f"{f.name} ({f.what})"
        lines = [f"not deterministic: {role}{at} got bit-equal inputs in runs {f.runs[0] + 1} and {f.runs[1] + 1} "
                 f"and gave different outputs ({', '.join(f.outputs[:3])})"]
        if f.cause is not None:
            lines.append(f"  usual cause: {f.cause}")
            lines.append(f"  set: {f.fix}")
        return "\n".join(lines)


def compare_runs(traces: Sequence[Trace]) -> DeterminismReport:
    """Compare traces of the same step (see the module docstring)."""
    report = DeterminismReport(len(traces), 0, traces=list(traces))
    if len(traces) < 2:
        return report
    for i in range(1, len(traces)):
        found, before, compared = _compare(traces[0], traces[i], i)
        report.compared = max(report.compared, compared)
        if before is not None or found is not None:
            report.before, report.first = before, found
            return report
    return report


# ---- walking two runs in step ------------------------------------------------------------------------
Item = tuple[str, Call | NodeRun]


def _items(t: Trace) -> Iterator[Item]:
    """The records of a step in execution order (see the module docstring)."""
    calls = {c.name: c for c in t.calls}
    cut = _before_backward(t)
    done: set[str] = set()
    for c in t.calls[:cut]:
        if c.phase == "forward":
            done.add(c.name)
            yield "call", c
    for run in t.backward_runs:
        for step in run.steps:
            for name in step.calls:
                inner = calls.get(name)
                if inner is not None and name not in done:
                    done.add(name)
                    yield "call", inner
            yield "node", step
    for c in t.calls:
        if c.name not in done:
            yield "call", c


def _before_backward(t: Trace) -> int:
    """How many of the calls ran before the first backward: up to the one that made its root
    (the loss; calls and backward runs are numbered apart, so their order is known this way)."""
    if not t.backward_runs:
        return len(t.calls)
    makers = {rec.producer for r in t.backward_runs[0].roots if (rec := t.tensors.get(r)) is not None}
    found = [i for i, c in enumerate(t.calls) if c.name in makers]
    return found[-1] + 1 if found else len(t.calls)


def _digest(t: Trace, name: str | None) -> str | None:
    if name is None:
        return None
    rec = t.tensors.get(name)
    if rec is None or rec.uninitialized:
        return "?"
    return rec.fingerprint or rec.md5 or (f"{rec.shape}{rec.dtype}" if rec.hash_note else "?")


def _ends(t: Trace, kind: str, item: Call | NodeRun) -> tuple[list[str | None], list[str | None]]:
    if kind == "call":
        assert isinstance(item, Call)
        return list(item.inputs), [*item.outputs, *item.mutated]
    assert isinstance(item, NodeRun)
    return list(item.grads_in), list(item.grads_out)


def _compare(a: Trace, b: Trace, i: int) -> tuple[Nondeterministic | None, str | None, int]:
    compared = 0
    for (ka, xa), (kb, xb) in zip(_items(a), _items(b)):
        same_record = ka == kb and (xa.api == xb.api if isinstance(xa, Call) and isinstance(xb, Call)
                                    else isinstance(xa, NodeRun) and isinstance(xb, NodeRun) and xa.node == xb.node)
        if not same_record:
            return None, (f"run {i + 1} took another path than run 1 at record {compared + 1} "
                          f"({_label(xa)} against {_label(xb)})"), compared
        compared += 1
        ins_a, outs_a = _ends(a, ka, xa)
        ins_b, outs_b = _ends(b, kb, xb)
        da, db = [_digest(a, n) for n in ins_a], [_digest(b, n) for n in ins_b]
        if da != db:
            other = _other_tensors(ins_a, ins_b, da, db)
            if other:
                return None, (f"run {i + 1} took another path than run 1 at record {compared}: {_label(xa)} read "
                              f"{other[0]} in run 1 and {other[1]} in run {i + 1} (the same record read other "
                              "tensors: another path or order through the program)"), compared
            outside = [n for n, x, y in zip(ins_a, da, db) if x != y and n is not None and _from_outside(a, n)]
            moved = _read_in_other_order(a, b, ins_a, ins_b, da, db)
            if outside and moved is not None:
                return None, (f"run {i + 1} took another path than run 1 at record {compared}: {_label(xa)} read "
                              f"{moved[0]} in run 1 and, in run {i + 1}, the value run 1 had as {moved[1]} (the runs "
                              "start from the same state and read it in another order)"), compared
            if outside:
                return None, (f"{outside[0]} differs between run 1 and run {i + 1} as the step begins (read by "
                              f"{_label(xa)}): the runs do not start from the same state"), compared
            continue  # a difference made earlier reaches this record: not its own
        oa, ob = [_digest(a, n) for n in outs_a], [_digest(b, n) for n in outs_b]
        if oa != ob and isinstance(xa, Call) and isinstance(xb, Call) and xa.args != xb.args:
            # Bit-equal inputs, other arguments: the outputs differ because the call was asked for
            # something else (Python state the runs do not share), not because the op is random.
            return None, (f"run {i + 1} called {_label(xa)} with other arguments than run 1 at record {compared}: "
                          f"inputs match, arguments differ ({args_pair(xa.args, xb.args)}), outputs differ (the "
                          "step reads a Python value that changed between the runs, e.g. a counter, which the "
                          "check does not put back: another path, not a nondeterministic op)"), compared
        if oa != ob:
            differing = [str(n) for n, x, y in zip(outs_a, oa, ob) if x != y]
            return _found(a, ka, xa, differing, i), None, compared
    return None, None, compared


def _other_tensors(ins_a: list[str | None], ins_b: list[str | None], da: list[str | None],
                   db: list[str | None]) -> tuple[str, str] | None:
    """The tensors a record read in each run where it read other ones (other names where the
    checksums differ: a parameter read in another order is not a parameter whose value differs);
    None when the same tensors were read."""
    pairs = [(x, y) for x, y, p, q in zip(ins_a, ins_b, da, db) if p != q and x != y]
    if len(ins_a) != len(ins_b):
        pairs = [(", ".join(map(_shown, ins_a)), ", ".join(map(_shown, ins_b)))]
    if not pairs:
        return None
    return ", ".join(_shown(x) for x, _ in pairs), ", ".join(_shown(y) for _, y in pairs)


def _read_in_other_order(a: Trace, b: Trace, ins_a: list[str | None], ins_b: list[str | None],
                         da: list[str | None], db: list[str | None]) -> tuple[str, str] | None:
    """Where a record read a start value (an input, parameter, buffer or state the step did not
    make) that differs between the runs, but run 2's value is one run 1 also started from, under
    another name: the same start state read in another order (start values are named in the
    order the step first reads them, so two inputs read the other way round swap names).
    Returns (run 1's name, the name run 1 gave run 2's value); None when a value is new."""
    start_a: dict[str, str] = {}
    for name, rec in a.tensors.items():
        if (rec.md5 or rec.fingerprint) and _from_outside(a, name) and rec.previous is None:
            start_a.setdefault(rec.fingerprint or rec.md5 or "", name)
    found: tuple[str, str] | None = None
    for x, y, p, q in zip(ins_a, ins_b, da, db):
        if p == q or x is None or y is None or not _from_outside(a, x) or not _from_outside(b, y):
            continue
        twin = start_a.get(q or "")
        if twin is None or twin == x:
            return None  # a start value run 1 did not have: the states differ
        found = found or (x, twin)
    return found


def _shown(name: str | None) -> str:
    return name if name is not None else "no tensor"


def _from_outside(t: Trace, name: str) -> bool:
    rec = t.tensors.get(name)
    return rec is not None and rec.role in ("param", "buffer", "input", "state") and rec.producer is None


def _label(item: Call | NodeRun) -> str:
    return f"{item.name} ({item.api})" if isinstance(item, Call) else f"the backward step of {item.node}"


def _found(t: Trace, kind: str, item: Call | NodeRun, outputs: list[str], run: int) -> Nondeterministic:
    if isinstance(item, Call):
        stack = t.stack_of(item.stack_id)
        cause = usual_cause(item.api + " " + item.args, custom=item.kind in ("function", "custom_op"))
        parent_custom = item.phase == "backward" and _in_custom_backward(t, item)
        if cause is None and parent_custom:
            cause = CUSTOM
        return Nondeterministic("call", item.name, item.api, item.phase, stack, outputs, (0, run),
                                *(cause or (None, None)))
    node = next((n for n in t.grad_nodes if n.name == item.node), None)
    what = node.kind if node is not None else item.node
    stack = t.stack_of(node.stack_id) if node is not None else ()
    call = next((c for c in t.calls if node is not None and c.name == node.call), None)
    cause = usual_cause(what + " " + (call.api if call is not None else ""))
    if cause is None and call is not None and call.kind == "function":
        cause = CUSTOM
    return Nondeterministic("node", item.node, what, "backward", stack, outputs, (0, run), *(cause or (None, None)))


def _in_custom_backward(t: Trace, call: Call) -> bool:
    """Whether ``call`` ran inside a custom Function's backward."""
    node = next((n for n in t.grad_nodes if n.name == call.parent), None)
    if node is None or node.call is None:
        return False
    maker = next((c for c in t.calls if c.name == node.call), None)
    return maker is not None and maker.kind == "function"


def usual_cause(text: str, custom: bool = False) -> tuple[str, str] | None:
    """(the usual cause, what to set) for an op or node whose API or class is in ``text`` (with its
    arguments: ``accumulate=True``, ``generator=Generator``), or for a custom kernel (``custom``); None when none is known."""
    if "index_put" in text and "accumulate=True" not in text:
        text = text.replace("index_put", "")  # index_put_ without accumulate writes, it does not add
    # generator=None (given explicitly) is the default generator, which the check does put back.
    text = text.replace("generator=None", "")
    for words, cause, fix in CAUSES:
        if any(w in text for w in words):
            return cause, fix
    return CUSTOM if custom else None


__all__ = ["CAUSES", "CUSTOM", "PRIVATE_GENERATOR", "DeterminismReport", "Nondeterministic", "compare_runs", "usual_cause"]
