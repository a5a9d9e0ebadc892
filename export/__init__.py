"""gradtrace's report side: everything here takes a ``tracer.Trace`` (live or loaded) and nothing else.

    import export
    export.html(trace, "step.html")        # self-contained interactive report
    export.dot(trace, "step.svg")          # Graphviz (.dot always; .svg/.png/.pdf with `dot`)
    export.diff(a, b)                      # first divergence, forward and backward
    export.backward_graph(loss, "g.svg")   # grad-node graph of any tensor, no trace needed

The functions deliberately share their submodules' names (``export.dot`` is the function); the
submodules stay importable with ``from export.dot import ...``.
"""

from __future__ import annotations

from export.diff import diff
from export.dot import dot
from export.dot.backward_graph import backward_graph
from export.html import html
from export.summary import md5_lines, render_summary
from export.text import to_text

__all__ = ["backward_graph", "diff", "dot", "html", "md5_lines", "render_summary", "to_text"]
