"""``gradtrace dot TRACE [-o OUT]``: the Graphviz picture of a trace (.dot, .svg, .png, .pdf)."""

from __future__ import annotations

import argparse
from typing import Literal

from export.cli.command import Command
from export.cli.outputs import check_output
from export.cli.overwrite import add_force, check_overwrite
from export.cli.progress import Stages, describe_load, describe_write
from export.cli.traces import add_trace_options, load_for
from export.dot import check_suffix, default_output, dot


def _depth(text: str) -> int | Literal["auto"] | None:
    if text in ("auto", "full"):
        return None if text == "full" else "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not auto, full or a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a .gtrace file")
    p.add_argument("-o", "--output", help="output file (default: TRACE with a .dot suffix)")
    p.add_argument("--depth", type=_depth, metavar="N|auto|full", default="auto",
                   help="draw each module at depth N (blocks.0 has depth 2) as one node holding its "
                        "calls and its submodules'; 0 draws the whole model as one node; full draws "
                        "every call; auto (the default) folds repeated blocks and then modules until "
                        "the picture has at most 80 nodes (calls at the top level are never folded: "
                        "the title says when that leaves more)")
    p.add_argument("--fold-repeats", action="store_true",
                   help="draw identical sibling blocks (h.0 .. h.11) once, marked ×N")
    half = p.add_mutually_exclusive_group()
    half.add_argument("--forward-only", action="store_true", help="only the forward calls")
    half.add_argument("--backward-only", action="store_true", help="only the grad nodes")
    p.add_argument("--no-checksums", action="store_true", help="leave MD5 prefixes out of labels")
    p.add_argument("--optimizer-detail", action="store_true",
                   help="draw each parameter, gradient and state tensor of an optimizer step "
                        "(default: one node, e.g. 'AdamW0: 148 params')")
    add_force(p)
    add_trace_options(p)


def _cmd_dot(args: argparse.Namespace) -> int:
    out = args.output or default_output(args.trace)
    check_suffix(out)
    check_output(out, [args.trace])
    check_overwrite(out, args.trace, args.force)
    with Stages(["load", "draw"]) as stages:
        stages.next(describe_load(args.trace))
        trace = load_for(args, args.trace).trace
        stages.next(describe_write("drawing", out))
        dot(trace, out, depth=args.depth, fold_repeats=args.fold_repeats, forward=not args.backward_only,
            backward=not args.forward_only, checksums=not args.no_checksums,
            optimizer_detail=args.optimizer_detail)
    print(f"wrote {out}")
    return 0


COMMAND = Command(
    "dot", help="draw a trace as a Graphviz graph (.dot, .svg, .png, .pdf)",
    description="Draw the forward calls and the grad nodes of a trace as a Graphviz graph. "
                "The output extension picks the format; .svg/.png/.pdf need Graphviz's `dot`.",
    arguments=_arguments, run=_cmd_dot)
