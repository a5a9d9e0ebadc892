"""gradtrace's report side: everything here takes a ``tracer.Trace`` (live or loaded) and nothing else.

    import export
    export.render(trace, "step.html")      # the view the extension names: .html, .dot/.svg/.png/.pdf, .txt
    export.html(trace, "step.html")        # self-contained interactive report
    export.inline_report(trace)            # that report inside a notebook cell (on request)
    export.dot(trace, "step.svg")          # Graphviz (.dot always; .svg/.png/.pdf with `dot`)
    export.diff(a, b)                      # first divergence, forward and backward
    export.bisect("a.gtsteps", "b.gtsteps")  # the first step where two runs part (their step logs)
    export.backward_graph(loss, "g.svg")   # grad-node graph of any tensor, no trace needed

The house, bottom to top: ``errors`` and ``load``; ``views`` (the module tree) and ``text`` (the
canonical text, stats and stacks; names, shapes and sizes are ``tracer.model.display``'s);
``summary`` (terminal views); the renderers ``dot/``, ``html/`` and ``diff/``; and ``cli/``, the
command line, which nothing else imports. Below ``cli/``, export imports only ``tracer.model``,
``tracer.analysis``, ``tracer.options`` and ``tracer.version``.

The functions deliberately share their sub-packages' names (``export.dot`` is the function); the
sub-packages stay importable with ``from export.dot import ...``.
"""

from __future__ import annotations

import os

from export import companion  # noqa: F401  first: the `tracer` below must be gradtrace's
from export.bisect import bisect
from export.diff import diff, diff_ranks
from export.dot import dot
from export.dot.backward_graph import backward_graph
from export.errors import DiffError, RenderError, UserError
from export.html import html, html_ranks, inline_report
from export.summary import md5_lines, render_summary
from export.text import to_text
from tracer.model import Trace

# gradtrace's export, not another module of that name: see export.companion.
__gradtrace__ = "export"

_DOT_SUFFIXES = (".dot", ".gv", ".svg", ".png", ".pdf")


def render(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write the view of ``trace`` that ``path``'s extension names: ``.html`` the interactive
    report (``html``), ``.dot``/``.gv`` DOT text or ``.svg``/``.png``/``.pdf`` a rendered graph
    (``dot``), ``.txt`` the canonical text (``to_text``). Another extension is a ``UserError``."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix in (".html", ".htm"):
        html(trace, path)
    elif suffix in _DOT_SUFFIXES:
        dot(trace, path)
    elif suffix == ".txt":
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(to_text(trace))
    else:
        shown = suffix or "a name without an extension"
        raise UserError(f"cannot write {shown}: use .html (report), .dot, .gv, .svg, .png, .pdf (graph) "
                        "or .txt (text)")


__all__ = ["DiffError", "RenderError", "UserError", "backward_graph", "bisect", "diff", "diff_ranks", "dot", "html",
           "html_ranks", "inline_report", "md5_lines", "render", "render_summary", "to_text"]
