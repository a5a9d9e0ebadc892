"""A progress bar for a command's long work (loading a large trace, rendering it), on stderr.

Shown only where someone watches: when stderr is a terminal, or when ``GRADTRACE_PROGRESS=1``
forces it (``0`` turns it off everywhere). Piped or redirected, a command writes no progress
text at all, so logs and ``2>err.txt`` stay clean. The bar counts the command's stages (load,
render, write) and is transient: it disappears when the command ends, leaving only its output.

    with Stages(["load", "render"]) as stages:
        stages.next("loading step.gtrace (32 MB)")
        trace = load_trace(path)
        stages.next("writing step.html")
        ...
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from tracer.analysis.terminal import progress_console
from tracer.model.display import format_size


def describe_load(path: str) -> str:
    """``loading step.gtrace (32.1 MB)``: the file's name (a bar has one line), and its size."""
    try:
        size = f" ({format_size(os.path.getsize(path))})"
    except OSError:
        size = ""
    return f"loading {os.path.basename(path)}{size}"


def describe_write(verb: str, path: str) -> str:
    """``writing step.html``."""
    return f"{verb} {os.path.basename(path)}"


class Stages:
    """A transient bar over a command's stages; does nothing without a console."""

    def __init__(self, stages: Sequence[str], console: Console | None = None) -> None:
        self.total = len(stages)
        self.console = progress_console() if console is None else console
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.done = -1

    def __enter__(self) -> Stages:
        if self.console is not None:
            self.progress = Progress(SpinnerColumn(), TextColumn("gradtrace: {task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(), console=self.console,
                                     transient=True)
            self.progress.start()
            self.task = self.progress.add_task("starting", total=self.total)
        return self

    def next(self, description: str) -> None:
        """Start the next stage (the previous one is complete)."""
        self.done += 1
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, description=description, completed=self.done)
            self.progress.refresh()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=self.total)
            self.progress.stop()
