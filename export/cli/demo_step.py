"""What ``gradtrace demo`` does (its arguments are ``export.cli.demo``'s): trace one training step
of the bundled tiny GPT and show what came out.

It writes ``demo.gtrace`` (streamed while recording), prints the summary, writes ``demo.html``
beside it, and lists the next commands to try. This module imports torch (through ``tracer.api``
and ``tracer.demo``): the command line imports it only when ``demo`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex

from export.cli.console import make_console
from export.errors import UserError
from export.html import default_output, html
from export.summary import render_summary
from tracer.api import trace
from tracer.demo import build_demo, demo_step


def _check_writable(path: str) -> None:
    # Overwriting an older demo trace is the point of running the demo again; overwriting some
    # other file the user happens to have under that name is not.
    if not os.path.exists(path):
        return
    if os.path.isdir(path):
        raise UserError(f"{path} is a directory; pass a file name with -o")
    with open(path, "rb") as fh:
        first = fh.readline(1 << 16)
    if first.startswith(b"\x1f\x8b"):  # a gzip trace
        return
    try:
        head = json.loads(first)
    except ValueError:
        head = None
    if not (isinstance(head, dict) and head.get("t") == "header" and head.get("format") == "gradtrace"):
        raise UserError(f"{path} exists and is not a gradtrace trace; choose another name with -o")


def run_demo(out: str, report: bool = True) -> list[str]:
    """Trace one demo step into ``out`` (and its HTML report); return the files written."""
    _check_writable(out)
    model, optimizer, batch = build_demo(seed=0)
    with trace(out=out) as t:
        demo_step(model, optimizer, batch)
    console = make_console()
    render_summary(t, console)
    written = [out]
    if report:
        page = default_output(out)
        html(t, page)
        written.append(page)
    console.print()
    console.print("Wrote " + ", ".join(written), soft_wrap=True, markup=False)
    q = shlex.quote(out)
    nxt = [f"gradtrace show {q} linear3", f"gradtrace show {q} linear3/AddmmBackward0",
           f"gradtrace show {q} StraightThroughClamp0", f"gradtrace md5 {q}", f"gradtrace report {q}"]
    console.print("Next, try:")
    for cmd in nxt:
        console.print(f"  {cmd}", soft_wrap=True, markup=False)
    return written


def cmd_demo(args: argparse.Namespace) -> int:
    run_demo(args.out, report=not args.no_report)
    return 0


