"""``gradtrace summary``, ``gradtrace show`` and ``gradtrace md5``: terminal views of one trace."""

from __future__ import annotations

import argparse
import sys

from export.cli.command import Command
from export.cli.console import make_console
from export.cli.progress import Stages, describe_load
from export.cli.traces import add_trace_options, load_for, step_facts
from export.clipping import clipped
from export.errors import UserError
from export.summary import lookup, md5_lines, render_record, render_summary


def _trace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a .gtrace file")
    add_trace_options(p)


def _summary_arguments(p: argparse.ArgumentParser) -> None:
    _trace_argument(p)
    p.add_argument("--all-anomalies", action="store_true",
                   help="list every module a NaN/Inf reached, with its count (default: the count and a range)")
    p.add_argument("--all-frames", action="store_true",
                   help="print every frame of the anomalies' stacks (default: the user's frames and the innermost one)")


def _cmd_summary(args: argparse.Namespace) -> int:
    with Stages(["load"]) as stages:
        stages.next(describe_load(args.trace))
        loaded = load_for(args, args.trace, say_steps=False)
    console = make_console()
    if loaded.several_steps:  # what every step holds first: a NaN in a later step must show
        console.print(f"{len(loaded.steps)} traces in this file:")
        for info in loaded.steps:
            console.print(f"  {step_facts(info)}", soft_wrap=True)
        if args.step is None:
            console.print("Showing the first; choose another with --step N.")
        console.print()
    # A string of megabytes (a hostile or odd file) prints its first characters and its length.
    render_summary(clipped(loaded.trace), console, all_anomalies=args.all_anomalies, all_frames=args.all_frames)
    return 0


def _show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a .gtrace file")
    p.add_argument("name", help="the record's name (kind:name where several kinds share it: tensor:linear0)")
    add_trace_options(p)
    p.add_argument("--all-frames", action="store_true",
                   help="print every frame of the stack (default: the user's frames and the innermost one)")


def _cmd_show(args: argparse.Namespace) -> int:
    trace = load_for(args, args.trace).trace
    lookup(trace, args.name)  # fail with the suggestion before printing anything
    render_record(clipped(trace), args.name, make_console(), all_frames=args.all_frames)
    return 0


def _cmd_md5(args: argparse.Namespace) -> int:
    trace = load_for(args, args.trace).trace
    if trace.hash_algorithm == "none":
        raise UserError(f"{args.trace} was recorded with hash='none': it has no checksums "
                        "(record with tracer.trace(hash='md5'))")
    lines = md5_lines(trace)
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()
    return 0


SUMMARY = Command(
    "summary", help="status, counts, top APIs, modules, backward runs and NaN/Inf of a trace",
    description="Print a summary of a trace: header, top APIs, per-module counts, backward runs "
                "and tensors with NaN or Inf (the first of each per phase, then counts and a range; "
                "--all-anomalies lists every module). Plain text when not on a terminal.",
    arguments=_summary_arguments, run=_cmd_summary)

SHOW = Command(
    "show", help="one call, tensor, grad node or backward run with its links and stack",
    description="Print one record by name (call linear3, tensor linear3:out, grad node "
                "linear3/AddmmBackward0, backward run backward0) with every field, the records "
                "it links to and its call stack. A name several kinds share (a parameter held as "
                "linear0 beside the call linear0) is spelled with its kind: call:linear0, "
                "tensor:linear0, node:..., backward:... An unknown or shared bare name exits 2 and "
                "says what to type.",
    arguments=_show_arguments, run=_cmd_show)

MD5 = Command(
    "md5", help="name:md5 per tensor in creation order (for diff)",
    description="Print one line 'name:md5' per tensor in creation order and nothing else, so "
                "`diff <(gradtrace md5 a.gtrace) <(gradtrace md5 b.gtrace)` compares two runs. "
                "A tensor that was not hashed (meta, fake, sparse, ...) prints 'name:-'. "
                "A trace recorded with hash='none' is an error (exit 2).",
    arguments=_trace_argument, run=_cmd_md5)
