"""``python -m tracer`` is the ``gradtrace`` command."""

from export.cli import main

raise SystemExit(main())
