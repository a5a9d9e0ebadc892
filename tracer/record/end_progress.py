"""A progress bar while a traced block's last checksums are computed, where someone watches.

MD5 runs on worker threads while the block runs; what is still queued when the block ends is
waited for in ``__exit__``, which for a step with GBs of tensors takes seconds with nothing on the
screen. Above ``SHOW_FROM_BYTES`` of queued work, a transient ``rich`` bar counts the bytes on
stderr, under the same rule as the command line's bars: shown when stderr is a terminal or
``GRADTRACE_PROGRESS=1``, never with ``GRADTRACE_PROGRESS=0``, nothing when piped. It disappears
when the checksums are done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from tracer.analysis.terminal import progress_console
from tracer.model.display import format_size

SHOW_FROM_BYTES = 256 << 20  # less is done within about a second: no bar


@contextlib.contextmanager
def checksum_progress(queued_bytes: int) -> Iterator[Callable[[int], None] | None]:
    """Yields what to call with each collected job's size, or None where no bar is shown."""
    console = progress_console() if queued_bytes >= SHOW_FROM_BYTES else None
    if console is None:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn  # only when a bar shows

    text = f"gradtrace: checksums of the block's last {format_size(queued_bytes)}"
    with Progress(TextColumn(text), BarColumn(), DownloadColumn(), console=console, transient=True) as bar:
        task = bar.add_task("checksums", total=queued_bytes)
        yield lambda n: bar.advance(task, n)
