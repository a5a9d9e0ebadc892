"""Options of a trace, and the error for their misuse."""

from __future__ import annotations


class TraceError(RuntimeError):
    """Misuse of the tracer (an accidental nested trace, bad options)."""
