"""DOT text and files: the styles of each node, edge and cluster kind, the legend, the text of a
``Graph`` (``export.dot.fold``) and writing it as ``.dot``/``.gv`` or rendering it with Graphviz
(``.svg``, ``.png``, ``.pdf``). ``export.dot`` says what the picture shows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from export.dot.fold import Cluster, GEdge, GNode, Graph
from export.errors import RenderError, UserError

FONT = "Helvetica"

NODE_STYLES: dict[str, dict[str, str]] = {
    "call": {"shape": "box", "style": "rounded,filled", "fillcolor": "#e8eefc"},
    "function": {"shape": "box", "style": "rounded,filled,bold", "fillcolor": "#fce7f3"},
    "compiled": {"shape": "box3d", "style": "filled", "fillcolor": "#f3f4f6"},
    "bcall": {"shape": "box", "style": "rounded,filled,dashed", "fillcolor": "#e8eefc"},
    "optimizer": {"shape": "component", "style": "filled", "fillcolor": "#fef3c7"},
    "fold": {"shape": "folder", "style": "filled", "fillcolor": "#ede9fe"},
    "source": {"shape": "invhouse", "style": "filled", "fillcolor": "#fde68a"},
    "sink": {"shape": "note", "style": "filled", "fillcolor": "#ffffff"},
    "run": {"shape": "doubleoctagon", "style": "filled", "fillcolor": "#fee2e2"},
    "grad": {"shape": "ellipse", "style": "filled", "fillcolor": "#dbeafe"},
    "leaf": {"shape": "ellipse", "style": "filled,bold", "fillcolor": "#bbf7d0"},
    "external": {"shape": "ellipse", "style": "filled,dashed", "fillcolor": "#e5e7eb"},
    "gfold": {"shape": "folder", "style": "filled", "fillcolor": "#bfdbfe"},
    "root": {"shape": "box", "style": "filled", "fillcolor": "#fde68a"},
    "legend_point": {"shape": "point", "width": "0.05"},
}
EDGE_STYLES: dict[str, dict[str, str]] = {
    "tensor": {"color": "#374151"},
    "grad": {"color": "#2563eb", "fontcolor": "#1d4ed8"},
    "grad_flow": {"color": "#2563eb"},
    "link": {"color": "#9ca3af", "style": "dashed", "dir": "none", "constraint": "false"},
    "nested": {"color": "#9ca3af", "style": "dotted", "constraint": "false"},
    "invisible": {"style": "invis"},
}
CLUSTER_STYLES: dict[str, dict[str, str]] = {
    "section": {"style": "rounded", "color": "#6b7280", "fontsize": "14"},
    "module": {"style": "rounded,filled", "fillcolor": "#f9fafb", "color": "#d1d5db"},
    "nest": {"style": "dashed,rounded", "color": "#db2777"},
    "legend": {"style": "rounded", "color": "#9ca3af"},
}
ALERT = {"color": "#dc2626", "penwidth": "2"}

LEGEND_NODES = (  # (kind, explanation), shown for the kinds the picture uses
    ("call", "forward API call: name, API, args"),
    ("function", "custom autograd.Function call"),
    ("compiled", "compiled region (opaque)"),
    ("bcall", "call made while backward ran"),
    ("optimizer", "optimizer step: the parameters it updates\n(--optimizer-detail draws each tensor)"),
    ("fold", "folded module: calls, in/out shapes"),
    ("source", "source tensor from outside the block:\ninput, parameter, buffer, earlier state"),
    ("sink", "output that no traced call used"),
    ("run", "backward run"),
    ("grad", "grad node: call/NodeClass"),
    ("leaf", "AccumulateGrad leaf, named by parameter"),
    ("external", "grad node made before the traced block"),
    ("gfold", "folded module's grad nodes"),
    ("root", "tensor the graph was drawn from"),
)
LEGEND_EDGES = (
    ("tensor", "tensor: name / [shape] dtype / #md5"),
    ("grad", "gradient: name / [shape] dtype / #md5"),
    ("grad_flow", "gradient flows to"),
    ("link", "call ↔ grad node it created"),
    ("nested", "grad node ran this call"),
)

RENDERED = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
TEXT = (".dot", ".gv")


# ---- DOT text ------------------------------------------------------------------------------------
def _esc(text: str) -> str:
    """Escape one label line for a quoted DOT string: a backslash would start a Graphviz escape
    (``\\N``, ``\\l``) or swallow the closing quote, a quote would end the string, and a raw newline
    or control character has no place in one line."""
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text.replace("\\", "\\\\").replace('"', '\\"')


def quote(value: str | list[str]) -> str:
    if isinstance(value, list):
        return '"' + "\\n".join(_esc(v) for v in value) + '"'
    return '"' + _esc(value) + '"'


def _attrs(attrs: dict[str, Any]) -> str:
    return "[" + ", ".join(f"{k}={quote(attrs[k])}" for k in sorted(attrs)) + "]"


def _node_attrs(node: GNode) -> dict[str, Any]:
    attrs: dict[str, Any] = {**NODE_STYLES.get(node.kind, {}), "label": node.lines}
    if node.alert:
        attrs.update(ALERT)
    return attrs


def _edge_attrs(edge: GEdge) -> dict[str, Any]:
    attrs: dict[str, Any] = dict(EDGE_STYLES.get(edge.kind, {}))
    lines = list(edge.lines)
    if len(edge.merged) > 1:
        lines.append(f"×{len(edge.merged)}")
    if lines:
        attrs["label"] = lines
    if edge.alert:
        attrs.update(ALERT)
    return attrs


def add_legend(g: Graph) -> None:
    """A legend cluster explaining the node and edge kinds the picture uses."""
    kinds = {n.kind for n in g.nodes.values()}
    edge_kinds = {e.kind for e in g.edges}
    cid = "cluster_legend"
    g.clusters[cid] = Cluster(cid, ["legend"], "legend")
    g.place("cluster", cid, None)
    # One column: invisible edges chain the entries top to bottom instead of one wide row.
    last: str | None = None
    for i, (kind, text) in enumerate(k for k in LEGEND_NODES if k[0] in kinds):
        nid = f"legend{i}"
        g.nodes[nid] = GNode(nid, kind, text.split("\n"))
        g.place("node", nid, cid)
        if last is not None:
            g.edges.append(GEdge(last, nid, "invisible"))
        last = nid
    for i, (kind, text) in enumerate(k for k in LEGEND_EDGES if k[0] in edge_kinds):
        a, b = f"legend_e{i}a", f"legend_e{i}b"
        g.nodes[a] = GNode(a, "legend_point", [""])
        g.nodes[b] = GNode(b, "legend_point", [""])
        g.place("node", a, cid)
        g.place("node", b, cid)
        if last is not None:
            g.edges.append(GEdge(last, a, "invisible"))
        g.edges.append(GEdge(a, b, kind, text.split("\n")))
        last = b


TRACE_COMMENT = ("Generated by gradtrace. Ids follow recording order: c<i> call, g<i> grad node,",
                 "s/o source/output tensor, m/mb folded module, b<i> backward run.")


def to_dot(g: Graph, name: str = "gradtrace", comment: tuple[str, ...] = TRACE_COMMENT) -> str:
    out = [*(f"// {line}" for line in comment), f"digraph {name} {{"]
    graph_attrs: dict[str, Any] = {"fontname": FONT, "labelloc": "t", "newrank": "true", "rankdir": "TB"}
    if g.title:
        graph_attrs["label"] = g.title
    out.append(f"  graph {_attrs(graph_attrs)};")
    out.append(f"  node {_attrs({'fontname': FONT, 'fontsize': '10'})};")
    out.append(f"  edge {_attrs({'fontname': FONT, 'fontsize': '8'})};")

    def write_items(items: list[tuple[str, str]], indent: str) -> None:
        for kind, item in items:
            if kind == "node":
                out.append(f"{indent}{item} {_attrs(_node_attrs(g.nodes[item]))};")
                continue
            cl = g.clusters[item]
            out.append(f"{indent}subgraph {cl.id} {{")
            out.append(f"{indent}  graph {_attrs({**CLUSTER_STYLES.get(cl.kind, {}), 'label': cl.lines})};")
            write_items(cl.items, indent + "  ")
            out.append(f"{indent}}}")

    write_items(g.items, "  ")
    for e in g.edges:
        if e.kind == "grad" and not e.src.startswith("legend"):
            # Written against the flow with dir=back: the arrow still points where the gradient
            # goes, but the layout ranks a grad node beside the call that made it (leaves on
            # top, the loss at the bottom) instead of stacking backward under forward.
            out.append(f"  {e.dst} -> {e.src} {_attrs({**_edge_attrs(e), 'dir': 'back'})};")
        elif e.src.startswith("legend") and e.kind in ("link", "nested"):
            # constraint=false would let the sample float away from its column
            out.append(f"  {e.src} -> {e.dst} {_attrs({**_edge_attrs(e), 'constraint': 'true'})};")
        else:
            out.append(f"  {e.src} -> {e.dst} {_attrs(_edge_attrs(e))};")
    out.append("}")
    return "\n".join(out) + "\n"


# ---- files ---------------------------------------------------------------------------------------
def check_suffix(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in TEXT and suffix not in RENDERED:
        shown = suffix or "a name without an extension"
        raise UserError(f"cannot write {shown}: use .dot or .gv (text), or .svg, .png, .pdf (rendered)")
    return suffix


def write_output(text: str, path: str | os.PathLike[str]) -> None:
    """Write DOT text, or render it when the extension asks for an image."""
    path = os.fspath(path)
    suffix = check_suffix(path)
    if suffix in TEXT:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        return
    missing = RenderError(f"rendering {suffix} needs Graphviz's `dot` program: apt-get install graphviz "
                          "(or brew install graphviz); writing .dot works without it")
    if shutil.which("dot") is None:
        raise missing
    # graphviz (the Python package, 60 ms to import) only when rendering: writing .dot needs only text.
    import graphviz

    try:
        data = graphviz.Source(text).pipe(format=RENDERED[suffix])
    except graphviz.ExecutableNotFound:
        raise missing from None
    except graphviz.CalledProcessError as exc:
        detail = (exc.stderr or b"").decode("utf-8", "replace").strip().splitlines()
        raise UserError(f"dot could not render {path}: {detail[-1] if detail else exc}") from None
    with open(path, "wb") as fh:
        fh.write(data)
