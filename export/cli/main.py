"""The ``gradtrace`` command line: ``main(argv) -> int``, the only argparse in gradtrace.

Each subcommand is a ``Command`` (name, help, arguments, what it runs) in a module of this
package; ``COMMANDS`` lists them in the order ``--help`` shows them. Errors a user can fix (a
missing or corrupt trace, a bad option) are ``UserError``/``TraceFormatError``/``TraceError``:
one line on stderr and exit status 2, no traceback. So are a file that cannot be read or written
(``OSError``) and a trace too large for memory; anything else is a bug in gradtrace, said on one
line too (``GRADTRACE_DEBUG=1`` shows its traceback). The line is inert text: control characters
from a trace or a path are escaped, so one error is always one line.

No command's definition imports torch (importing it takes seconds): ``--help`` and the commands
on saved files (``summary``, ``diff``, ``bisect``, ...) start without it. The commands that run
a program (``run``, ``demo``) import it when they run (``export.cli.command.deferred``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from export import companion
from export.cli import bisect, demo, diff, dot, memory, report, run, summary
from export.errors import UserError
from export.text import inert
from tracer.model import TraceFormatError
from tracer.options import TraceError
from tracer.version import __version__

# The commands, in the order --help lists them.
COMMANDS = (summary.SUMMARY, summary.SHOW, summary.MD5, demo.COMMAND, dot.COMMAND, report.COMMAND, diff.DIFF,
            run.COMMAND, bisect.COMMAND, memory.COMMAND, diff.DIFF_RANKS)


class _Parser(argparse.ArgumentParser):
    """A bad option is one line on stderr and exit status 2, like every other error."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {inert(message)} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


class _ListedChoices(dict[str, Any]):
    """The subcommands, every one accepted but only the listed ones iterated: argparse names
    the choices in its "invalid choice" message by iterating them, and a hidden command (an
    old spelling) must not be offered there either."""

    def __init__(self, choices: dict[str, Any], hidden: set[str]) -> None:
        super().__init__(choices)
        self.hidden = hidden

    def __iter__(self) -> Iterator[str]:
        return (name for name in super().__iter__() if name not in self.hidden)


def _error(command: str, message: str) -> int:
    print(f"gradtrace {command}: error: {inert(message)}", file=sys.stderr)
    return 2


EXAMPLES = """\
examples:
  gradtrace demo                               trace one step of a bundled tiny GPT, then summarise it
  gradtrace run --steps 100 --report train.py  run your script unchanged, trace optimizer step 100
  gradtrace summary train.gtrace               what a trace holds, and what went wrong in it
  gradtrace show train.gtrace linear3          one call, tensor or grad node, its links and stack
  gradtrace report train.gtrace                the interactive HTML report (train.html)
  gradtrace diff good.gtrace bad.gtrace        the first divergence of two runs
  gradtrace diff --ranks step.rank*.gtrace     the first rank of a data-parallel step to depart
  gradtrace bisect good.gtsteps bad.gtsteps    the first step where two runs part (their step logs)

'gradtrace COMMAND --help' shows a command's options. Documentation: README.md ("Command line")
and docs/api.md (the Python API, gradtrace run) in gradtrace's source; in Python, help(tracer)."""


def _paragraphs(text: str) -> str:
    """A description wrapped to the terminal as argparse would, kept raw so epilogs keep their
    columns (argparse's raw formatter applies to both)."""
    width = max(40, min(shutil.get_terminal_size().columns - 2, 100))
    return "\n\n".join(textwrap.fill(part, width) for part in text.split("\n\n"))


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command."""
    parser = _Parser(
        prog="gradtrace", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paragraphs("Record, render, summarise and diff PyTorch forward/backward traces. Record "
                                "with 'gradtrace run' (a script, unchanged) or tracer.trace() in your code; "
                                "every other command reads a saved .gtrace file."),
        epilog=EXAMPLES)
    parser.add_argument("--version", action="version", version=f"gradtrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        # Options are spelled in full (no prefixes): ``run``'s program takes every argument after
        # the script, and a prefix match would read the program's ``--opt adam`` as gradtrace's
        # ``--optimizer-ops`` (or refuse it as ambiguous) before the program saw it.
        options: dict[str, Any] = {
            "description": _paragraphs(command.description), "usage": command.usage, "epilog": command.epilog,
            "formatter_class": argparse.RawDescriptionHelpFormatter, "allow_abbrev": False}
        if not command.hidden:  # without help= argparse does not list a command
            options["help"] = command.help
        p = sub.add_parser(command.name, **options)
        command.arguments(p)
        p.set_defaults(func=command.run)
    sub.choices = _ListedChoices(sub.choices, {c.name for c in COMMANDS if c.hidden})
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:  # export checked tracer when it was imported; here both, for the command's sake
        for name in ("tracer", "export"):
            companion.check(name)
    except ImportError as exc:
        print(f"gradtrace: error: {inert(str(exc))}", file=sys.stderr)
        return 2
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(words)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is seen below
        return code
    except (UserError, TraceFormatError, TraceError) as exc:
        return _error(args.command, str(exc))
    except BrokenPipeError:
        # `gradtrace diff a b | head -1` closed the pipe: not an error, and the exit status must
        # not depend on the reader. A command whose verdict is known before it prints (diff) puts
        # it in args.exit_code. Python's own flush at exit would fail again: point stdout at
        # /dev/null first.
        _silence_stdout()
        return int(getattr(args, "exit_code", 0))
    except KeyboardInterrupt:
        return 130
    except OSError as exc:  # an output that cannot be written, a disk full, an input gone
        where = f"{exc.filename}: " if exc.filename else ""
        return _error(args.command, f"{where}{exc.strerror or exc}")
    except (MemoryError, RecursionError) as exc:
        return _error(args.command, f"the trace is too large or too deeply nested to process ({type(exc).__name__})")
    except Exception as exc:  # a bug: still one line, with what a report of it needs
        if os.environ.get("GRADTRACE_DEBUG"):
            traceback.print_exc()
        return _error(args.command, f"internal error {type(exc).__name__}: {exc} (a bug in gradtrace; please "
                                    "report it with the trace file; GRADTRACE_DEBUG=1 shows the traceback)")


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (tests capture stdout)
        pass
