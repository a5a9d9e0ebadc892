"""Loading a trace for a report: ``tracer.model.read_trace`` with its warnings kept as text.

A truncated file loads with a warning; reports show it as a note (``load_with_notes``) or as
one ``gradtrace: warning:`` line on stderr (``load_trace``, the commands) instead of a Python
warning with a source line. ``open_trace`` also says which steps the file holds (a file of
several traced steps) and what each one is (``StepInfo``: status, NaN/Inf).

Trace files are untrusted input: the reader validates every field and link and bounds what a
gzip file may decompress to (see ``tracer.model.fileformat`` and SECURITY.md); the notes are
made inert (control characters escaped) before they are printed.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from export.text import inert
from tracer.model import StepInfo, Trace, read_trace


@dataclass
class LoadedTrace:
    """A trace read from a file, the steps the file holds, and the warnings of reading it."""

    path: str
    trace: Trace
    steps: list[StepInfo]
    notes: list[str]

    @property
    def several_steps(self) -> bool:
        return len(self.steps) > 1


# Reading options a command sets for every file read while it runs, also by code that takes
# paths and loads them itself (``diff_ranks``): (step, max_decompressed).
_OPTIONS: ContextVar[tuple[int | None, int | None]] = ContextVar("gradtrace_load_options", default=(None, None))


@contextmanager
def load_options(step: int | None = None, max_decompressed: int | None = None) -> Iterator[None]:
    """Within the block, files are read at step ``step`` with ``max_decompressed`` unless a call
    says otherwise."""
    token = _OPTIONS.set((step, max_decompressed))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def open_trace(path: str | os.PathLike[str], step: int | None = None, *,
               max_decompressed: int | None = None) -> LoadedTrace:
    """The trace of ``path`` (its first step, or step ``step``) with the file's steps and notes."""
    default_step, default_max = _OPTIONS.get()
    step = default_step if step is None else step
    max_decompressed = default_max if max_decompressed is None else max_decompressed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept, steps = read_trace(path, step, max_decompressed=max_decompressed)
    return LoadedTrace(os.fspath(path), kept[0], steps, [str(w.message) for w in caught])


def load_with_notes(path: str | os.PathLike[str], step: int | None = None, *,
                    max_decompressed: int | None = None) -> tuple[Trace, list[str]]:
    """The trace and the messages of every warning raised while loading it."""
    loaded = open_trace(path, step, max_decompressed=max_decompressed)
    return loaded.trace, loaded.notes


def print_notes(notes: list[str]) -> None:
    """Each note as one ``gradtrace: warning:`` line on stderr."""
    for note in notes:
        print(f"gradtrace: warning: {inert(note)}", file=sys.stderr)


def load_trace(path: str | os.PathLike[str], step: int | None = None, *,
               max_decompressed: int | None = None) -> Trace:
    """``tracer.load`` with its truncation warning turned into one line on stderr."""
    trace, notes = load_with_notes(path, step, max_decompressed=max_decompressed)
    print_notes(notes)
    return trace


__all__ = ["LoadedTrace", "load_options", "load_trace", "load_with_notes", "open_trace", "print_notes"]
