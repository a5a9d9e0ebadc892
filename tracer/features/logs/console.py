"""The ``gradtrace`` logger's console handler: aligned columns, colour on a terminal, plain text
otherwise, indentation by module depth and custom-Function nesting."""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

from rich.console import Console
from rich.text import Text

from tracer.features.logs.levels import ROOT
from tracer.features.logs.lines import LogLine

# ---- the console handler -----------------------------------------------------------------------------
_STYLES = {"fwd": "cyan", "bwd>": "magenta", "bwd<": "magenta", "bwd": "magenta", "name": "bold",
           "api": "blue", "module": "green", "tensor": "", "shape": "yellow", "hash": "dim",
           "stats": "dim cyan", "bad": "bold red", "values": "", "dim": "dim", "": ""}


class ConsoleHandler(logging.Handler):
    """Aligned, coloured lines on a terminal, the same columns without colour elsewhere.

    Columns: tag (``fwd``, ``bwd>``, ``bwd<``), name indented by module depth and custom-Function
    nesting, API, ``[module path]``, details. Column widths grow to the widest value seen, so
    lines stay aligned. ``stream`` defaults to ``sys.stderr`` at the time of each line; ``width``
    wraps details under their column (default: the terminal's width, no wrapping elsewhere);
    ``color`` forces colour on or off (default: only on a terminal).
    """

    def __init__(self, stream: IO[str] | None = None, width: int | None = None, color: bool | None = None,
                 level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.stream = stream
        self.width = width
        self.color = color
        self.widths = [4, 28, 14, 0]
        self._console: Any = None
        self._console_stream: Any = None

    def _get_console(self) -> Any:
        stream = self.stream if self.stream is not None else sys.stderr
        if self._console is None or self._console_stream is not stream:
            kwargs: dict[str, Any] = {"file": stream, "highlight": False, "markup": False, "emoji": False}
            if self.color is False:
                kwargs["color_system"] = None
            elif self.color:
                kwargs["force_terminal"] = True
            if self.width is not None:
                kwargs["width"] = self.width
            self._console = Console(**kwargs)
            self._console_stream = stream
        return self._console

    def render(self, line: LogLine, console: Any) -> list[Any]:
        """The line as rich ``Text`` lines (the first, then wrapped continuations)."""
        cols = [line.tag, "  " * line.indent + line.name, line.api, f"[{line.module}]" if line.module else ""]
        for i, c in enumerate(cols):
            self.widths[i] = max(self.widths[i], len(c))
        prefix = Text()
        styles = [_STYLES.get(line.tag, ""), "name", "api", "module"]
        for i, c in enumerate(cols):
            if not self.widths[i]:
                continue
            prefix.append(c, style=_STYLES.get(styles[i], styles[i]) or None)
            prefix.append(" " * (self.widths[i] - len(c) + 1))
        detail = Text()
        for text, style in line.detail:
            detail.append(text, style=_STYLES.get(style) or None)
        width = self.width if self.width is not None else (console.width if console.is_terminal else None)
        avail = (width - len(prefix)) if width is not None else 0
        if not line.detail or width is None or avail < 24 or len(detail) <= avail:
            out = prefix + detail
            out.rstrip()
            return [out]
        wrapped = detail.wrap(console, avail, overflow="fold")
        lines = []
        for k, part in enumerate(wrapped):
            head = prefix if k == 0 else Text(" " * len(prefix))
            row = head + part
            row.rstrip()
            lines.append(row)
        return lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            console = self._get_console()
            line = getattr(record, "gradtrace", None)
            if isinstance(line, LogLine):
                rows = self.render(line, console)
            else:
                rows = [Text(f"{record.levelname.lower()} {record.name}: {record.getMessage()}")]
            for row in rows:
                console.print(row, soft_wrap=True)
        except Exception:
            self.handleError(record)


def configure_console(enabled: bool = True, *, stream: IO[str] | None = None, width: int | None = None,
                      color: bool | None = None) -> ConsoleHandler | None:
    """Replace gradtrace's console handler (or remove it: records then propagate to the root logger)."""
    lg = logging.getLogger(ROOT)
    for h in [h for h in lg.handlers if isinstance(h, ConsoleHandler)]:
        lg.removeHandler(h)
    if not enabled:
        lg.propagate = True
        return None
    handler = ConsoleHandler(stream=stream, width=width, color=color)
    lg.addHandler(handler)
    lg.propagate = False
    return handler
