"""The ``gradtrace`` command line (``main``); one module per command, argparse in ``main`` only.

Nothing outside this package imports it: the library (``export``) raises ``export.errors``
errors, and ``main`` turns them into exit statuses.
"""

from export.cli.main import main
from export.errors import (
    UserError,  # tracer.loops.program's own `gradtrace run` half still imports it from here
)

__all__ = ["UserError", "main"]
