"""The ``gradtrace`` command line (``main``); one module per command, argparse in ``main`` only.

Nothing outside this package imports it: the library (``export``) raises ``export.errors``
errors, and ``main`` turns them into exit statuses.
"""

from export.cli.main import main

__all__ = ["main"]
