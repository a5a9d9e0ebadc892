"""``gradtrace diff A B`` (the first divergence of two traces) and ``gradtrace diff --ranks``
(which rank of a data-parallel step departed first; ``diff-ranks``, its older spelling, still
works but is not listed)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from export.cli.command import Command
from export.cli.console import make_console
from export.cli.outputs import check_output
from export.cli.traces import add_trace_options, load_for
from export.diff import diff, diff_html, diff_ranks
from export.errors import UserError
from export.load import load_options


# ---- diff ------------------------------------------------------------------------------------------
def _diff_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="first trace (.gtrace)")
    p.add_argument("b", metavar="B", help="second trace (.gtrace)")
    p.add_argument("more", nargs="*", metavar="TRACE", help="with --ranks: the other ranks' traces")
    p.add_argument("--ranks", action="store_true",
                   help="compare the per-rank traces of one data-parallel step, two or more: the first rank whose "
                        "parameters, reduced gradients or collectives depart from the others")
    p.add_argument("--html", metavar="OUT", help="also write a self-contained HTML view")
    p.add_argument("--rtol", type=float, help="relative tolerance: compare by recorded stats, not checksums")
    p.add_argument("--atol", type=float, help="absolute tolerance: compare by recorded stats, not checksums")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    p.add_argument("--all-frames", action="store_true",
                   help="print every frame of the origins' stacks (default: the user's frames and the innermost one)")
    add_trace_options(p)


def _cmd_diff(args: argparse.Namespace) -> int:
    if args.ranks:
        two_only = [flag for flag, given in (("--html", args.html), ("--rtol", args.rtol is not None),
                                             ("--atol", args.atol is not None)) if given]
        if two_only:
            raise UserError(f"{', '.join(two_only)} compare two traces, not --ranks: drop {', '.join(two_only)}")
        return run_paths([args.a, args.b, *args.more], as_json=args.json, args=args)
    if args.html:
        check_output(args.html, [args.a, args.b, *args.more], option="--html")
    if args.more:
        raise UserError("diff compares two traces; pass --ranks to compare one trace per rank")

    # Loaded here, not by diff(), so that --step and --max-decompressed apply and a file's
    # steps are said; the result keeps the paths as its labels.
    ta, tb = load_for(args, args.a).trace, load_for(args, args.b).trace
    result = dataclasses.replace(diff(ta, tb, rtol=args.rtol, atol=args.atol), a_label=args.a, b_label=args.b)
    args.exit_code = result.exit_code  # the verdict, whatever happens to the output (a closed pipe)
    if args.json:
        print(json.dumps(result.to_json(), indent=2, sort_keys=True, allow_nan=False))
    else:
        result.render(make_console(), all_frames=args.all_frames)
    if args.html:
        assert result.trace_a is not None and result.trace_b is not None
        diff_html(result, result.trace_a, result.trace_b, args.html)
        print(f"wrote {args.html}", file=sys.stderr)
    return result.exit_code


DIFF = Command(
    "diff", help="first divergence between two traces, forward and backward (exit 1 if any); "
                 "--ranks: the first departing rank of a data-parallel step",
    description="Align two traces of the same step and report the first record whose inputs match but "
                "outputs differ, forward and backward, with both call stacks. With --ranks, compare the "
                "per-rank traces of one data-parallel step instead (parameters, gradients after the "
                "all-reduce, rank-invariant collectives) and report the first rank that departs. Exit "
                "status: 0 equal (or within tolerance), 1 diverged, 2 bad input.",
    usage="gradtrace diff [options] A B\n       gradtrace diff --ranks [options] RANK0 RANK1 [RANK ...]",
    epilog="examples:\n"
           "  gradtrace diff good.gtrace bad.gtrace              first divergence, forward and backward\n"
           "  gradtrace diff a.gtrace b.gtrace --rtol 1e-3       within a tolerance (by recorded stats)\n"
           "  gradtrace diff a.gtrace b.gtrace --html diff.html  also a side-by-side page\n"
           "  gradtrace diff --ranks step.rank*.gtrace           which rank of a DDP/FSDP step departed",
    arguments=_diff_arguments, run=_cmd_diff)


# ---- diff --ranks (and diff-ranks, its older spelling) ------------------------------------------------------------------------------------
def run_paths(paths: Sequence[str], *, as_json: bool = False, args: argparse.Namespace | None = None) -> int:
    """Compare per-rank trace files and print the result; the exit status (for ``diff --ranks``),
    also put in ``args.exit_code`` before anything is printed (see ``export.cli.main``)."""
    for path in paths:
        if not os.path.exists(path):
            raise UserError(f"no such trace: {path}")
    with load_options(getattr(args, "step", None), getattr(args, "max_decompressed", None)):
        result = diff_ranks(list(paths))
    if result.problems:
        raise UserError("; ".join(result.problems))
    if args is not None:
        args.exit_code = result.exit_code
    if as_json:
        print(json.dumps(result.to_json(), indent=2, sort_keys=True, allow_nan=False))
    else:
        result.render(make_console())
    return result.exit_code


def _ranks_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE", help="per-rank traces (step.rank0.gtrace step.rank1.gtrace ...)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    add_trace_options(p)


def _cmd_diff_ranks(args: argparse.Namespace) -> int:
    return run_paths(args.traces, as_json=args.json, args=args)


DIFF_RANKS = Command(
    "diff-ranks", hidden=True, help="compare the per-rank traces of one data-parallel step (exit 1 if a rank departed)",
    description="Compare what must be identical across data-parallel replicas (parameters, gradients after "
                "the all-reduce, outputs of rank-invariant collectives, the order of collectives) in the "
                "per-rank traces of one step, and report the first record where a rank departs with its "
                "call, stack and module path. Exit status: 0 agree, 1 a rank departed, 2 bad input.",
    arguments=_ranks_arguments, run=_cmd_diff_ranks)
