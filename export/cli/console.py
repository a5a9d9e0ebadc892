"""The console the commands print on: rich on a terminal, plain text 120 columns wide when piped."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

PLAIN_WIDTH = 120


class _StdoutConsole(Console):
    """rich's Console exits with status 1 when stdout's reader goes away (``| head``); gradtrace
    raises BrokenPipeError instead, so ``export.cli.main`` keeps the command's own status."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def make_console(**options: Any) -> Console:
    """A console on stdout: rich on a terminal, plain and 120 columns wide when piped."""
    tty = sys.stdout.isatty()
    kwargs: dict[str, Any] = {"file": sys.stdout, "width": None if tty else PLAIN_WIDTH, "highlight": False,
                              "soft_wrap": False, **options}
    return _StdoutConsole(**kwargs)
