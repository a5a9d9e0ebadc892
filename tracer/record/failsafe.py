"""What happens when gradtrace's own code fails while it records: the user's program must not.

The recorder runs inside the user's torch calls, module calls, autograd hooks and optimizer
steps. An exception from its bookkeeping there (a fault of gradtrace, met on a model or recipe
it did not foresee) would otherwise surface as the user's training crashing. Instead the
recorder stops recording, the trace keeps what it recorded before (with a note saying where
gradtrace failed), and the program goes on untraced. Exceptions gradtrace raises on purpose
(``tracer.options.RaisedOnPurpose``: ``raise_on_nonfinite``, a tripped watch, a misuse) pass on,
as does everything under ``GRADTRACE_STRICT=1`` (gradtrace's own tests set it, so that a fault
fails them instead of leaving a note)."""

from __future__ import annotations

import os
import traceback

from tracer.options import RaisedOnPurpose

STRICT_ENV = "GRADTRACE_STRICT"
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def passes_on(exc: BaseException) -> bool:
    """Whether an exception raised by the recorder's code goes on to the user's program."""
    return isinstance(exc, RaisedOnPurpose) or os.environ.get(STRICT_ENV, "") not in ("", "0")


def failure_note(exc: BaseException) -> str:
    """The trace's note for a failure of the recorder: what failed, and the innermost line of
    gradtrace's code it failed at (for a report)."""
    where = "?"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.startswith(_OWN_DIR):
            where = f"{os.path.relpath(frame.filename, os.path.dirname(_OWN_DIR.rstrip(os.sep)))}:{frame.lineno} ({frame.name})"
            break
    message = str(exc).splitlines()[0][:200] if str(exc) else ""
    return (f"recording stopped: gradtrace failed while recording ({type(exc).__name__}: {message} at {where}); "
            "the program went on, untraced from there, and the trace holds what was recorded before. "
            "This is a fault of gradtrace: please report it with this note")
