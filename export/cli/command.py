"""One ``gradtrace`` subcommand as data: its name, its help, its arguments and what it runs."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from tracer.model.fileformat import parse_size

Run = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    """A subcommand. ``run(args)`` returns the exit status; errors a user can fix are raised as
    ``export.errors.UserError`` (or ``TraceFormatError``/``TraceError``) and ``main`` prints them.

    A command's definition (this object, its arguments) imports no torch, so that ``--help`` and
    the commands on saved files start without it; a command that records runs a ``deferred``
    function, whose module (and torch) is imported when the command runs."""

    name: str
    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Run
    usage: str | None = None
    epilog: str | None = None  # examples, shown as written after the options
    # An old spelling kept working (``diff-ranks`` for ``diff --ranks``): parsed, not listed in --help.
    hidden: bool = False


def deferred(module: str, name: str) -> Run:
    """``module.name(args)``, with ``module`` imported on the first call: what a command that
    imports torch runs (``run``, ``demo``), kept out of the parser that every command builds
    (importing torch takes seconds; ``gradtrace --help`` lists every command)."""

    def run(args: argparse.Namespace) -> int:
        function: Run = getattr(importlib.import_module(module), name)
        return function(args)

    # Named as the function it stands for (a traceback, a test reading args.func).
    run.__module__, run.__name__, run.__qualname__ = module, name, name
    return run


def size(text: str) -> int:
    """A size option's value (``--max-bytes 20M``): ``tracer.model.fileformat.parse_size``'s grammar,
    the one every size gradtrace reads follows (options, ``GRADTRACE_MAX_DECOMPRESSED``)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
