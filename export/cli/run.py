"""``gradtrace run``: trace chosen steps of an unmodified program, run the way ``python`` runs it.

    gradtrace run --steps 100,200 --report train.py --lr 3e-4
    gradtrace run --every 500 --out run.gtrace -m mypackage.train --config big.yaml
    gradtrace run --watch train.py          # the program's tracer.watch / WatchCallback, with reports
    gradtrace run --log run.gtsteps train.py                # a step log of the whole run (gradtrace bisect)
    gradtrace run --check-determinism --steps 10 train.py   # the op of step 10 that is not deterministic

gradtrace's options come before the program, the program's own arguments after it (as with
``python`` itself). This module is the command's user interface: its arguments, the progress
display on stderr and the closing lines; running the program (``sys.argv``, ``__main__``,
``sys.path[0]``, the exit status, the traceback) is ``tracer.loops.program``'s. The program's
own output is left alone: everything gradtrace says goes to stderr, as a live line per traced
step on a terminal and as plain lines otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import sys
import warnings
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

from export.cli import steplog
from export.cli.command import Command
from export.cli.determinism import check_program
from export.cli.outputs import check_output
from export.errors import UserError
from export.html import default_output, html
from tracer.api import trace
from tracer.loops.program import Program, WatchedRun, execute
from tracer.loops.steps import STEP_ON, StepObserver, StepTrace
from tracer.model import Trace, load_steps
from tracer.model.display import format_size, plural, with_tag
from tracer.options import DEFAULT_KEEP_VALUES_BYTES


# ---- the program -------------------------------------------------------------------------------
def program_from_args(args: argparse.Namespace) -> Program:
    """The script or module to run, checked the way python checks it before running anything."""
    if args.module is not None:
        if not args.module:
            raise UserError("-m needs a module name (gradtrace run [options] -m package.module [args...])")
        name, *rest = args.module
        sys.path.insert(0, os.getcwd())  # where `python -m` looks first
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise UserError(f"no module named {name!r}")
        return Program(name, True, rest)
    program = list(args.program)
    if program and program[0] == "--":
        program = program[1:]
    if not program:
        raise UserError("nothing to run: gradtrace run [options] script.py [args...] "
                        "or gradtrace run [options] -m package.module [args...]")
    script = program[0]
    if not os.path.exists(script):
        raise UserError(f"can't open file {script!r}: no such file")
    if os.path.isdir(script) and not os.path.exists(os.path.join(script, "__main__.py")):
        raise UserError(f"can't find '__main__' module in {script!r}")
    return Program(script, False, program[1:])


# ---- progress ------------------------------------------------------------------------------------
def _facts(trace: Trace) -> str:
    return (f"{plural(len(trace.calls), 'call')}, {plural(len(trace.grad_nodes), 'grad node')}, "
            f"{plural(len(trace.backward_runs), 'backward run')}")


def why_stopped(trace: Trace) -> str:
    """Why recording stopped early in this step, in a few words ("" when it did not)."""
    note = next((n for n in trace.notes if n.startswith("recording stopped")), None)
    if note is None:
        return ""
    if "gradtrace failed" in note:  # (tracer.record.failsafe: the program went on untraced)
        return "recording stopped: gradtrace failed, see the trace's notes"
    return "recording stopped at a bound"


class PlainProgress(StepObserver):
    """One line per traced or skipped step on a stream (deterministic: for logs, pipes, tests)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def step_end(self, step: int, trace: Trace, path: str | None) -> None:
        stopped = f" ({why_stopped(trace)})" if why_stopped(trace) else ""
        status = "" if trace.status == "ok" else f" [{trace.status}]"
        print(f"gradtrace: step {step} traced: {_facts(trace)}{stopped}{status}", file=self.stream, flush=True)

    def step_skipped(self, step: int, reason: str) -> None:
        print(f"gradtrace: step {step} not traced: {reason}", file=self.stream, flush=True)


class LiveProgress(PlainProgress):
    """A live line while a step is recorded (calls so far, then checksums being finished)."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.console = Console(file=stream, stderr=stream is sys.stderr)
        self._live: Live | None = None
        self._step = 0
        self._trace: Trace | None = None
        self._finishing = False

    def _render(self) -> Spinner:
        t = self._trace
        facts = f"{plural(len(t.calls), 'call')}, {plural(len(t.grad_nodes), 'grad node')}" if t is not None else ""
        what = " · finishing checksums" if self._finishing else ""
        return Spinner("dots", text=f"gradtrace: tracing step {self._step} · {facts}{what}", style="cyan")

    def step_begin(self, step: int, trace: Trace) -> None:
        self._step, self._trace, self._finishing = step, trace, False
        # Redirecting the program's prints above the live line is only right when both streams
        # are the terminal; otherwise its stdout must stay untouched.
        both_tty = _isatty(sys.stdout) and _isatty(self.stream)
        self._live = Live(console=self.console, get_renderable=self._render, refresh_per_second=8,
                          transient=True, redirect_stdout=both_tty, redirect_stderr=both_tty)
        self._live.start()

    def step_finishing(self, step: int, trace: Trace) -> None:
        self._finishing = True

    def _stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        self._trace = None

    def step_end(self, step: int, trace: Trace, path: str | None) -> None:
        self._stop()
        stopped = f" [yellow]({why_stopped(trace)})[/]" if why_stopped(trace) else ""
        status = "" if trace.status == "ok" else f" [red]{trace.status}[/]"
        self.console.print(f"[green]✓[/] gradtrace: step {step} traced: {_facts(trace)}{stopped}{status}",
                           highlight=False)

    def step_discarded(self, step: int) -> None:
        self._stop()

    def step_skipped(self, step: int, reason: str) -> None:
        self._stop()
        self.console.print(f"[yellow]gradtrace: step {step} not traced: {reason}[/]", highlight=False, markup=True)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress_for(stream: TextIO, enabled: bool = True) -> StepObserver:
    if not enabled:
        return StepObserver()
    return LiveProgress(stream) if _isatty(stream) else PlainProgress(stream)


# ---- the command ------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def _size(text: str) -> int:
    """``--max-bytes 50M``: bytes with an optional k/M/G/T suffix (powers of 1000)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (write e.g. 50000000, 50M or 2G)")
    return int(float(m.group(1)) * 1000 ** " kmgt".index(m.group(2).lower() or " "))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", metavar="STEPS",
                   help="optimizer steps to trace, counting from 0: '3', '10,40', '100-105', '500-' "
                        "(default: 0 unless --every is given)")
    p.add_argument("--every", type=int, metavar="N", help="trace steps 0, N, 2N, ...")
    p.add_argument("--step-on", choices=STEP_ON, default="optimizer",
                   help="what ends a step: each optimizer.step() (default), or each backward pass, for loops "
                        "that update the parameters without an optimizer")
    p.add_argument("-o", "--out", metavar="PATH",
                   help="trace file (default: the program's name + .gtrace; .gz compresses)")
    p.add_argument("--hash", choices=("md5", "fast", "none"), default="md5",
                   help="tensor checksums: exact md5 (default), fast on-device fingerprints, or none")
    p.add_argument("--optimizer-ops", action="store_true",
                   help="record every op inside optimizer.step() (default: each step is one call)")
    p.add_argument("--node-runs", action="store_true",
                   help="with --hash none: still record every grad node's run in backward (the engine's order, "
                        "each gradient named; default: only accumulators' and custom Functions')")
    p.add_argument("--optimizer-state", action="store_true",
                   help="with --hash none: still record the optimizer state (exp_avg, ...) as each step's inputs "
                        "and outputs (default: only with checksums)")
    p.add_argument("--keep-values", action="append", metavar="PATTERN",
                   help="also keep the values of the tensors whose name or module path matches this glob "
                        "(repeatable; 'params' keeps every parameter and buffer), for element-wise diffs")
    p.add_argument("--keep-values-bytes", type=_size, metavar="SIZE",
                   help="at most SIZE bytes of kept values per traced step (default 64 MiB; beyond it, a note)")
    p.add_argument("--report", action="store_true", help="also write the HTML report of each traced step")
    p.add_argument("--per-step-files", action="store_true",
                   help="one file per step (run.step10.gtrace) instead of all steps in one file")
    p.add_argument("--max-calls", type=int, metavar="N", help="stop recording after N calls in all (the trace says so)")
    p.add_argument("--max-bytes", type=_size, metavar="SIZE",
                   help="stop recording when the traces reach about SIZE bytes (50M, 2G)")
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
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE [ARGS]",
                   help="run a module as `python -m` does; everything after it goes to the module")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py [ARGS]",
                   help="the script, then its own arguments")


def run_command(args: argparse.Namespace) -> int:
    """Run the program with the chosen steps traced; its exit status. A bad option is a
    ``TraceError``, which ``export.cli.main`` prints as one line (exit status 2)."""
    program = program_from_args(args)
    if args.check_determinism:
        return check_program(program, args)
    steplog.check_log(args)
    if args.watch:
        return _run_watched(program, args)
    if args.log is not None and args.steps is None and args.every is None:  # the log alone: no step traced
        with steplog.logged(args, program):
            return execute(program, contextlib.nullcontext())
    out = args.out or f"{program.stem}.gtrace"
    check_output(out, option="--out")  # before the program runs, not after its work is done
    steps = args.steps if args.steps is not None or args.every is not None else "0"
    progress = progress_for(sys.stderr, enabled=not args.no_progress)
    patterns = args.keep_values or []
    if "params" in patterns and len(patterns) > 1:
        raise UserError("--keep-values params keeps every parameter and buffer: give it alone, or patterns")
    keep: bool | list[str] = True if patterns == ["params"] else patterns
    st: StepTrace = trace(hash=args.hash, out=out, max_calls=args.max_calls, max_bytes=args.max_bytes,
                          optimizer_ops=args.optimizer_ops, node_runs=True if args.node_runs else None,
                          optimizer_state=True if args.optimizer_state else None, steps=steps, every=args.every,
                          keep_values=keep, keep_values_bytes=args.keep_values_bytes or DEFAULT_KEEP_VALUES_BYTES,
                          per_step_files=args.per_step_files, observer=progress, step_on=args.step_on)
    # Before the program starts: a second run writing the same file (another learning rate
    # launched beside this one) refuses here, one line, exit status 2 (OutputInUse, an OSError).
    st.claim_output()
    # The step trace's hint that no optimizer stepped is said once, by _conclude, as a plain line.
    warnings.filterwarnings("ignore", message=r"gradtrace: no optimizer\.step\(\) ran", category=RuntimeWarning)
    with steplog.logged(args, program):
        code = execute(program, st)
    _conclude(st, program, args, progress, code)
    return code


def _run_watched(program: Program, args: argparse.Namespace) -> int:
    """``--watch``: run the program with its watches collected; then what they saw."""
    chosen = [flag for flag, given in (("--steps", args.steps is not None), ("--every", args.every is not None),
                                       ("--out", args.out is not None), ("--report", args.report),
                                       ("--per-step-files", args.per_step_files)) if given]
    if chosen:
        raise UserError(f"--watch traces only the steps that trip, where the program's watch says: "
                        f"drop {', '.join(chosen)} (give out= to tracer.watch)")
    run = WatchedRun(report=html)
    with steplog.logged(args, program):
        code = execute(program, run)
    err = sys.stderr
    if not run.watches:
        print(f"gradtrace: {program.target} created no watch, so nothing was watched: decorate its step function "
              "with @tracer.watch(model, optimizer), or give its Trainer "
              "tracer.integrations.hf.WatchCallback() / tracer.integrations.lightning.WatchCallback()", file=err)
        return code
    for w in run.watches:
        print(w.status(), file=err)
        for incident in w.incidents:
            where = incident.path or "kept in memory"
            report = f", report -> {incident.report}" if incident.report else ""
            print(f"gradtrace: step {incident.step} tripped ({incident.reason}) -> {where}{report}", file=err)
    return code


def _conclude(st: StepTrace, program: Program, args: argparse.Namespace, progress: StepObserver,
              code: int) -> None:
    """Say what was written and what to run next (stderr: the program's stdout stays its own).
    ``code``: the program's exit status (a program that failed gets no hint on counting steps)."""
    err = sys.stderr
    name = program.target
    if not st.steps:
        hint = "; no optimizer.step() ran: --step-on backward counts backward passes" \
            if st.step == 0 and st.step_on == "optimizer" and code == 0 else ""
        print(f"gradtrace: no step of {name} was traced (chosen: {st.selection}; the program reached "
              f"step {st.step}{hint})", file=err)
        return
    files = st.paths
    size = sum(os.path.getsize(p) for p in files if os.path.exists(p))
    listed = ", ".join(map(str, st.steps))
    where = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]} ...)"
    print(f"gradtrace: traced step{'s' if len(st.steps) > 1 else ''} {listed} of {name} -> {where} "
          f"({format_size(size)})", file=err)
    if st.hint is not None:
        print(f"gradtrace: {st.hint}", file=err)
    reports = _reports(st, progress) if args.report else []
    for r in reports:
        print(f"gradtrace: report -> {r}", file=err)
    first = files[0]
    print(f"next: gradtrace summary {first}" + ("" if reports else f"   (or: gradtrace report {first})"), file=err)


def _reports(st: StepTrace, progress: StepObserver) -> list[str]:
    """One self-contained HTML page per traced step, beside its trace file."""
    written = []
    console = getattr(progress, "console", None)
    for path in st.paths:
        traces = load_steps(path)
        for step, t in traces.items():
            page = default_output(path)
            if len(traces) > 1:  # several steps in one file: a page each
                page = with_tag(page, f"step{step}")
            if console is not None:
                with console.status(f"gradtrace: writing {page}", spinner="dots"):
                    html(t, page)
            else:
                html(t, page)
            written.append(page)
    return written


COMMAND = Command(
    "run", help="run a Python program unchanged and trace chosen training steps",
    description="Run a script (or -m module) as python would, tracing the chosen optimizer steps. "
                "gradtrace's options go before the program, the program's own arguments after it.",
    usage="gradtrace run [options] script.py [args ...]\n       gradtrace run [options] -m module [args ...]",
    epilog="examples:\n"
           "  gradtrace run train.py --lr 3e-4                   optimizer step 0 -> train.gtrace\n"
           "  gradtrace run --steps 100,200 --report train.py    two steps, and an HTML report of each\n"
           "  gradtrace run --every 500 -o run.gtrace.gz -m pkg.train --config big.yaml\n"
           "  gradtrace run --watch train.py                     the program's tracer.watch, with reports\n"
           "  gradtrace run --log run.gtsteps train.py           a step log of every step (for gradtrace bisect)",
    arguments=add_arguments, run=run_command)
