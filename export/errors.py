"""The errors a user can fix, raised by the library and the commands alike.

The command line (``export.cli``) prints any of them as one line on stderr and exits with
status 2, no traceback; library callers catch them like any exception.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (a missing file, a bad option, an unknown record name)."""


class DiffError(UserError):
    """Two traces that cannot be compared (different hash algorithms or format versions)."""


class RenderError(UserError):
    """Rendering needs Graphviz's ``dot`` program and it is not installed."""


__all__ = ["DiffError", "RenderError", "UserError"]
