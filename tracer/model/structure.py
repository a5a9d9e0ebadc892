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
from collections.abc import Callable, Iterable, Iterator

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

    if not complete or _every_link_present(trace, calls, nodes, runs):
        return
    tensors = trace.tensors

    def missing(owner: str, field: str, names: Iterable[str | None], *kinds: Callable[[str], bool]) -> Iterator[str]:
        for name in names:
            if name is not None and not any(k(name) for k in kinds):
                yield f"{owner}: {field} {name!r} is not in the file"

    is_call, is_node, is_run = calls.__contains__, nodes.__contains__, runs.__contains__
    is_tensor = tensors.__contains__
    for c in trace.calls:
        where = f"call {c.name!r}"
        yield from missing(where, "parent", [c.parent], is_call, is_node)
        yield from missing(where, "grad node", c.grad_nodes, is_node)
        yield from missing(where, "tensor", [*c.inputs, *c.outputs, *c.mutated], is_tensor)
    for n in trace.grad_nodes:
        where = f"grad node {n.name!r}"
        yield from missing(where, "call", [n.call], is_call)
        yield from missing(where, "parent", [n.parent], is_node)
        yield from missing(where, "next node", n.next, is_node)
        yield from missing(where, "param", [n.param], is_tensor)
    for t in tensors.values():
        where = f"tensor {t.name!r}"
        yield from missing(where, "producer", [t.producer], is_call, is_node, is_run)
        yield from missing(where, "previous", [t.previous], is_tensor)
    for b in trace.backward_runs:
        where = f"backward run {b.name!r}"
        yield from missing(where, "tensor", [*b.roots, *b.outputs], is_tensor)
        for s in b.steps:
            yield from missing(where, "grad node", [s.node], is_node)
            yield from missing(where, "gradient", [*s.grads_in, *s.grads_out], is_tensor)
            yield from missing(where, "call", s.calls, is_call)


def _every_link_present(trace: Trace, calls: dict[str, Call], nodes: dict[str, GradNode],
                        runs: dict[str, BackwardRun]) -> bool:
    """Whether every name a record links to is in the file: the check below in set operations
    (a million-tensor trace loads seconds sooner); only a trace that fails it is walked record by
    record, for the first broken link's message."""
    tensor_refs: set[str | None] = set()
    node_refs: set[str | None] = set()
    call_refs: set[str | None] = set()
    call_or_node: set[str | None] = set()
    producers: set[str | None] = set()
    for c in trace.calls:
        tensor_refs.update(c.inputs, c.outputs, c.mutated)
        node_refs.update(c.grad_nodes)
        call_or_node.add(c.parent)
    for n in trace.grad_nodes:
        call_refs.add(n.call)
        node_refs.add(n.parent)
        node_refs.update(n.next)
        tensor_refs.add(n.param)
    for t in trace.tensors.values():
        producers.add(t.producer)
        tensor_refs.add(t.previous)
    for b in trace.backward_runs:
        tensor_refs.update(b.roots, b.outputs)
        for s in b.steps:
            node_refs.add(s.node)
            tensor_refs.update(s.grads_in, s.grads_out)
            call_refs.update(s.calls)
    for refs in (tensor_refs, node_refs, call_refs, call_or_node, producers):
        refs.discard(None)
    return not (tensor_refs - trace.tensors.keys() or node_refs - nodes.keys() or call_refs - calls.keys()
                or call_or_node - calls.keys() - nodes.keys() or producers - calls.keys() - nodes.keys() - runs.keys())


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
