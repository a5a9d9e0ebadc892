"""Compare the per-rank traces of one data-parallel step: which rank departed first, and where.

Data-parallel replicas (DDP, or FSDP's all-gathered parameters) must agree on some values and
may differ on others. ``diff_ranks`` compares, by name across the ranks' traces, only what must
agree:

- parameters, every version (``w``, and ``w@v1`` after the optimizer step), and optimizer state;
- buffers as first seen (DDP broadcasts them; their in-step updates are local);
- gradients after the reduction: the outputs of DDP's all-reduce (``ddp_allreduce<k>``), a
  parameter's gradient produced by a rank-invariant collective (``w@grad@v1`` after a manual
  ``all_reduce``), the value on the parameter the optimizer saw (``w.grad``), and every later
  version of these (a rank that nudges its gradient after the all-reduce shows up here);
- outputs of collectives that return the same value on every rank of their group (all_reduce,
  all_gather*, broadcast and their functional forms), compared among the ranks of that group.

Distributed tensors (DTensor: FSDP2's sharded parameters, tensor-parallel weights and
activations) carry their layout (``TensorRecord.sharding``) and the checksum of the local shard.
Ranks hold different shards, so such a record is compared only among the ranks whose layout says
they hold the same shard: same mesh and placements, same coordinate on every mesh dimension that
is not ``Replicate()`` (``Sharding.replica_key``). Parameters, optimizer state and the gradient a
sharded parameter carries into the optimizer (FSDP2 reduce-scatters it, DTensor resolves a
Partial before it lands there) are compared that way, and so is any other DTensor value with a
``Replicate()`` dimension (a tensor-parallel activation every rank of a tp group computes). With
pure sharding (FSDP2 alone) every shard lives on one rank and nothing is compared: a perturbed
shard cannot be told from a legitimate one (all ranks then all-gather the same perturbed value).

Inputs of different data shards, activations, local gradients before the reduction and outputs
of rank-specific collectives (reduce_scatter, all_to_all, scatter, recv...) are expected to differ
and are only counted. The sequence of collectives on the default group is compared too: a rank
that issues a different (or an extra, or one fewer) collective is reported.

For each compared record the ranks are grouped by value; the largest group is the reference (a
tie goes to the group holding the lowest rank, so with two ranks rank 0 is the reference) and
every other rank departs. The departure reported first is the earliest in the departing rank's
own execution order (a value that existed before the step, a parameter or optimizer state as
first seen, comes before everything the step made), with the call that produced the record there,
its stack and module path, and the first collective that carried it: the first collective call on
that rank whose inputs hold the record, the same bytes (FSDP2 all-gathers a copy of the local
shard), or anything computed from them.

Exit status: 0 replicas agree, 1 a rank departed, 2 traces that cannot be compared.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from export.diff import reprs
from export.diff.console import render_ranks
from export.diff.result import frame_json
from export.load import load_with_notes
from export.views import checksum
from tracer.model import Call, Frame, GradNode, TensorRecord, Trace
from tracer.model.display import plural
from tracer.model.records import OWNED_ROLES

# Collectives whose outputs hold the same value on every rank of their group (by the last part of
# the call's API name). DDP's all-reduce is recorded as one call named ddp_allreduce<k>.
RANK_INVARIANT = frozenset({
    "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather_tensor",
    "all_gather_into_tensor_coalesced", "allreduce", "all_gather_single_coalesced", "all_gather_tensor_autograd",
    "all_gather_single_autograd",
})
MISSING = "<missing>"
_GROUP = re.compile(r"group=(\[[\d, ]*\]|'[^']*'|\"[^\"]*\")")
_VERSION = re.compile(r"(@v\d+|#\d+)+$")


class _Follow:
    """What ``_Ranked._direct`` says when only a record's history can tell: look at the version
    this one replaced."""


_FOLLOW = _Follow()


# ---- results -----------------------------------------------------------------------------------------
@dataclass
class Departure:
    """One compared record on which a rank disagrees with the reference ranks."""

    record: str  # the tensor name (or, for the collective sequence, the call name)
    what: str  # parameter | optimizer state | buffer | reduced gradient | collective output | collective sequence
    rank: int  # the (first) departing rank
    ranks: list[int]  # every departing rank
    reference: list[int]  # the ranks that agree (the reference group)
    reason: str
    param: str | None = None  # the parameter this record belongs to
    call: str | None = None  # what made the record on the departing rank
    api: str | None = None
    module: str | None = None
    stack: tuple[Frame, ...] = ()
    max_abs: float | None = None  # largest stat difference to the reference, where stats exist
    order: int = 0  # position in the departing rank's execution order
    placement: str | None = None  # a DTensor's layout on the departing rank (Sharding.describe)
    carrier: str | None = None  # the first collective call that carried the record off that rank
    carrier_api: str | None = None
    carrier_args: str | None = None

    # One line in a REPL (export/diff/reprs.py).
    def __repr__(self) -> str:
        return reprs.departure_repr(self)

    def to_json(self) -> dict[str, Any]:
        return {"record": self.record, "what": self.what, "rank": self.rank, "ranks": self.ranks,
                "reference": self.reference, "reason": self.reason, "param": self.param, "call": self.call,
                "api": self.api, "module": self.module, "max_abs": self.max_abs, "placement": self.placement,
                "carrier": self.carrier, "carrier_api": self.carrier_api, "carrier_args": self.carrier_args,
                "stack": [frame_json(f) for f in self.stack]}


@dataclass
class RankDiffResult:
    """The comparison of one step's per-rank traces. ``exit_code``: 0 agree, 1 departed, 2 unusable."""

    ranks: list[int]
    labels: dict[int, str]
    world_size: int | None
    compared: int = 0
    departures: list[Departure] = field(default_factory=list)
    collectives: dict[int, int] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)  # per-rank differences that are not errors
    not_comparable: dict[str, int] = field(default_factory=dict)  # must-match records without a checksum
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    # One line in a REPL, a card in a notebook (export/diff/reprs.py).
    def __repr__(self) -> str:
        return reprs.ranks_repr(self)

    def _repr_html_(self) -> str:
        return reprs.ranks_html(self)

    @property
    def first(self) -> Departure | None:
        return self.departures[0] if self.departures else None

    @property
    def equal(self) -> bool:
        return not self.problems and not self.departures

    @property
    def exit_code(self) -> int:
        return 2 if self.problems else 1 if self.departures else 0

    def verdict(self) -> str:
        if self.problems:
            return "CANNOT COMPARE: " + "; ".join(self.problems)
        ranks = ", ".join(str(r) for r in self.ranks)
        if self.equal:
            counts = sorted(set(self.collectives.values()))
            per = f"{counts[0]}" if len(counts) == 1 else "/".join(str(self.collectives[r]) for r in self.ranks)
            return (f"REPLICAS AGREE: ranks {ranks}, {self.compared} records that must match are identical "
                    f"({per} collective calls per rank)")
        d = self.departures[0]
        where = f" (parameter {d.param})" if d.param and d.param != d.record else ""
        made = f", made by {d.call}" if d.call else ""
        carried = f"; first carried by {d.carrier} ({d.carrier_args})" if d.carrier else ""
        return (f"RANK {d.rank} DEPARTED first at {d.what} {d.record}{where}{made}: {d.reason}{carried} "
                f"[{plural(len(self.departures), 'departing record')}]")

    def to_json(self) -> dict[str, Any]:
        return {"equal": self.equal, "exit_code": self.exit_code, "verdict": self.verdict(),
                "ranks": self.ranks, "world_size": self.world_size,
                "traces": {str(r): label for r, label in sorted(self.labels.items())},
                "compared": self.compared, "first": None if self.first is None else self.first.to_json(),
                "departures": [d.to_json() for d in self.departures],
                "collectives": {str(r): n for r, n in sorted(self.collectives.items())},
                "expected_differences": dict(sorted(self.expected.items())),
                "not_comparable": dict(sorted(self.not_comparable.items())),
                "notes": self.notes, "problems": self.problems}

    def render(self, console: Console) -> None:
        render_ranks(self, console)


# ---- classifying records -------------------------------------------------------------------------------

def _ranks(ranks: list[int]) -> str:
    """``rank 0``, ``ranks 0, 2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))

def op_name(api: str) -> str:
    """The operation an API name ends in, the key of ``RANK_INVARIANT``: ``torch.distributed.all_reduce``
    -> ``all_reduce`` (a key, not a display name: see ``tracer.model.display.short_api`` for that)."""
    return api.rsplit(".", 1)[-1]


def _invariant_call(call: Call | None) -> bool:
    return call is not None and call.kind == "collective" and op_name(call.api) in RANK_INVARIANT


def group_of(call: Call) -> str:
    """The group a collective call ran on, as its args text names it ('' if unknown)."""
    m = _GROUP.search(call.args)
    return m.group(1) if m else ""


class _Ranked:
    """One rank's trace with the look-ups the comparison needs."""

    def __init__(self, rank: int, trace: Trace, label: str) -> None:
        self.rank, self.trace, self.label = rank, trace, label
        self.calls = {c.name: c for c in trace.calls}
        self.nodes = {n.name: n for n in trace.grad_nodes}
        self.params = {n for n, r in trace.tensors.items() if r.role == "param" and r.previous is None}
        self._what: dict[str, str | None] = {}
        self._readers: dict[str, Call] | None = None

    def param_of(self, name: str) -> str | None:
        """The parameter a record belongs to (``w`` for ``w@v1``, ``w.grad``, ``w@grad@v2``, ``w.exp_avg``)."""
        base = _VERSION.sub("", name.split("@", 1)[0])
        for cand in (base, base[:-5] if base.endswith(".grad") else None,
                     base.rsplit(".", 1)[0] if "." in base else None):
            if cand and cand in self.params:
                return cand
        return None

    def what(self, name: str) -> str | None:
        """Why a record must agree across ranks (its category), or None when it may differ."""
        chain: list[str] = []  # versions that inherit from the one they replaced
        cur: str | None = name
        while cur is not None and cur not in self._what:
            rec = self.trace.tensors.get(cur)
            direct = _FOLLOW if rec is None else self._direct(cur, rec)
            if not isinstance(direct, _Follow) or rec is None or rec.previous is None:
                self._what[cur] = None if isinstance(direct, _Follow) else direct
                break
            self._what[cur] = None  # guards a cyclic `previous` chain in a damaged file
            chain.append(cur)
            cur = rec.previous
        # A later version of a reduced gradient (changed in place after the reduction) must
        # still agree; later versions of anything else are local work.
        inherited = "reduced gradient" if cur is not None and self._what.get(cur) == "reduced gradient" else None
        for n in chain:
            self._what[n] = inherited
        return self._what[name]

    def _direct(self, name: str, rec: TensorRecord) -> str | _Follow | None:
        """A record's category from its own fields; ``_FOLLOW`` when only its history can tell."""
        producer = self.calls.get(rec.producer or "")
        if rec.role == "param":
            return "parameter"
        if rec.role == "state":
            return "optimizer state"
        if rec.role == "buffer" and rec.previous is None:
            return "buffer"
        if _invariant_call(producer) and producer is not None and name in producer.outputs:
            grad_like = "@grad" in name or ".grad" in name
            return "reduced gradient" if grad_like and self.param_of(name) else "collective output"
        if rec.role == "grad" and _VERSION.sub("", name).endswith(".grad") and self.param_of(name):
            return "reduced gradient"  # the value on the parameter when the optimizer stepped
        if rec.sharding is not None:
            if rec.role == "grad" and self.param_of(name):
                return "reduced gradient"  # a DTensor parameter's .grad: reduced by FSDP2 / DTensor
            if any(p.startswith("Replicate") for p in rec.sharding.placements):
                return "replicated value"
        return _FOLLOW

    def expected_kind(self, name: str) -> str:
        rec = self.trace.tensors[name]
        producer = self.calls.get(rec.producer or "")
        if producer is not None and producer.kind == "collective":
            return "rank-specific collective outputs"
        return {"input": "inputs", "grad": "local gradients", "buffer": "buffer updates"}.get(rec.role, "activations")

    def origin(self, name: str) -> tuple[str | None, str | None, str, tuple[Frame, ...]]:
        """(call, api, module, stack) of what made a record, or of the first call that read it."""
        rec = self.trace.tensors.get(name)
        producer = None if rec is None else rec.producer
        call = self.calls.get(producer or "")
        if call is not None:
            return call.name, call.api, call.module, call.stack
        node: GradNode | None = self.nodes.get(producer or "")
        if node is not None:
            made_by = self.calls.get(node.call or "")
            return node.name, node.kind, made_by.module if made_by else "", node.stack or (
                made_by.stack if made_by else ())
        if self._readers is None:
            self._readers = {}
            for c in self.trace.calls:
                for i in c.inputs:
                    self._readers.setdefault(i, c)
        reader = self._readers.get(name)
        if reader is not None:
            return f"{reader.name} (first read)", reader.api, reader.module, reader.stack
        return None, None, "", ()

    def collectives(self) -> list[Call]:
        return sorted((c for c in self.trace.calls if c.kind == "collective"), key=lambda c: c.seq)

    def order(self, name: str) -> int:
        """Where a record stands in this rank's execution: a value from before the step (a
        parameter, buffer or optimizer state as first seen) before everything the step made."""
        rec = self.trace.tensors[name]
        if rec.previous is None and rec.producer is None and rec.role in OWNED_ROLES:
            return -1
        return rec.seq

    def carrier(self, name: str) -> Call | None:
        """The first collective call whose inputs hold ``name``, a record with the same bytes made
        outside the traced calls (FSDP2 copies a parameter's local shard into its all-gather
        buffer), or a value computed from them."""
        rec = self.trace.tensors.get(name)
        if rec is None:
            return None
        digest = checksum(rec)
        reached = {name}
        if digest is not None:
            reached.update(n for n, r in self.trace.tensors.items()
                           if r.producer is None and r.dtype == rec.dtype and r.numel == (
                               rec.sharding.numel if rec.sharding else rec.numel) and checksum(r) == digest)
        for call in sorted(self.trace.calls, key=lambda c: c.seq):
            if not any(i in reached for i in call.inputs):
                continue
            if call.kind == "collective":
                return call
            reached.update(call.outputs)
        return None


def _absmax_diff(a: TensorRecord, b: TensorRecord) -> float | None:
    sa, sb = a.stats, b.stats
    if sa is None or sb is None:
        return None
    diffs = [abs(x - y) for x, y in ((sa.min, sb.min), (sa.max, sb.max), (sa.mean, sb.mean), (sa.absmax, sb.absmax))
             if x is not None and y is not None]
    return max(diffs) if diffs else None


def _reference(values: dict[int, str]) -> list[int]:
    """The ranks of the largest group of equal values (a tie: the group with the lowest rank)."""
    groups: dict[str, list[int]] = {}
    for r in sorted(values):
        groups.setdefault(values[r], []).append(r)
    return max(groups.values(), key=lambda g: (len(g), -g[0]))


# ---- the comparison --------------------------------------------------------------------------------------
def _rank_of(trace: Trace, label: str) -> int | None:
    info = trace.header.get("distributed")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return int(info["rank"])
    m = re.search(r"\.rank(\d+)\.", os.path.basename(label) + ".")
    return int(m.group(1)) if m else None


def _load(x: Trace | str | os.PathLike[str], index: int, notes: list[str]) -> tuple[Trace, str]:
    if isinstance(x, Trace):
        return x, f"trace {index}"
    path = os.fspath(x)
    t, messages = load_with_notes(path)
    notes += [f"{path}: {m}" for m in messages]
    return t, path


def diff_ranks(traces: Sequence[Trace | str | os.PathLike[str]]) -> RankDiffResult:
    """Compare the traces of one step recorded on different ranks (objects or paths)."""
    notes: list[str] = []
    loaded = [_load(x, i, notes) for i, x in enumerate(traces)]
    problems: list[str] = []
    by_rank: dict[int, _Ranked] = {}
    worlds = set()
    for t, label in loaded:
        rank = _rank_of(t, label)
        if rank is None:
            problems.append(f"{label} has no rank (not recorded under an initialized process group)")
            continue
        if rank in by_rank:
            problems.append(f"rank {rank} appears twice ({by_rank[rank].label} and {label})")
            continue
        info = t.header.get("distributed")
        if isinstance(info, dict) and isinstance(info.get("world_size"), int):
            worlds.add(info["world_size"])
        by_rank[rank] = _Ranked(rank, t, label)
        if t.status != "ok":
            notes.append(f"rank {rank} trace is {t.status}; records past that point are missing")
    if len(loaded) < 2:
        problems.append("diff-ranks needs the traces of at least two ranks")
    if len(worlds) > 1:
        problems.append(f"the traces come from runs of different world sizes ({sorted(worlds)})")
    algos = {r.trace.hash_algorithm for r in by_rank.values()}
    if len(algos) > 1:
        problems.append(f"the traces use different hash algorithms ({', '.join(sorted(algos))})")
    elif algos == {"none"}:
        problems.append("the traces have no checksums (recorded with hash='none')")
    world = next(iter(worlds)) if len(worlds) == 1 else None
    beyond = sorted(r for r in by_rank if world is not None and r >= world)
    if beyond:
        problems.append(f"{_ranks(beyond)} beyond a world of {world} ranks (ranks count from 0)")
    result = RankDiffResult(sorted(by_rank), {r: x.label for r, x in by_rank.items()}, world,
                            notes=notes, problems=problems)
    if problems:
        return result
    if world is not None and len(by_rank) < world:
        notes.append(f"only {len(by_rank)} of {world} ranks given (missing: {_missing(by_rank, world)})")
    ranked = [by_rank[r] for r in sorted(by_rank)]
    result.collectives = {x.rank: len(x.collectives()) for x in ranked}
    _compare_tensors(ranked, result)
    _compare_schedule(ranked, result)
    result.departures.sort(key=lambda d: (d.order, d.rank, d.record))
    return result


def _missing(given: dict[int, Any], world: int, shown: int = 8) -> str:
    """The first ``shown`` ranks of the world not given, and how many more: the world size is the
    file's claim, so the work is bounded by the ranks given, not by it."""
    first: list[int] = []
    for r in range(world):  # at most len(given) + shown steps: every step past a given rank adds one
        if r not in given:
            first.append(r)
            if len(first) == shown:
                break
    more = world - len(given) - len(first)
    return ", ".join(map(str, first)) + (f" and {more:,} more" if more > 0 else "")


def _compare_tensors(ranked: list[_Ranked], result: RankDiffResult) -> None:
    names: dict[str, None] = {}
    for x in ranked:
        for rec in x.trace.tensors_in_order():
            names.setdefault(rec.name, None)
    expected: Counter[str] = Counter()
    unknown: Counter[str] = Counter()
    for name in names:
        whats = {x.rank: x.what(name) for x in ranked if name in x.trace.tensors}
        holder = next(x for x in ranked if name in x.trace.tensors)
        if not any(whats.values()):
            digests = {checksum(x.trace.tensors[name]) for x in ranked if name in x.trace.tensors}
            if len(digests) > 1 and None not in digests:
                expected[holder.expected_kind(name)] += 1
            continue
        what = next(w for w in whats.values() if w)
        sets = _comparison_sets(ranked, name, what)
        if all(len(members) < 2 for members in sets):
            expected["distinct shards"] += 1  # sharded: no other rank holds this one's bytes
            continue
        for members in sets:
            values: dict[int, str] = {}
            for x in members:
                mine = x.trace.tensors.get(name)
                if mine is None:
                    values[x.rank] = MISSING
                    continue
                d = checksum(mine)
                if d is None:
                    unknown[mine.hash_note or "not hashed"] += 1
                    continue
                values[x.rank] = d
            if len(values) < 2:
                continue
            result.compared += 1
            if len(set(values.values())) == 1:
                continue
            result.departures.append(_departure(members, name, what, values))
    result.expected = dict(expected)
    result.not_comparable = dict(unknown)


def _comparison_sets(ranked: list[_Ranked], name: str, what: str) -> list[list[_Ranked]]:
    """Which ranks must agree on a record: all of them; for a distributed tensor the ranks that hold
    the same shard (``Sharding.replica_key``); for a collective's output the ranks whose call names
    the same group. A rank that lacks the record joins every set."""
    holders = [x.trace.tensors[name] for x in ranked if name in x.trace.tensors]
    if any(rec.sharding is not None for rec in holders):
        by_key: dict[Any, list[_Ranked]] = {}
        missing = []
        for x in ranked:
            rec = x.trace.tensors.get(name)
            if rec is None:
                missing.append(x)
                continue
            by_key.setdefault(None if rec.sharding is None else rec.sharding.replica_key(), []).append(x)
        return [sorted(members + missing, key=lambda x: x.rank) for members in by_key.values()]
    if what != "collective output":
        return [ranked]
    sets: dict[str, list[_Ranked]] = {}
    lacking = []
    for x in ranked:
        rec = x.trace.tensors.get(name)
        call = x.calls.get(rec.producer or "") if rec is not None else None
        if call is None:
            lacking.append(x)
            continue
        sets.setdefault(group_of(call), []).append(x)
    return [sorted(members + lacking, key=lambda x: x.rank) for members in sets.values()]


def _departure(members: list[_Ranked], name: str, what: str, values: dict[int, str]) -> Departure:
    ref = _reference(values)
    departing = sorted(r for r in values if r not in ref)
    rank = departing[0]
    x = next(m for m in members if m.rank == rank)
    ref_x = next(m for m in members if m.rank == ref[0])
    if values[rank] == MISSING:
        reason = f"rank {rank} has no {name}; {_ranks(ref)} {'does' if len(ref) == 1 else 'do'}"
        source = ref_x
    elif values[ref[0]] == MISSING:
        reason = f"only {_ranks(departing)} {'has' if len(departing) == 1 else 'have'} {name}; {_ranks(ref)} {'does' if len(ref) == 1 else 'do'} not"
        source = x
    else:
        reason = f"differs from {_ranks(ref)}"
        source = x
    call, api, module, stack = source.origin(name)
    rec = source.trace.tensors[name]
    max_abs = None
    if values[rank] != MISSING and values[ref[0]] != MISSING:
        max_abs = _absmax_diff(ref_x.trace.tensors[name], x.trace.tensors[name])
    carrier = x.carrier(name) if values[rank] != MISSING else None
    return Departure(record=name, what=what, rank=rank, ranks=departing, reference=ref, reason=reason,
                     param=source.param_of(name), call=call, api=api, module=module, stack=stack,
                     max_abs=max_abs, order=source.order(name),
                     placement=rec.sharding.describe() if rec.sharding is not None else None,
                     carrier=carrier.name if carrier else None, carrier_api=carrier.api if carrier else None,
                     carrier_args=carrier.args if carrier else None)


def _compare_schedule(ranked: list[_Ranked], result: RankDiffResult) -> None:
    """The collectives every rank issues on the default group must come in the same order."""
    world = result.world_size or len(ranked)
    seqs = {x.rank: [c for c in x.collectives() if _on_default_group(group_of(c), world)] for x in ranked}
    length = max((len(s) for s in seqs.values()), default=0)
    for i in range(length):
        sig = {}
        for r, s in seqs.items():
            sig[r] = MISSING if i >= len(s) else f"{op_name(s[i].api)}|{s[i].args}"
        if len(set(sig.values())) == 1:
            continue
        ref = _reference(sig)
        departing = sorted(r for r in sig if r not in ref)
        rank = departing[0]
        x = next(m for m in ranked if m.rank == rank)
        mine = seqs[rank][i] if i < len(seqs[rank]) else None
        theirs = seqs[ref[0]][i] if i < len(seqs[ref[0]]) else None
        shown = mine or theirs
        assert shown is not None
        what_mine = f"{mine.name} ({op_name(mine.api)}, {mine.args})" if mine else "nothing"
        what_ref = f"{theirs.name} ({op_name(theirs.api)}, {theirs.args})" if theirs else "nothing"
        result.departures.append(Departure(
            record=shown.name, what="collective sequence", rank=rank, ranks=departing, reference=ref,
            reason=f"collective #{i} on the default group: rank {rank} issued {what_mine}, "
                   f"{_ranks(ref)} issued {what_ref}",
            call=shown.name, api=shown.api, module=shown.module, stack=shown.stack,
            order=_call_order(x, mine) if mine else _call_order(x, None)))
        return  # after the first mismatch the two sequences no longer line up


def _on_default_group(group: str, world: int) -> bool:
    """Whether a collective's group text is the default group ``[0, 1, ..., world-1]`` (or says no
    group). Lengths first: the text of ``world`` ranks is built only where the call's own text,
    which the file holds, is that long (a stated world of 10**7 costs nothing)."""
    if group == "":
        return True
    if len(group) != _default_group_length(world):
        return False
    return group == str(list(range(world)))


def _default_group_length(world: int) -> int:
    """``len(str(list(range(world))))`` without building it: the digits of 0..world-1, a ", "
    between each two of them, and the brackets."""
    if world <= 0:
        return 2
    digits, width, low = 0, 1, 0
    while low < world:
        high = min(world, 10 ** width)
        digits += (high - low) * width
        low, width = high, width + 1
    return digits + 2 * (world - 1) + 2


def _call_order(x: _Ranked, call: Call | None) -> int:
    """A tensor-sequence position for a call (its first output, else the next tensor made)."""
    if call is not None:
        for name in call.outputs + call.inputs:
            rec = x.trace.tensors.get(name)
            if rec is not None:
                return rec.seq
    return len(x.trace.tensors)
