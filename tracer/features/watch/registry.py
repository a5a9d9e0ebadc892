"""The watches of a program run by ``gradtrace run --watch``, which reports on them when the
program ends and sets the writer of the incidents' HTML reports (recording code does not import
the report side; the command line does)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The watches created since collect() (None: nobody is collecting, nothing is kept).
_collected: list[Any] | None = None

# Writes an incident's HTML report, (trace, path) -> None, for watches created without report=.
default_report: Callable[[Any, str], object] | None = None


def add(watch: Any) -> None:
    if _collected is not None:
        _collected.append(watch)


def collect(report: Callable[[Any, str], object] | None = None) -> list[Any]:
    """Keep every watch created from now on in the returned list; ``report`` writes incident
    reports for those created without ``report=``."""
    global _collected, default_report
    _collected = []
    default_report = report
    return _collected


def stop() -> None:
    global _collected, default_report
    _collected = None
    default_report = None
