"""Loading a trace for a report: ``tracer.load`` with its warnings kept as text.

A truncated file loads with a warning; reports show it as a note (``load_with_notes``) or as
one ``gradtrace: warning:`` line on stderr (``load_trace``, the commands) instead of a Python
warning with a source line.
"""

from __future__ import annotations

import os
import sys
import warnings

from tracer.model import Trace, load


def load_with_notes(path: str | os.PathLike[str]) -> tuple[Trace, list[str]]:
    """The trace and the messages of every warning raised while loading it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = load(path)
    return trace, [str(w.message) for w in caught]


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """``tracer.load`` with its truncation warning turned into one line on stderr."""
    trace, notes = load_with_notes(path)
    for note in notes:
        print(f"gradtrace: warning: {note}", file=sys.stderr)
    return trace


__all__ = ["load_trace", "load_with_notes"]
