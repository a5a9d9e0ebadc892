"""What ``gradtrace run`` does (its arguments are ``export.cli.run``'s): run the program with the
chosen steps traced, show the progress, say what was written.

Running the program (``sys.argv``, ``__main__``, ``sys.path[0]``, the exit status, the traceback)
is ``tracer.loops.program``'s. The program's own output is left alone: everything gradtrace says
goes to stderr, as a live line per traced step on a terminal and as plain lines otherwise. This
module imports torch (through ``tracer.api``): the command line imports it only when ``run`` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import sys
import warnings
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

from export.cli import steplog
from export.cli.determinism import check_program
from export.cli.outputs import check_output
from export.cli.run import trace_options
from export.errors import UserError
from export.html import default_output, html
from tracer.api import trace
from tracer.loops.program import Program, WatchedRun, execute
from tracer.loops.steps import StepObserver, StepTrace
from tracer.model import Trace, load_steps
from tracer.model.display import format_size, plural, with_tag
from tracer.options import TraceOptions


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
    if "writing the trace to" in note:  # (TraceSession._stream_failed: a full disk)
        return "recording stopped: the trace file could not be written, see the warning"
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
    options = trace_options(args)
    options["out"] = out
    st: StepTrace = trace(steps=steps, every=args.every, per_step_files=args.per_step_files, observer=progress,
                          step_on=args.step_on, **options)
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
                                       ("--report", args.report), ("--per-step-files", args.per_step_files)) if given]
    chosen += given_trace_options(args)
    if chosen:
        raise UserError(f"--watch traces only the steps that trip, where the program's watch says: "
                        f"drop {', '.join(chosen)} (give out= and the trace options to tracer.watch)")
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


def given_trace_options(args: argparse.Namespace) -> list[str]:
    """The options of ``tracer.trace`` the command line sets to other than their defaults, as
    its flags (``--memory``, ``--no-stacks``)."""
    given, default = TraceOptions.from_kwargs(**trace_options(args)), TraceOptions()
    changed = [(f.name, getattr(given, f.name)) for f in dataclasses.fields(TraceOptions)
               if getattr(given, f.name) != getattr(default, f.name)]
    return [("--no-" if value is False else "--") + name.replace("_", "-") for name, value in changed]


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


