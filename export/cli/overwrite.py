"""No silent overwrite: ``gradtrace report`` and ``gradtrace dot`` refuse to replace an existing
file unless ``--force``, except the demo's own outputs (``demo.html``/``demo.dot`` beside
``demo.gtrace``), which ``gradtrace demo`` rewrites on every run and its next steps render again."""

from __future__ import annotations

import argparse
import os

from export.errors import UserError
from tracer.model.display import sibling

DEMO_TRACE = "demo.gtrace"


def add_force(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--force", action="store_true", help="overwrite the output file if it exists")


def check_overwrite(out: str, trace_path: str, force: bool) -> None:
    """Raise ``UserError`` (exit 2) when ``out`` exists and may not be replaced."""
    if force or not os.path.exists(out):
        return
    if os.path.isdir(out):
        raise UserError(f"{out} is a directory; pass a file name with -o")
    if os.path.basename(trace_path) == DEMO_TRACE and os.path.abspath(out) in {
            os.path.abspath(sibling(trace_path, ext)) for ext in (".html", ".dot")}:
        return
    raise UserError(f"{out} exists; pass --force to overwrite it, or choose another name with -o")
