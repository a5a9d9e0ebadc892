"""The links between the records of a loaded trace, checked before anything walks them.

Records name each other (a call its parent, a grad node the nodes its gradients flow to, a
tensor the value it replaced). Every report follows these names, so a file whose links loop
(two calls each other's parent) would make a report loop, and a name that points nowhere would
make it guess. ``check_structure`` refuses such a file with one line:

- names are unique among calls, among grad nodes and among backward runs, and so are their
  ``seq`` numbers (the order everything is shown in); a call's parent call began before it;
- a record's stack id indexes the file's stack table;
- what must be acyclic is: the chain of calls' ``parent``, of grad nodes' ``parent``, of
  tensors' ``previous``, and the graph of grad nodes' ``next`` edges (autograd's graph is a DAG);
- in a complete file (one with its end record) every name a record uses is a record of the
  right kind. A truncated file is a crash's leftovers: a call may name an output whose record
  was never written, so there dangling names are kept (reports show them as unknown).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from tracer.model.records import BackwardRun, Call, GradNode, TraceFormatError
from tracer.model.trace import Trace


def check_structure(trace: Trace, *, complete: bool) -> None:
    """Raise ``TraceFormatError`` naming the first broken link of ``trace``."""
    for problem in structure_problems(trace, complete=complete):
        raise TraceFormatError(problem)


def structure_problems(trace: Trace, *, complete: bool) -> Iterator[str]:
    """Every broken link of ``trace``, one line each (the first is what ``check_structure`` says)."""
    calls = {c.name: c for c in trace.calls}
    nodes = {n.name: n for n in trace.grad_nodes}
    runs = {b.name: b for b in trace.backward_runs}
    for what, names, table in (("call", [c.name for c in trace.calls], calls),
                               ("grad node", [n.name for n in trace.grad_nodes], nodes),
                               ("backward run", [b.name for b in trace.backward_runs], runs)):
        if len(table) != len(names):
            twice = next(n for n, k in Counter(names).items() if k > 1)
            yield f"two {what}s named {twice!r}"
    for what, seqs in (("calls", [c.seq for c in trace.calls]), ("grad nodes", [n.seq for n in trace.grad_nodes]),
                       ("backward runs", [b.seq for b in trace.backward_runs])):
        if len(set(seqs)) != len(seqs):
            seq = next(n for n, k in Counter(seqs).items() if k > 1)
            yield f"two {what} with seq {seq}"
    n_stacks = len(trace.stacks)
    linked: list[Call | GradNode | BackwardRun] = [*trace.calls, *trace.grad_nodes, *trace.backward_runs]
    for rec in linked:
        if rec.stack_id is not None and rec.stack_id >= n_stacks:
            yield f"{rec.name!r} refers to stack {rec.stack_id}, which is not in the file"

    yield from _cycles("call", "parent", {c.name: [c.parent] for c in trace.calls if c.parent in calls})
    yield from _cycles("grad node", "parent", {n.name: [n.parent] for n in trace.grad_nodes if n.parent in nodes})
    yield from _cycles("tensor", "previous",
                       {t.name: [t.previous] for t in trace.tensors.values() if t.previous in trace.tensors})
    yield from _cycles("grad node", "next", {n.name: [x for x in n.next if x in nodes] for n in trace.grad_nodes})
    for c in trace.calls:
        parent = calls.get(c.parent) if c.parent is not None else None
        if parent is not None and parent.seq >= c.seq:
            yield f"call {c.name!r} (seq {c.seq}) has a parent call that began after it ({parent.name!r}, seq {parent.seq})"
            break

    if not complete:
        return
    tables: dict[str, Any] = {"call": calls, "node": nodes, "run": runs, "tensor": trace.tensors}
    # Every name in one set per kind of target first (a million-tensor trace loads seconds
    # sooner); only a trace with a broken link is walked again, for its first link's message.
    wanted: dict[tuple[str, ...], set[str | None]] = {}
    for _, _, _, linked_names, targets in _links(trace):
        found = wanted.get(targets)
        if found is None:
            found = wanted[targets] = set()
        found.update(linked_names)
    if not any(_absent(found, targets, tables) for targets, found in wanted.items()):
        return
    for owner, name, field, linked_names, targets in _links(trace):
        for x in linked_names:
            if x is not None and not any(x in tables[t] for t in targets):
                yield f"{owner} {name!r}: {field} {x!r} is not in the file"


# What a link may point to: one or more of the tables of calls, grad nodes, runs and tensors.
_CALL, _NODE, _TENSOR = ("call",), ("node",), ("tensor",)
_CALL_OR_NODE, _PRODUCER = ("call", "node"), ("call", "node", "run")
Link = tuple[str, str, str, Iterable[str | None], tuple[str, ...]]


def _links(trace: Trace) -> Iterator[Link]:
    """Every link of every record: (owner kind, owner name, field, names linked, tables they may
    be in), in the order a broken one is reported."""
    for c in trace.calls:
        yield "call", c.name, "parent", (c.parent,), _CALL_OR_NODE
        yield "call", c.name, "grad node", c.grad_nodes, _NODE
        yield "call", c.name, "tensor", (*c.inputs, *c.outputs, *c.mutated), _TENSOR
    for n in trace.grad_nodes:
        yield "grad node", n.name, "call", (n.call,), _CALL
        yield "grad node", n.name, "parent", (n.parent,), _NODE
        yield "grad node", n.name, "next node", n.next, _NODE
        yield "grad node", n.name, "param", (n.param,), _TENSOR
    for t in trace.tensors.values():
        yield "tensor", t.name, "producer", (t.producer,), _PRODUCER
        yield "tensor", t.name, "previous", (t.previous,), _TENSOR
    for b in trace.backward_runs:
        yield "backward run", b.name, "tensor", (*b.roots, *b.outputs), _TENSOR
        for s in b.steps:
            yield "backward run", b.name, "grad node", (s.node,), _NODE
            yield "backward run", b.name, "gradient", (*s.grads_in, *s.grads_out), _TENSOR
            yield "backward run", b.name, "call", s.calls, _CALL


def _absent(names: set[str | None], targets: tuple[str, ...], tables: dict[str, Any]) -> bool:
    """Whether some name of ``names`` is in none of the ``targets`` tables."""
    rest = names - {None}
    for t in targets:
        rest -= tables[t].keys()
    return bool(rest)


def _cycles(what: str, link: str, edges: dict[str, list[str | None]]) -> Iterator[str]:
    """The first cycle of a graph given as name -> names it links to (iterative: no recursion
    limit, linear in the edges)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in edges:
        if root in state:
            continue
        path: list[tuple[str, Iterator[str | None]]] = [(root, iter(edges[root]))]
        state[root] = 1
        while path:
            name, todo = path[-1]
            nxt = next(todo, None)
            while nxt is not None and state.get(nxt) == 2:
                nxt = next(todo, None)
            if nxt is None:
                state[name] = 2
                path.pop()
            elif state.get(nxt) == 1:
                yield f"{what}s' {link!r} links form a cycle through {nxt!r}"
                return
            else:
                state[nxt] = 1
                path.append((nxt, iter(edges.get(nxt, []))))


__all__ = ["check_structure", "structure_problems"]
