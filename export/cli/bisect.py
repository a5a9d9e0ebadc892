"""``gradtrace bisect A.gtsteps B.gtsteps``: the first step where two runs part, from their step
logs; ``gradtrace bisect --run "CMD_A" "CMD_B"``: the whole hunt, down to the op.

With ``--run`` both programs run under ``gradtrace run --log`` (each in a process of its own,
``export.cli.runs``), their logs are compared (``export.bisect``), and both run again with the
step where they part traced (``gradtrace run --steps K``). The logs of those second runs are
compared with the first ones: a program whose two runs part at or before step K is not
deterministic there, and that is said instead of blaming the change. Otherwise the two traces of
step K are diffed (``export.diff``) and the op-level first divergence is printed with both
stacks. Every file stays in ``--out`` (default ``bisect-runs/``): the logs, the programs'
outputs and the traces.

Reading logs needs no torch (``--run`` starts its runs as separate processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys

from export.bisect import BisectResult, bisect
from export.cli.command import Command
from export.cli.console import make_console
from export.cli.runs import Run, last_lines, prepare_dir, program_words, run_program
from export.diff import DiffResult, diff
from export.errors import UserError
from export.load import load_trace
from export.text import inert
from tracer.model.frames import FRAMEWORK, frame_class

DEFAULT_OUT = "bisect-runs"


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="the first run's step log (.gtsteps); with --run, its command line")
    p.add_argument("b", metavar="B", help="the second run's step log; with --run, its command line")
    p.add_argument("--run", action="store_true",
                   help="A and B are command lines (\"python train.py --lr 3e-4\"): run both under the step log, "
                        "find the step where they part, run both again with that step traced, and print the op "
                        "where that step first differs")
    p.add_argument("--rtol", type=float, help="relative tolerance: compare losses, learning rates and the norms of "
                                              "parameters and gradients, not their fingerprints")
    p.add_argument("--atol", type=float, help="absolute tolerance (as --rtol)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (two logs only)")
    p.add_argument("--out", metavar="DIR", help=f"with --run: the folder for the logs, outputs and traces of the runs "
                                                f"(default: {DEFAULT_OUT})")
    p.add_argument("--hash", choices=("md5", "fast"), default="md5",
                   help="with --run: checksums of the traced step (default md5)")
    p.add_argument("--force", action="store_true", help="with --run: write into a folder that holds files already")


def _cmd(args: argparse.Namespace) -> int:
    if args.run:
        if args.json:
            raise UserError("--json prints the comparison of two logs: drop it with --run")
        return run_both(args)
    only_run = [flag for flag, given in (("--out", args.out is not None), ("--hash", args.hash != "md5"),
                                         ("--force", args.force)) if given]
    if only_run:
        raise UserError(f"{', '.join(only_run)} only with --run (A and B are then command lines)")
    result = bisect(args.a, args.b, rtol=args.rtol, atol=args.atol)
    args.exit_code = result.exit_code  # the verdict, whatever happens to the output (a closed pipe)
    if args.json:
        print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    else:
        print_result(result)
    return result.exit_code


def print_result(result: BisectResult, run_hint: bool = True) -> None:
    """The verdict paragraph and the commands that trace the step (inert text: names come from
    the logs)."""
    print(inert(result.describe()))
    commands = result.commands()
    p = result.parting
    if p is not None and commands:
        step = 0 if p.kind == "start" else p.step
        print(f"\nTo trace step {step} in both runs and diff them:")
        for c in commands:
            print("  " + inert(c))
    elif p is not None and p.kind not in ("length", "layout"):
        print("\n(The logs do not say how their programs were started: trace the step with "
              "tracer.trace(steps=...) in each, then gradtrace diff the two traces.)")
    if run_hint and p is not None and commands:
        print(f"(or all at once: gradtrace bisect --run {shlex.quote(_program_of(result.a_meta))} "
              f"{shlex.quote(_program_of(result.b_meta))})")


def _program_of(meta: dict[str, object]) -> str:
    argv = meta.get("argv")
    words = [str(a) for a in argv] if isinstance(argv, list) else []
    return shlex.join((["-m"] if meta.get("module") is True else []) + words)


# ---- --run ---------------------------------------------------------------------------------------
def run_both(args: argparse.Namespace) -> int:
    """Run both programs, compare their logs, trace the step where they part, diff it."""
    out = prepare_dir(args.out or DEFAULT_OUT, args.force)
    err = sys.stderr
    first = [Run(label, program_words(cmd), os.path.join(out, f"{tag}.gtsteps"), os.path.join(out, f"{tag}.out"))
             for label, tag, cmd in (("A", "a", args.a), ("B", "b", args.b))]
    for r in first:
        run_program(r, [], "running with the step log", err)
        _check_logged(r)
    result = bisect(first[0].log, first[1].log, rtol=args.rtol, atol=args.atol)
    print(inert(result.describe()), flush=True)
    for r in first:
        if r.code != 0:
            print(f"gradtrace: note: {inert(r.failed_words())}", file=err)
    p = result.parting
    if p is None:
        return 0
    if p.kind in ("length", "layout"):
        return 1
    step = 0 if p.kind == "start" else p.step
    traces = [os.path.join(out, f"{tag}.step{step}.gtrace") for tag in ("a", "b")]
    again = [Run(f"{r.label} again", r.words, os.path.join(out, f"{tag}.again.gtsteps"),
                 os.path.join(out, f"{tag}.again.out")) for r, tag in zip(first, ("a", "b"))]
    for r, trace in zip(again, traces):
        run_program(r, ["--steps", str(step), "--hash", args.hash, "-o", trace], f"running again, tracing step {step}",
                    err)
    if _not_deterministic(first, again, step):
        return 1
    missing = [t for t in traces if not os.path.exists(t)]
    if missing:
        raise UserError(f"the second runs did not trace step {step} ({', '.join(missing)} missing): see "
                        f"{again[0].output} and {again[1].output}")
    ta, tb = load_trace(traces[0]), load_trace(traces[1])
    found = dataclasses.replace(diff(ta, tb, rtol=args.rtol, atol=args.atol), a_label=traces[0], b_label=traces[1])
    print(f"\nStep {step}, op by op ({traces[0]} against {traces[1]}):", flush=True)
    found.render(make_console())
    print(f"\nThe runs part at step {step}, {inert(first_op(found))}.", flush=True)
    print(f"gradtrace: every file of both runs is in {out}/ (logs, outputs, the traces of step {step})", file=err)
    return 1


def first_op(found: DiffResult) -> str:
    """Where the step's diff found the first divergence: forward first, then backward."""
    for section in (found.forward, found.backward):
        o = section.origin
        if o is None:
            continue
        frame = next((f for f in reversed(section.stack_a) if frame_class(f.file) != FRAMEWORK),
                     section.stack_a[-1] if section.stack_a else None)
        where = f" at {frame.file}:{frame.line} ({frame.code.strip()})" if frame is not None else ""
        return f"first at {o.a} ({o.what} in {o.module or '<root>'}, {o.phase or section.section}){where}: {section.reason}"
    return f"but the traces of the step show no single origin: {found.verdict()}"


def _check_logged(r: Run) -> None:
    """A run that wrote no log (its script was not found, gradtrace refused an option) stops here."""
    if not os.path.exists(r.log) or os.path.getsize(r.log) == 0:
        tail = last_lines(r.output, 3)
        raise UserError(f"{r.label} wrote no step log (exit status {r.code}; its output, {r.output}, ends with: "
                        f"{tail or 'nothing'})")


def _not_deterministic(first: list[Run], again: list[Run], step: int) -> bool:
    """Compare each program's two runs up to ``step``; say so where they part."""
    flaky = False
    for one, two in zip(first, again):
        if not os.path.exists(two.log):
            raise UserError(f"{two.label} wrote no step log: see {two.output}")
        same = bisect(one.log, two.log)
        p = same.parting
        if p is None or p.step > step or (p.kind == "length" and same.compared > step):
            continue
        flaky = True
        where = f"before step {step}, where A and B part" if p.step < step else "the step where A and B part"
        print(f"\n{one.label}'s program is not deterministic: two runs of the same command part at step {p.step}, "
              f"{where}. {inert(same.describe())}", flush=True)
    if flaky:
        print("\nSo the difference at step " + str(step) + " cannot be blamed on what differs between A and B: make "
              "the program deterministic first (seed every generator, the data loader's shuffling included; "
              "gradtrace run --check-determinism --steps N names an op that is not), then bisect again.", flush=True)
    return flaky


COMMAND = Command(
    "bisect", help="the first step where two runs part, from their step logs (exit 1 if they part); --run: run two "
                   "programs and find the op",
    description="Compare two step logs (gradtrace run --log, tracer.watch(log=...), tracer.step_log) step by step "
                "and say, in one paragraph, the first step whose results differ and what differed first (the batch, "
                "the random state, a learning rate, the loss, the gradients, a parameter's update), with the exact "
                "commands that trace that step in both runs. With --run, A and B are command lines: both programs "
                "run under the step log, then again with that step traced, and the op where it first differs is "
                "printed with both stacks; a program that is not deterministic up to that step is said to be. "
                "Exit status: 0 the runs agree, 1 they part, 2 bad input.",
    usage="gradtrace bisect [options] A.gtsteps B.gtsteps\n       gradtrace bisect --run [options] \"CMD_A\" \"CMD_B\"",
    epilog="examples:\n"
           "  gradtrace bisect good.gtsteps bad.gtsteps           the step where the runs part, and what differed\n"
           "  gradtrace bisect a.gtsteps b.gtsteps --rtol 1e-3    within a tolerance (other hardware, other dtypes)\n"
           "  gradtrace bisect --run \"train.py\" \"train.py --new-loader\"   the whole hunt, down to the op",
    arguments=_arguments, run=_cmd)
