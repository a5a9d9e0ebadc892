"""The ``gradtrace`` command line: ``main(argv) -> int``, the only argparse in gradtrace.

Each subcommand is a ``Command`` (name, help, arguments, what it runs) in a module of this
package; ``COMMANDS`` lists them in the order ``--help`` shows them. Errors a user can fix (a
missing or corrupt trace, a bad option) are ``UserError``/``TraceFormatError``/``TraceError``:
one line on stderr and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from export.cli import demo, diff, dot, memory, report, run, summary
from export.cli.command import Command
from export.errors import UserError
from tracer.model import TraceFormatError
from tracer.options import TraceError
from tracer.version import __version__

COMMANDS: tuple[Command, ...] = (
    summary.SUMMARY, summary.SHOW, summary.MD5, demo.COMMAND, dot.COMMAND, report.COMMAND, diff.DIFF,
    run.COMMAND, memory.COMMAND, diff.DIFF_RANKS,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradtrace",
        description="Record, render, summarise and diff PyTorch forward/backward traces.")
    parser.add_argument("--version", action="version", version=f"gradtrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.description, usage=command.usage)
        command.arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is seen below
        return code
    except (UserError, TraceFormatError, TraceError) as exc:
        print(f"gradtrace {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `gradtrace diff a b | head -1` closed the pipe: not an error, and the exit status must
        # not depend on the reader. A command whose verdict is known before it prints (diff) puts
        # it in args.exit_code. Python's own flush at exit would fail again: point stdout at
        # /dev/null first.
        _silence_stdout()
        return int(getattr(args, "exit_code", 0))
    except KeyboardInterrupt:
        return 130


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (tests capture stdout)
        pass
