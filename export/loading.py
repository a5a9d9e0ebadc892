"""Loading a trace for a report: ``tracer.load`` with its warnings kept as text.

A truncated file loads with a warning; reports show it as a note or one stderr line instead of
a Python warning with a source line.
"""

from __future__ import annotations

import os
import warnings

from tracer.model import Trace, load


def load_with_notes(path: str | os.PathLike[str]) -> tuple[Trace, list[str]]:
    """The trace and the messages of every warning raised while loading it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = load(path)
    return trace, [str(w.message) for w in caught]
