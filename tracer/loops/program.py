"""``gradtrace run``: trace chosen steps of an unmodified program, run the way ``python`` runs it.

    gradtrace run --steps 100,200 --report train.py --lr 3e-4
    gradtrace run --every 500 --out run.gtrace -m mypackage.train --config big.yaml

gradtrace's options come before the program, the program's own arguments after it (as with
``python`` itself): ``sys.argv``, ``__name__ == "__main__"``, ``sys.path[0]`` and the exit code
are what ``python script.py`` / ``python -m module`` would give. Steps are counted from
``optimizer.step()`` calls (or ``tracer.step()`` marks in the program); see ``tracer.loops.steps``.
The program's own output is left alone: everything gradtrace says goes to stderr, as a live
line per traced step on a terminal and as plain lines otherwise.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.machinery
import importlib.util
import io
import os
import re
import runpy
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TextIO

from tracer.loops.steps import StepObserver, StepTrace
from tracer.model import Trace
from tracer.options import TraceError, TraceOptions


# ---- the program -------------------------------------------------------------------------------
@dataclass
class Program:
    """What to run: a script path or a module name, and its own arguments."""

    target: str
    is_module: bool
    args: list[str]

    @property
    def stem(self) -> str:
        if self.is_module:
            return self.target.rsplit(".", 1)[-1]
        return os.path.splitext(os.path.basename(self.target))[0] or "trace"


def _program(args: argparse.Namespace) -> Program:
    from export.cli import UserError

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


class _ProgramArgv:
    """``sys.argv`` and ``sys.path[0]`` as python sets them for the program, restored after."""

    def __init__(self, program: Program) -> None:
        self.program = program

    def __enter__(self) -> None:
        self._argv, self._path0 = sys.argv, sys.path[0] if sys.path else None
        p = self.program
        sys.argv = [p.target, *p.args]  # for -m, runpy then sets argv[0] to the module's file
        if p.is_module:
            first = os.getcwd()  # `python -m` puts the working directory first
        elif os.path.isdir(p.target):
            first = os.path.realpath(p.target)
        else:  # the script's own directory, symlinks resolved
            first = os.path.dirname(os.path.realpath(p.target))
        if sys.path:
            sys.path[0] = first
        else:
            sys.path.insert(0, first)

    def __exit__(self, *exc: object) -> None:
        sys.argv = self._argv
        if self._path0 is not None and sys.path:
            sys.path[0] = self._path0


def _execute(program: Program, steps: StepTrace) -> int:
    """Run the program inside the step trace; the exit status python would give."""
    with _ProgramArgv(program):
        try:
            with steps:
                if program.is_module:
                    runpy.run_module(program.target, run_name="__main__", alter_sys=True)
                elif os.path.isfile(program.target) and not _is_zip(program.target):
                    _run_script(program.target)
                else:  # a directory or zip file with __main__.py
                    runpy.run_path(program.target, run_name="__main__")
        except SystemExit as exc:
            return _exit_status(exc)
        except KeyboardInterrupt as exc:
            _print_exception(exc)
            return 130
        except BaseException as exc:
            _print_exception(exc)
            return 1
    return 0


def _is_zip(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


def _run_script(path: str) -> None:
    """Run a script file as ``python path`` does.

    Not ``runpy.run_path``: that sets ``sys.argv[0]`` to the path it is given, while python keeps
    argv[0] as typed and makes ``__file__`` (and so every traceback and traced stack) absolute.
    """
    full = os.path.abspath(path)
    with io.open_code(full) as fh:
        source = fh.read()
    # dont_inherit: this module's `from __future__ import annotations` must not leak into it.
    code = compile(source, full, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=full, __cached__=None, __spec__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", full),
                         __builtins__=builtins)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): python prints it and exits 1
    return 1


def _print_exception(exc: BaseException) -> None:
    """The traceback python would print: from the program's own frame on, without the frames
    of gradtrace's hooks that the exception passed through."""
    frames = []
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    while len(frames) > 1 and (frames[0].tb_frame.f_code.co_filename == __file__
                               or frames[0].tb_frame.f_globals.get("__name__") == "runpy"):
        frames.pop(0)
    kept = [f for f in frames if not str(f.tb_frame.f_globals.get("__name__", "")).startswith("tracer.")] or frames
    rebuilt: TracebackType | None = None
    for f in reversed(kept):
        rebuilt = TracebackType(rebuilt, f.tb_frame, f.tb_lasti, f.tb_lineno)
    sys.stderr.flush()
    exc.__traceback__ = rebuilt  # the default hook prints the exception's own traceback
    sys.excepthook(type(exc), exc, rebuilt)


# ---- progress ------------------------------------------------------------------------------------
def _facts(trace: Trace) -> str:
    return (f"{len(trace.calls):,} calls, {len(trace.grad_nodes):,} grad nodes, "
            f"{len(trace.backward_runs)} backward run{'s' if len(trace.backward_runs) != 1 else ''}")


class PlainProgress(StepObserver):
    """One line per traced or skipped step on a stream (deterministic: for logs, pipes, tests)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def step_end(self, step: int, trace: Trace, path: str | None) -> None:
        stopped = " (recording stopped at a bound)" if any(n.startswith("recording stopped") for n in trace.notes) \
            else ""
        status = "" if trace.status == "ok" else f" [{trace.status}]"
        print(f"gradtrace: step {step} traced: {_facts(trace)}{stopped}{status}", file=self.stream, flush=True)

    def step_skipped(self, step: int, reason: str) -> None:
        print(f"gradtrace: step {step} not traced: {reason}", file=self.stream, flush=True)


class LiveProgress(PlainProgress):
    """A live line while a step is recorded (calls so far, then checksums being finished)."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console

        super().__init__(stream)
        self.console = Console(file=stream, stderr=stream is sys.stderr)
        self._live: Any = None
        self._step = 0
        self._trace: Trace | None = None
        self._finishing = False

    def _render(self) -> Any:
        from rich.spinner import Spinner

        t = self._trace
        facts = f"{len(t.calls):,} calls, {len(t.grad_nodes):,} grad nodes" if t is not None else ""
        what = " · finishing checksums" if self._finishing else ""
        return Spinner("dots", text=f"gradtrace: tracing step {self._step} · {facts}{what}", style="cyan")

    def step_begin(self, step: int, trace: Trace) -> None:
        from rich.live import Live

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
        stopped = " [yellow](recording stopped at a bound)[/]" if any(
            n.startswith("recording stopped") for n in trace.notes) else ""
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


def _human(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB" if n >= 1e3 else f"{n} bytes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", metavar="STEPS",
                   help="optimizer steps to trace, counting from 0: '3', '10,40', '100-105', '500-' "
                        "(default: 0 unless --every is given)")
    p.add_argument("--every", type=int, metavar="N", help="trace steps 0, N, 2N, ...")
    p.add_argument("-o", "--out", metavar="PATH",
                   help="trace file (default: the program's name + .gtrace; .gz compresses)")
    p.add_argument("--hash", choices=("md5", "fast", "none"), default="md5",
                   help="tensor checksums: exact md5 (default), fast on-device fingerprints, or none")
    p.add_argument("--optimizer-ops", action="store_true",
                   help="record every op inside optimizer.step() (default: each step is one call)")
    p.add_argument("--report", action="store_true", help="also write the HTML report of each traced step")
    p.add_argument("--per-step-files", action="store_true",
                   help="one file per step (run.step10.gtrace) instead of all steps in one file")
    p.add_argument("--max-calls", type=int, metavar="N", help="stop recording after N calls in all (the trace says so)")
    p.add_argument("--max-bytes", type=_size, metavar="SIZE",
                   help="stop recording when the traces reach about SIZE bytes (50M, 2G)")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE [ARGS]",
                   help="run a module as `python -m` does; everything after it goes to the module")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py [ARGS]",
                   help="the script, then its own arguments")


_PARSER = {
    "description": "Run a script (or -m module) as python would, tracing the chosen optimizer steps. "
                   "gradtrace's options go before the program, the program's own arguments after it.",
    "usage": "gradtrace run [options] script.py [args ...]\n       gradtrace run [options] -m module [args ...]",
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("run", help="run a Python program unchanged and trace chosen training steps",
                              **_PARSER)
    add_arguments(p)
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from export.cli import UserError

    program = _program(args)
    out = args.out or f"{program.stem}.gtrace"
    steps = args.steps if args.steps is not None or args.every is not None else "0"
    progress = progress_for(sys.stderr, enabled=not args.no_progress)
    try:
        options = TraceOptions(hash=args.hash, out=out, max_calls=args.max_calls, max_bytes=args.max_bytes,
                               optimizer_ops=args.optimizer_ops)
        st = StepTrace(options, steps=steps, every=args.every, per_step_files=args.per_step_files,
                       observer=progress)
    except TraceError as exc:
        raise UserError(str(exc)) from None
    code = _execute(program, st)
    _conclude(st, program, args, progress)
    return code


def _conclude(st: StepTrace, program: Program, args: argparse.Namespace, progress: StepObserver) -> None:
    """Say what was written and what to run next (stderr: the program's stdout stays its own)."""
    err = sys.stderr
    name = program.target
    if not st.steps:
        print(f"gradtrace: no step of {name} was traced (chosen: {st.selection}; the program reached "
              f"step {st.step})", file=err)
        return
    files = st.paths
    size = sum(os.path.getsize(p) for p in files if os.path.exists(p))
    listed = ", ".join(map(str, st.steps))
    where = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]} ...)"
    print(f"gradtrace: traced step{'s' if len(st.steps) > 1 else ''} {listed} of {name} -> {where} "
          f"({_human(size)})", file=err)
    reports = _reports(st, progress) if args.report else []
    for r in reports:
        print(f"gradtrace: report -> {r}", file=err)
    first = files[0]
    print(f"next: gradtrace summary {first}" + ("" if reports else f"   (or: gradtrace report {first})"), file=err)


def _reports(st: StepTrace, progress: StepObserver) -> list[str]:
    """One self-contained HTML page per traced step, beside its trace file."""
    try:
        from export.html import default_output, html
    except ImportError:
        print("gradtrace: --report: the HTML exporter (export.html) is not available", file=sys.stderr)
        return []
    from tracer.model import load_steps

    written = []
    console = getattr(progress, "console", None)
    for path in st.paths:
        traces = load_steps(path)
        for step, trace in traces.items():
            page = default_output(path)
            if len(traces) > 1:  # several steps in one file: a page each
                page = f"{page[: -len('.html')]}.step{step}.html"
            if console is not None:
                with console.status(f"gradtrace: writing {page}", spinner="dots"):
                    html(trace, page)
            else:
                html(trace, page)
            written.append(page)
    return written


def main_run(argv: Sequence[str] | None = None) -> int:
    """``gradtrace run`` on its own (``python -m tracer.loops.program ...``)."""
    from export.cli import UserError

    parser = argparse.ArgumentParser(prog="gradtrace run", **_PARSER)
    add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run_command(args)
    except UserError as exc:
        print(f"gradtrace run: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main_run())
