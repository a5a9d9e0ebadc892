"""The console the commands print on: rich on a terminal, plain text 120 columns wide when piped.

Everything printed on it is inert text: rich markup and emoji codes are off (a name such as
``[link=https://evil.example]F.linear[/link]`` or ``[/]`` prints as written), and control
characters in what is printed (ESC sequences, a carriage return) are shown as escapes; the
terminal never acts on a string from a trace file.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.text import Text

from export.text import inert_lines

PLAIN_WIDTH = 120


class _StdoutConsole(Console):
    """rich's Console exits with status 1 when stdout's reader goes away (``| head``); gradtrace
    raises BrokenPipeError instead, so ``export.cli.main`` keeps the command's own status."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(inert_lines(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        # The last word on what reaches the terminal: a renderable built from a trace's strings
        # (a table cell, a Text) may still hold control characters. Rich's own control segments
        # (cursor moves) and the line breaks it lays out are kept.
        for seg in super().render(renderable, options):
            if seg.control or seg.text == "\n":
                yield seg
            else:
                yield Segment(inert_lines(seg.text), seg.style, seg.control)


def make_console(**options: Any) -> Console:
    """A console on stdout: rich on a terminal, plain and 120 columns wide when piped."""
    tty = sys.stdout.isatty()
    kwargs: dict[str, Any] = {"file": sys.stdout, "width": None if tty else PLAIN_WIDTH, "highlight": False,
                              "soft_wrap": False, "markup": False, "emoji": False, **options}
    return _StdoutConsole(**kwargs)
