"""``gradtrace run``: trace chosen steps of an unmodified program, run the way ``python`` runs it.

    gradtrace run --steps 100,200 --report train.py --lr 3e-4
    gradtrace run --every 500 --out run.gtrace -m mypackage.train --config big.yaml
    gradtrace run --watch train.py          # the program's tracer.watch / WatchCallback, with reports
    gradtrace run --log run.gtsteps train.py                # a step log of the whole run (gradtrace bisect)
    gradtrace run --check-determinism --steps 10 train.py   # the op of step 10 that is not deterministic

gradtrace's options come before the program, the program's own arguments after it (as with
``python`` itself). This module is the command's definition: its arguments, among them every
option of ``tracer.trace`` (``TraceOptions``' fields; ``trace_options`` reads them back), and
nothing that imports torch, so that ``gradtrace --help`` starts without it. What the command
does (the run, the progress display, the closing lines) is ``export.cli.run_program``'s,
imported when the command runs.
"""

from __future__ import annotations

import argparse

from export.cli.command import Command, deferred, size
from export.errors import UserError
from tracer.options import DEFAULT_KEEP_VALUES_BYTES, HASH_ALGORITHMS, STEP_ON, TraceKwargs

# TraceOptions' fields that no command-line option gives, and why (tests/test_run.py checks that
# every other field has an option whose dest is the field's name, so a new field is not forgotten).
NOT_ON_THE_COMMAND_LINE = {
    "listeners": "Python objects: the program attaches its own with tracer.trace(listeners=...)",
}


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text[:40]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def add_recording_options(p: argparse.ArgumentParser) -> None:
    """Every option of ``tracer.trace`` but ``listeners``, each with ``dest`` the option's name."""
    g = p.add_argument_group("what each traced step records (tracer.trace's options; SIZE: 50M, 2G, 64MiB)")
    g.add_argument("-o", "--out", metavar="PATH",
                   help="trace file (default: the program's name + .gtrace; .gz compresses)")
    g.add_argument("--hash", choices=HASH_ALGORITHMS, default="md5",
                   help="tensor checksums: exact md5 (default), fast on-device fingerprints, or none")
    g.add_argument("--no-stacks", dest="stacks", action="store_false",
                   help="leave out the user's call stack of each call (default: recorded)")
    g.add_argument("--stats", action=argparse.BooleanOptionalAction, default=None,
                   help="min/max/mean/absmax/NaN/Inf of every tensor (default: with checksums, not with --hash none)")
    g.add_argument("--check-numerics", action="store_true",
                   help="NaN/Inf counts of every tensor even with --hash none; the first NaN and the first unintended "
                        "Inf of forward and of backward are named (gradtrace summary)")
    g.add_argument("--raise-on-nonfinite", action="store_true",
                   help="stop the program at the first NaN or unintended Inf (tracer.NonFiniteError, raised in it; "
                        "costly on GPUs: for hunting)")
    g.add_argument("--memory", action="store_true",
                   help="also record every allocation and free, attributed to calls and grad nodes (gradtrace memory)")
    g.add_argument("--optimizer-ops", action="store_true",
                   help="record every op inside optimizer.step() (default: each step is one call)")
    g.add_argument("--node-runs", action=argparse.BooleanOptionalAction, default=None,
                   help="record every grad node's run in backward (the engine's order, each gradient named); default: "
                        "with checksums or stats, else only accumulators' and custom Functions'")
    g.add_argument("--optimizer-state", action=argparse.BooleanOptionalAction, default=None,
                   help="the optimizer state (exp_avg, ...) among each step's inputs and outputs; default: with "
                        "checksums, stats, kept values or --memory")
    g.add_argument("--keep-values", action="append", metavar="PATTERN",
                   help="also keep the values of the tensors whose name or module path matches this glob "
                        "(repeatable; 'params' keeps every parameter and buffer), for element-wise diffs")
    g.add_argument("--keep-values-bytes", type=size, default=DEFAULT_KEEP_VALUES_BYTES, metavar="SIZE",
                   help="at most SIZE bytes of kept values per traced step (default 64MiB; beyond it, a note)")
    g.add_argument("--max-calls", type=_count, metavar="N", help="stop recording after N calls in all (the trace says so)")
    g.add_argument("--max-bytes", type=size, metavar="SIZE",
                   help="stop recording when the traces reach about SIZE bytes")
    g.add_argument("--flush-every", type=_count, default=256, metavar="N",
                   help="calls between two writes of the trace file (default 256; it is also written a second after "
                        "the last write and after each backward)")


def trace_options(args: argparse.Namespace) -> TraceKwargs:
    """The ``tracer.trace`` options the command line gives (``out`` as given: None for the default)."""
    patterns = args.keep_values or []
    if "params" in patterns and len(patterns) > 1:
        raise UserError("--keep-values params keeps every parameter and buffer: give it alone, or patterns")
    return TraceKwargs(hash=args.hash, stacks=args.stacks, stats=args.stats, out=args.out,
                       flush_every=args.flush_every, memory=args.memory, max_calls=args.max_calls,
                       max_bytes=args.max_bytes, check_numerics=args.check_numerics,
                       raise_on_nonfinite=args.raise_on_nonfinite, optimizer_ops=args.optimizer_ops,
                       node_runs=args.node_runs, optimizer_state=args.optimizer_state,
                       keep_values=True if patterns == ["params"] else patterns,
                       keep_values_bytes=args.keep_values_bytes)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", metavar="STEPS",
                   help="optimizer steps to trace, counting from 0: '3', '10,40', '100-105', '500-' "
                        "(default: 0 unless --every is given)")
    p.add_argument("--every", type=int, metavar="N", help="trace steps 0, N, 2N, ...")
    p.add_argument("--step-on", choices=STEP_ON, default="optimizer",
                   help="what ends a step: each optimizer.step() (default), or each backward pass, for loops "
                        "that update the parameters without an optimizer")
    p.add_argument("--report", action="store_true", help="also write the HTML report of each traced step")
    p.add_argument("--per-step-files", action="store_true",
                   help="one file per step (run.step10.gtrace) instead of all steps in one file")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.add_argument("--watch", action="store_true",
                   help="trace nothing up front: the program's own tracer.watch (or WatchCallback) watches every "
                        "step, and each incident gets its HTML report; says so when the program has no watch")
    p.add_argument("--log", metavar="PATH",
                   help="write a step log of every optimizer step (PATH.gtsteps: losses, batch and random-state "
                        "digests, learning rates, a fingerprint of every parameter and gradient) for gradtrace "
                        "bisect; alone, traces no step")
    p.add_argument("--check-determinism", action="store_true",
                   help="run the program --repeats times, tracing step --steps K with fast checksums, and name "
                        "the first op of that step whose inputs are bit-equal and whose outputs differ")
    p.add_argument("--repeats", type=int, default=2, metavar="N", help="with --check-determinism: runs (default 2)")
    add_recording_options(p)
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE [ARGS]",
                   help="run a module as `python -m` does; everything after it goes to the module")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py [ARGS]",
                   help="the script, then its own arguments")


COMMAND = Command(
    "run", help="run a Python program unchanged and trace chosen training steps",
    description="Run a script (or -m module) as python would, tracing the chosen optimizer steps. "
                "gradtrace's options go before the program, the program's own arguments after it. "
                "Sizes: 50M and 2G are powers of 1000 (50,000,000 bytes), 64MiB and 2GiB of 1024.",
    usage="gradtrace run [options] script.py [args ...]\n       gradtrace run [options] -m module [args ...]",
    epilog="examples:\n"
           "  gradtrace run train.py --lr 3e-4                   optimizer step 0 -> train.gtrace\n"
           "  gradtrace run --steps 100,200 --report train.py    two steps, and an HTML report of each\n"
           "  gradtrace run --every 500 -o run.gtrace.gz -m pkg.train --config big.yaml\n"
           "  gradtrace run --hash none --check-numerics train.py   names, links, stacks and the first NaN/Inf\n"
           "  gradtrace run --watch train.py                     the program's tracer.watch, with reports\n"
           "  gradtrace run --log run.gtsteps train.py           a step log of every step (for gradtrace bisect)",
    arguments=add_arguments, run=deferred("export.cli.run_program", "run_command"))
