"""The ``gradtrace`` command line: ``main(argv) -> int``.

Each subcommand lives in the module that does its work and registers itself through a
``register(subparsers)`` function that sets ``func(args) -> int`` as the parser default. Errors a
user can fix (a missing or corrupt trace, a bad option) are ``UserError``/``TraceFormatError``:
one line on stderr and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from export.errors import UserError
from tracer.model import TraceFormatError

# Modules that contribute subcommands, in the order they appear in --help.
COMMAND_MODULES = (
    "export.summary",   # summary, show, md5
    "export.demo",      # demo
    "export.dot",       # dot
    "export.html",      # report
    "export.diff",      # diff
    "tracer.loops.program",       # run
    "export.memory_cli",  # memory
    "export.diff_ranks",  # diff-ranks
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradtrace",
        description="Record, render, summarise and diff PyTorch forward/backward traces.")
    from tracer import __version__

    parser.add_argument("--version", action="version", version=f"gradtrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that exporter is not part of this build
                continue
            raise
        mod.register(sub)
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
    except (UserError, TraceFormatError) as exc:
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


if __name__ == "__main__":
    raise SystemExit(main())
