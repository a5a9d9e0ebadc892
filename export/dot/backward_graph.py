"""The grad-node graph behind any tensor, without a trace: ``backward_graph(loss, "g.svg")``.

For users who only have a loss (torchviz's use). ``obj`` may be a tensor or a model output that
holds tensors: a Hugging Face ``ModelOutput``, a dict, a tuple or a list (nested ones too); every
tensor in it with a ``grad_fn`` becomes a root (``loss``, ``logits``). The walk follows
``grad_fn.next_functions`` and keeps no tensor or node after it returns.

Nodes are named by PyTorch's class (``AddmmBackward0``); ``AccumulateGrad`` leaves by the
parameter they accumulate into, when ``params`` (``dict(model.named_parameters())`` or the model
itself) names it, with the leaf's shape. Ids follow traversal order (``r<i>`` roots in the order
they appear in ``obj``, ``n<i>`` nodes breadth-first from them), never ``id()``, so the same
program gives the same text. Arrows point where gradients flow, from the roots to the leaves.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from export.dot.fold import Cluster, GEdge, GNode, Graph
from export.dot.write import add_legend, check_suffix, to_dot, write_output
from tracer.model.display import shape_spaced

if TYPE_CHECKING:
    import torch


def _torch() -> Any:
    """torch as the caller already imported it (a tensor exists only once torch is imported):
    export itself loads, and reads saved traces, without torch."""
    return sys.modules.get("torch")


def _is_tensor(obj: Any) -> bool:
    torch_ = _torch()
    return torch_ is not None and isinstance(obj, torch_.Tensor)

_MAX_NESTING = 6  # how deep to look into nested containers for tensors


def _roots(obj: Any, label: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    if _is_tensor(obj):
        if obj.grad_fn is not None:
            yield label or "output", obj
        return
    if depth >= _MAX_NESTING:
        return
    if isinstance(obj, Mapping):  # dict, OrderedDict, transformers' ModelOutput
        for key, value in obj.items():
            yield from _roots(value, f"{label}.{key}" if label else str(key), depth + 1)
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from _roots(value, f"{label}[{i}]", depth + 1)


def _param_names(params: Any) -> dict[int, str]:
    """Parameter object identity -> name. ``id`` is only a look-up key while the caller holds the
    parameters; it never reaches the output."""
    if params is None:
        return {}
    torch_ = _torch()
    if torch_ is not None and isinstance(params, torch_.nn.Module):
        items = list(params.named_parameters())
    elif isinstance(params, Mapping):
        items = list(params.items())
    else:
        raise TypeError("params must be a module or a dict of name -> tensor, "
                        f"got {type(params).__name__}")
    names: dict[int, str] = {}
    for name, p in items:
        if _is_tensor(p):
            names.setdefault(id(p), str(name))
    return names


def build_backward_graph(obj: Any, params: Any = None) -> Graph:
    roots = []
    seen_roots: list[torch.Tensor] = []
    for label, t in _roots(obj, ""):
        if not any(t is s for s in seen_roots):  # the same tensor reached twice is one root
            seen_roots.append(t)
            roots.append((label, t))
    if not roots:
        raise ValueError(f"no tensor with a grad_fn in this {type(obj).__name__}: nothing to draw "
                         "(was it computed under torch.no_grad(), or from tensors without requires_grad?)")
    names = _param_names(params)
    g = Graph(title=["backward graph of " + ", ".join(label for label, _ in roots)])
    cid = "cluster_backward"
    g.clusters[cid] = Cluster(cid, ["backward"], "section")
    g.place("cluster", cid, None)

    ids: dict[Any, str] = {}  # autograd node -> n<i>; the node objects live only in this call
    queue: deque[Any] = deque()

    def visit(node: Any) -> str:
        if node not in ids:
            nid = f"n{len(ids)}"
            ids[node] = nid
            queue.append(node)
            g.nodes[nid] = _node(nid, node, names)
            g.place("node", nid, cid)
        return ids[node]

    for i, (label, t) in enumerate(roots):
        rid = f"r{i}"
        g.nodes[rid] = GNode(rid, "root", [label, f"{shape_spaced(t.shape)} {str(t.dtype).removeprefix('torch.')}"])
        g.place("node", rid, cid)
        g.edges.append(GEdge(rid, visit(t.grad_fn), "grad_flow"))
    while queue:
        node = queue.popleft()
        src = ids[node]
        for nxt, _ in node.next_functions:
            if nxt is not None:
                g.edges.append(GEdge(src, visit(nxt), "grad_flow"))
    return g


def _node(nid: str, node: Any, names: dict[int, str]) -> GNode:
    kind = type(node).__name__
    variable: Any = getattr(node, "variable", None) if kind == "AccumulateGrad" else None
    if _is_tensor(variable):
        name = names.get(id(variable))
        shape = f"{shape_spaced(variable.shape)} {str(variable.dtype).removeprefix('torch.')}"
        return GNode(nid, "leaf", [name or "(unnamed leaf)", kind, shape])
    return GNode(nid, "grad", [kind])


def backward_graph(obj: Any, path: str | os.PathLike[str] | None = None, *, params: Any = None) -> str:
    """Draw the grad-node graph behind ``obj`` and return the DOT text; write ``path`` (``.dot``,
    ``.gv``) or render it (``.svg``, ``.png``, ``.pdf``, needs Graphviz's ``dot``) when given."""
    if path is not None:
        check_suffix(os.fspath(path))  # fail before the work
    g = build_backward_graph(obj, params)
    add_legend(g)
    text = to_dot(g, name="backward_graph", comment=(
        "Generated by gradtrace.backward_graph. Ids follow traversal order: r<i> root tensor,",
        "n<i> grad node, breadth-first from the roots."))
    if path is not None:
        write_output(text, path)
    return text
