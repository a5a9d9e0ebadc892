"""Graphviz export: ``dot(trace, "step.svg")`` (``gradtrace dot TRACE -o step.svg``), and
``backward_graph(loss, "g.svg")`` for a tensor without a trace (``export.dot.backward_graph``).

``fold`` builds the graph to draw from a trace (nodes, edges, clusters, after folding); ``write``
turns it into DOT text and files.

What the picture shows (the legend in every file repeats it):

* forward section: rounded boxes are forward API calls (``linear0`` / ``F.linear`` / args), pink
  ones custom ``autograd.Function`` calls; arrows between them are tensors, labelled name /
  ``[shape] dtype`` / ``#`` first 8 hex digits of the MD5. Yellow house shapes are source tensors
  that came from outside the traced computation (inputs, parameters, buffers, optimizer state);
  white notes are outputs no traced call used. Grey boxes around nodes are modules.
* backward section: blue ellipses are grad nodes (``linear0/AddmmBackward0``), green ones the
  ``AccumulateGrad`` leaves named by parameter, grey dashed ones nodes made before the block; the
  red octagon is a backward run; blue arrows are gradients, labelled like tensors.
* dashed grey lines join a call to the grad nodes it created (and a parameter to its leaf).
* folded modules (``depth=N``) are folder shapes labelled ``path (Class)``, ``×calls``, the
  shapes crossing their boundary and the parameters folded in; a repeated block drawn once
  carries ``×12: h.0 … h.11``, and edges it stands for several times carry ``×12`` too.
* a yellow component shape is an optimizer step (``AdamW0: 148 params``), fed by the backward run
  before it; ``optimizer_detail=True`` draws each tensor it reads and writes instead.
* anything red holds NaN or Inf, or raised.

Node ids follow recording order (``c<i>`` = i-th call, ``g<i>`` = i-th grad node, ``s``/``o`` =
source/output tensors, ``m``/``mb`` = folded modules, ``b<i>`` = backward runs) and the text
contains no addresses, times or paths, so the same program gives the same file.
"""

from __future__ import annotations

import os
from typing import Literal

from export.dot.fold import Graph, build
from export.dot.write import add_legend, check_suffix, to_dot, write_output
from export.errors import RenderError
from tracer.model import Trace
from tracer.model.display import sibling


def dot(trace: Trace, path: str | os.PathLike[str] | None = None, *,
        depth: int | Literal["auto"] | None = "auto", fold_repeats: bool = False, forward: bool = True, backward: bool = True,
        checksums: bool = True, optimizer_detail: bool = False) -> str:
    """Draw ``trace`` as a Graphviz graph and return the DOT text.

    ``path`` ending in ``.dot``/``.gv`` gets the text; ``.svg``/``.png``/``.pdf`` are rendered with
    Graphviz's ``dot`` program (``RenderError`` when it is missing). ``depth=N`` draws each module
    at depth N (``blocks.0`` has depth 2) as one node holding its own calls and its submodules', and
    their grad nodes as one backward node; ``depth=0`` folds the whole model, leaving top-level code
    (loss, optimizer) drawn; ``depth=None`` draws every call; the default ``"auto"`` draws every call
    when that makes at most 80 nodes, else folds repeated blocks and then modules from the deepest
    level up until it does. ``fold_repeats`` draws identical sibling blocks once, marked ``×N``;
    ``forward``/``backward`` pick the halves; ``checksums`` adds the first 8 hex digits of each
    tensor's MD5 to its label. An optimizer step is one node (``AdamW0: 148 params``) unless
    ``optimizer_detail`` asks for each parameter, gradient and state tensor it reads and writes.
    """
    if path is not None:
        check_suffix(os.fspath(path))  # fail before the work
    g = build(trace, depth=depth, fold_repeats=fold_repeats, forward=forward, backward=backward,
              checksums=checksums, optimizer_detail=optimizer_detail)
    add_legend(g)
    text = to_dot(g)
    if path is not None:
        write_output(text, path)
    return text


def default_output(trace_path: str) -> str:
    """Where ``gradtrace dot TRACE`` writes by default: the trace's name with ``.dot``."""
    return sibling(trace_path, ".dot")


__all__ = ["Graph", "RenderError", "add_legend", "build", "check_suffix", "default_output", "dot", "to_dot",
           "write_output"]
