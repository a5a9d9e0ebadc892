"""Where a gradient came from, read from a trace's backward runs.

Most gradients have a producer, the grad node that returned them. A gradient that several edges
feed (a weight tied between the embedding and the lm head, a tensor used twice) has none: the
autograd engine sums the edges' partial gradients before the receiving node runs, so the sum is
named by the tensor it is the gradient of (``transformer.wte.weight@grad``) and its producers
are the edges summed into it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.model.trace import Trace


@dataclass(frozen=True)
class GradientEdge:
    """One partial gradient summed into another: ``node`` returned it as its ``name``."""

    node: str
    name: str


def summed_from(trace: Trace, grad: str) -> list[GradientEdge]:
    """The edges whose gradients the engine summed into ``grad`` (empty for a gradient a grad
    node returned itself, one from outside the traced block, or one into a node with several
    inputs, whose edges the trace does not tell apart)."""
    rec = trace.tensors.get(grad)
    if rec is None or rec.role != "grad" or rec.producer is not None:
        return []
    nodes = {n.name: n for n in trace.grad_nodes}
    for run in trace.backward_runs:
        receivers = [s for s in run.steps if grad in s.grads_in]
        if not receivers:
            continue
        if len(receivers[0].grads_in) != 1:
            return []  # edges into a node with several inputs do not say which input they feed
        receiver = receivers[0].node
        edges: list[GradientEdge] = []
        for step in run.steps:
            node = nodes.get(step.node)
            if node is None:
                continue
            for i, dest in enumerate(node.next):
                out = step.grads_out[i] if i < len(step.grads_out) else None
                if dest == receiver and out and out != grad:
                    edges.append(GradientEdge(step.node, out))
        return edges if len(edges) > 1 else []
    return []
