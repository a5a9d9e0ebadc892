"""Checking an output path before any work starts: its directory exists and is writable, it is
not a directory, and it is not one of the command's own input traces (``report x.gtrace -o
x.gtrace`` would destroy the input). Every failure is a ``UserError``: one line, exit status 2."""

from __future__ import annotations

import os
from collections.abc import Sequence

from export.errors import UserError
from export.text import inert


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def check_output(path: str, inputs: Sequence[str] = (), *, option: str = "-o") -> None:
    """Refuse ``path`` (given with ``option``) as an output unless it can be written and is none of
    ``inputs``."""
    shown = inert(path)
    if not path:
        raise UserError(f"{option}: an empty output path")
    for inp in inputs:
        if _same_file(path, inp):
            raise UserError(f"{option} {shown} is the input trace {inert(inp)}; writing it would destroy "
                            "the input: choose another output")
    if os.path.isdir(path):
        raise UserError(f"{option} {shown} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"cannot write {shown}: directory {inert(parent)} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UserError(f"cannot write {shown}: permission denied")
    if not os.path.exists(path) and not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {shown}: no permission to create files in {inert(parent)}")


__all__ = ["check_output"]
