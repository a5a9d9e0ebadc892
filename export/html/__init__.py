"""The HTML views of a trace: the interactive report (``html``), one page for the ranks of a
distributed run (``html_ranks``) and the notebook view (``Trace._repr_html_``, installed when
``export`` is imported).

``page`` assembles the report from ``data`` (the trace as JSON-ready data) and ``memory`` (the
memory timeline as SVG); ``template`` is the templating every page uses (``templates/``, CSS/JS
from ``export/assets``, ``json_for_script``).
"""

from __future__ import annotations

from export.html.notebook import NOTEBOOK_MAX_BYTES, InlineReport, inline_report, notebook_html
from export.html.page import DEFAULT_MAX_BYTES, default_output, html, render, write_page
from export.html.ranks import html_ranks
from export.html.template import json_for_script
from tracer.model import install_view

install_view("notebook", notebook_html)  # Trace._repr_html_ in notebooks, once export is imported

__all__ = ["DEFAULT_MAX_BYTES", "NOTEBOOK_MAX_BYTES", "InlineReport", "default_output", "html", "html_ranks",
           "inline_report", "json_for_script", "notebook_html", "render", "write_page"]
