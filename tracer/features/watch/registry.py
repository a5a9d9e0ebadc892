"""The watches of a program run by ``gradtrace run --watch``, which reports on them when the
program ends; and who writes an incident's HTML report. Recording code does not import the report
side: the writer comes from the command line (``collect(report=...)``) or, by default, from the
``gradtrace.report_writers`` entry point that gradtrace's own ``export`` package declares
(pyproject.toml): a plug-in found by name at the first incident, never an import of ``export``."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any

ENTRY_POINTS = "gradtrace.report_writers"

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


def html_writer() -> Callable[[Any, str], object] | None:
    """The writer of an incident's HTML report: the command line's, else the ``html`` plug-in of
    the ``gradtrace.report_writers`` entry points when it is gradtrace's own (a program's module
    named ``export`` is not); None when neither is there (the incident says how to make one)."""
    if default_report is not None:
        return default_report
    try:
        found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS) if ep.name == "html"]
        writer = found[0].load() if found else None
    except Exception:  # a broken install or a shadowing module: no report, the trace is saved anyway
        return None
    package = sys.modules.get(getattr(writer, "__module__", "").split(".")[0])
    if writer is None or getattr(package, "__gradtrace__", None) != "export":
        return None
    return writer


def stop() -> None:
    global _collected, default_report
    _collected = None
    default_report = None
