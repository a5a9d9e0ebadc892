"""Where a progress bar is drawn: on stderr, and only where someone watches.

Shown when stderr is a terminal, or when ``GRADTRACE_PROGRESS=1`` forces it; ``0`` turns every
bar off. Piped or redirected, nothing is drawn, so logs and ``2>err.txt`` stay clean. The command
line's bars (``export.cli.progress``) and the end of a traced block's
(``tracer.record.end_progress``) follow this one rule.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

PROGRESS_ENV = "GRADTRACE_PROGRESS"  # "1": always show the bar; "0": never; unset: on a terminal


def progress_console() -> Console | None:
    """The console a bar draws on (stderr), or None where no bar is shown."""
    setting = os.environ.get(PROGRESS_ENV, "").strip()
    if setting == "0":
        return None
    if setting == "1":
        return Console(file=sys.stderr, force_terminal=True)
    console = Console(file=sys.stderr)
    return console if console.is_terminal else None


__all__ = ["PROGRESS_ENV", "progress_console"]
