"""The ``tracer`` package export builds on is gradtrace's own, checked when export is imported.

A module of that name earlier on ``sys.path`` (a user's ``tracer.py`` in the working directory)
or an unrelated PyPI package called ``tracer`` would stand in for gradtrace's and fail later with
an obscure ``AttributeError``; here it fails at once, with one message naming both paths. Each of
gradtrace's two packages carries ``__gradtrace__`` (its own name) for this check; ``tracer``
checks ``export`` the same way where it loads it (``python -m tracer``).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

# This file is export/companion.py: gradtrace's tracer/ and export/ are both in ROOT.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_gradtrace(module: ModuleType, name: str) -> bool:
    return getattr(module, "__gradtrace__", None) == name


def location(module: ModuleType) -> str:
    """Where a module was loaded from: its file, a namespace package's directories."""
    file = getattr(module, "__file__", None)
    if file:
        return str(file)
    path = getattr(module, "__path__", None)
    return ", ".join(map(str, path)) if path else repr(module)


def shadowing_message(name: str, module: ModuleType) -> str:
    found = location(module)
    return (f"'{name}' is not gradtrace's: 'import {name}' found {found}, which hides gradtrace's {name} "
            f"package in {os.path.join(ROOT, name)}. Rename or move {found} if it is yours (python looks "
            f"in the script's or the current directory and PYTHONPATH first), or, if it is an unrelated "
            f"installed package, 'pip uninstall {name}' and then reinstall gradtrace")


def check(name: str) -> None:
    """Raise ``ImportError`` naming both paths if the imported ``name`` is not gradtrace's."""
    module = sys.modules.get(name)
    if module is not None and not is_gradtrace(module, name):
        raise ImportError(shadowing_message(name, module), name=name, path=location(module))


def require_tracer() -> None:
    """Import gradtrace's tracer (its data model, as export does everywhere) and check it."""
    try:
        importlib.import_module("tracer.model")
    except ImportError:
        check("tracer")  # another `tracer` (a plain module has no .model): say so, not "no module"
        raise
    check("tracer")


require_tracer()
