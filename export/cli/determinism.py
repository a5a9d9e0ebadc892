"""``gradtrace run --check-determinism --steps K script.py``: which op of step K is not deterministic.

A script's step cannot be replayed inside its own process (only a step function can, as
``tracer.check_determinism`` does), so the program runs ``--repeats`` times, each run in a
process of its own under ``gradtrace run --log --steps K --hash fast``. Where the runs' logs show
that they already differ before step K, or as it begins (its parameters, its batch, its random
state), that is said: the nondeterminism lies earlier, and the step where it starts is named.
Otherwise the traces of step K are compared record by record (``tracer.analysis.determinism``)
and the first op whose inputs are bit-equal and whose outputs are not is named, with its line and
the usual cause. Every file is kept in ``<script>.determinism/`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import os
import sys

from export.bisect import bisect
from export.cli.runs import Run, prepare_dir, run_program
from export.errors import UserError
from export.load import load_trace
from export.text import inert
from tracer.analysis.determinism import compare_runs
from tracer.loops.program import Program

INPUT_KINDS = ("start", "batch", "rng", "layout", "length")


def _step_of(args: argparse.Namespace) -> int:
    chosen = [flag for flag, given in (("--watch", args.watch), ("--every", args.every is not None),
                                       ("--log", args.log is not None), ("--report", args.report),
                                       ("--per-step-files", args.per_step_files)) if given]
    if chosen:
        raise UserError(f"--check-determinism runs the program itself and traces one step: drop {', '.join(chosen)}")
    if args.steps is None or not args.steps.strip().isdigit():
        raise UserError("--check-determinism needs the step to check, one step number: --steps K")
    if isinstance(args.repeats, bool) or args.repeats < 2:
        raise UserError("--repeats must be 2 or more")
    return int(args.steps)


def check_program(program: Program, args: argparse.Namespace) -> int:
    """Run ``program`` ``args.repeats`` times tracing step K, and say which op (if any) of step K
    is not deterministic. Exit status 0: deterministic, 1: not, 2: bad input."""
    step = _step_of(args)
    out = prepare_dir(args.out or f"{program.stem}.determinism", force=True)
    words = (["-m"] if program.is_module else []) + [program.target, *program.args]
    err = sys.stderr
    runs, traces = [], []
    for i in range(args.repeats):
        tag = f"run{i + 1}"
        trace = os.path.join(out, f"{tag}.step{step}.gtrace")
        run = Run(f"run {i + 1}", words, os.path.join(out, f"{tag}.gtsteps"), os.path.join(out, f"{tag}.out"))
        run_program(run, ["--steps", str(step), "--hash", "fast", "-o", trace],
                    f"run {i + 1} of {args.repeats}, tracing step {step}", err)
        if not os.path.exists(trace):
            raise UserError(f"{run.failed_words() if run.code else run.label + ' did not reach step ' + str(step)}: "
                            f"no trace of step {step}")
        runs.append(run)
        traces.append(trace)
    for run in runs[1:]:
        same = bisect(runs[0].log, run.log)
        p = same.parting
        if p is not None and (p.step < step or (p.step == step and p.kind in INPUT_KINDS)):
            # (bisect's words call the two logs A and B: say which run each is)
            print(f"Step {step} does not start from the same state in every run: run 1 and {run.label} part at "
                  f"step {p.step} (A: run 1, B: {run.label}). {inert(same.describe())}")
            if p.step < step:
                print(f"Check that step instead: gradtrace run --check-determinism --steps {p.step} ...")
            return 1
    report = compare_runs([load_trace(t) for t in traces])
    print(f"Step {step}: {inert(report.describe())}")
    print(f"gradtrace: the runs' logs, outputs and traces are in {out}/", file=err)
    return 0 if report.deterministic else 1
