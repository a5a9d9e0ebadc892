"""The ``export`` a program beside gradtrace's ``tracer`` will get, checked when ``tracer`` is imported.

A script next to its own ``export.py`` (YOLOv5 ships one) that does ``import tracer, export``
gets its own module under that name, and ``export.html(...)`` then fails with a bare
``AttributeError: module 'export' has no attribute 'html'``. When ``tracer`` is imported, this
module finds (without importing it) what ``import export`` would give, and when that is not
gradtrace's package it says so once, naming both paths. ``export.companion`` does the same for a
foreign ``tracer``, where it can refuse outright: gradtrace's export cannot work without its tracer,
but gradtrace's tracer works without its export, so here it is a warning.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

# This file is tracer/companion.py: gradtrace's export/ is beside tracer/ in ROOT.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_EXPORT = os.path.join(ROOT, "export", "__init__.py")


class ExportShadowedWarning(UserWarning):
    """``import export`` here finds another module than gradtrace's export package."""


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def foreign_export() -> str | None:
    """Where ``import export`` finds a module that is not gradtrace's export (its file, or a
    namespace package's directories), or None when it finds gradtrace's or nothing."""
    module = sys.modules.get("export")
    if module is not None:
        spec = getattr(module, "__spec__", None)
        origin = getattr(module, "__file__", None) or getattr(spec, "origin", None)
        locations = list(getattr(module, "__path__", None) or [])
    else:
        try:
            spec = importlib.util.find_spec("export")  # a search of the path, nothing is imported
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        origin, locations = spec.origin, list(spec.submodule_search_locations or [])
    if origin and os.path.isfile(origin):
        return None if _same_file(origin, OWN_EXPORT) else origin
    # A namespace package (a directory without __init__.py, e.g. a folder of exported models)
    return ", ".join(map(str, locations)) or None


def shadowed_export_message(found: str) -> str:
    return (f"'import export' here finds {found}, not gradtrace's export package in "
            f"{os.path.dirname(OWN_EXPORT)}: export.html, export.dot, export.diff and the other reports "
            f"are not reachable under that name (an AttributeError when used). Rename or move {found} to use "
            f"gradtrace's (python looks in the script's or the current directory and PYTHONPATH first); if "
            f"you meant your own, ignore this ('gradtrace report FILE' still writes gradtrace's reports)")


def warn_if_export_is_shadowed() -> None:
    """Warn once, at the import of ``tracer``, when ``import export`` would give another module.

    Skipped under ``python -m tracer``, which loads gradtrace's export from beside tracer on purpose
    (``sys.argv[0]`` is ``-m`` while python imports the package to find its ``__main__``)."""
    if sys.argv[:1] == ["-m"]:
        return
    found = foreign_export()
    if found is not None:
        # stacklevel 3: past this function and tracer/__init__.py (the import machinery's own
        # frames are skipped by warnings), at the line of the program that imported tracer.
        warnings.warn(shadowed_export_message(found), ExportShadowedWarning, stacklevel=3)
