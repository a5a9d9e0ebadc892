"""One ``gradtrace`` subcommand as data: its name, its help, its arguments and what it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """A subcommand. ``run(args)`` returns the exit status; errors a user can fix are raised as
    ``export.errors.UserError`` (or ``TraceFormatError``/``TraceError``) and ``main`` prints them."""

    name: str
    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    usage: str | None = None
    epilog: str | None = None  # examples, shown as written after the options
    # An old spelling kept working (``diff-ranks`` for ``diff --ranks``): parsed, not listed in --help.
    hidden: bool = False
