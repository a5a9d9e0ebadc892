"""``gradtrace report TRACE [MORE ...]``: the interactive HTML report of a trace (several traces:
the ranks of one run, on one page with a rank switcher)."""

from __future__ import annotations

import argparse
import os
import sys

from export.cli.command import Command, size
from export.cli.outputs import check_output
from export.cli.overwrite import add_force, check_overwrite
from export.cli.progress import Stages, describe_load, describe_write
from export.cli.traces import add_trace_options, load_for
from export.errors import UserError
from export.html import DEFAULT_MAX_BYTES, default_output, html_ranks, write_page
from tracer.model.display import format_size


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a .gtrace file")
    p.add_argument("more", nargs="*", metavar="TRACE",
                   help="more traces: the other ranks of a distributed run (one page, a rank switcher)")
    p.add_argument("-o", "--output", help="output .html (default: the trace path with .html)")
    p.add_argument("--max-bytes", type=size, default=DEFAULT_MAX_BYTES, metavar="SIZE",
                   help=f"page size limit (20M, 50MB, 64MiB or bytes); past it only the first calls are kept (default "
                        f"{DEFAULT_MAX_BYTES:,} bytes)")
    add_force(p)
    add_trace_options(p)


def _cmd_report(args: argparse.Namespace) -> int:
    paths = [args.trace, *args.more]
    for p in paths:
        if not os.path.exists(p):
            raise UserError(f"no such trace file: {p}")
    out = args.output or default_output(args.trace)
    check_output(out, paths)
    check_overwrite(out, args.trace, args.force)
    if args.more:  # several ranks of one run: one page with a rank switcher
        with Stages([*paths, out]) as stages:
            traces = []
            for p in paths:
                stages.next(describe_load(p))
                traces.append(load_for(args, p).trace)
            stages.next(describe_write("writing", out))
            size = html_ranks(traces, out, max_bytes=args.max_bytes)
        print(f"{out} ({format_size(size)}, {size} bytes, {len(paths)} ranks)")
        return 0
    with Stages(["load", "write"]) as stages:
        stages.next(describe_load(args.trace))
        trace = load_for(args, args.trace).trace
        stages.next(describe_write("writing", out))
        try:
            size, omitted = write_page(trace, out, max_bytes=args.max_bytes)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        except OSError as exc:
            raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"{out} ({format_size(size)}, {size} bytes)")
    if omitted is not None:
        print(f"gradtrace report: note: {omitted['message']}", file=sys.stderr)
    return 0


COMMAND = Command(
    "report", help="write the interactive HTML report of a trace",
    description="Write a self-contained HTML report (no network needed to view it).",
    arguments=_arguments, run=_cmd_report)
