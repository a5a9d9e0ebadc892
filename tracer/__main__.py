"""``python -m tracer`` is the ``gradtrace`` command.

``python -m`` puts the working directory first on ``sys.path``: a program's own ``export.py``
there (YOLOv5 ships one) must not stand in for gradtrace's ``export``, so that package is loaded
from beside this one, and checked like ``export`` checks ``tracer`` (``export.companion``).
"""

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

# This file is tracer/__main__.py: gradtrace's export/ is beside tracer/ in ROOT.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_export() -> ModuleType:
    """gradtrace's ``export``, found beside ``tracer`` (unless it is imported already)."""
    if "export" in sys.modules:
        return sys.modules["export"]
    spec = importlib.machinery.PathFinder.find_spec("export", [ROOT])
    if spec is None or spec.loader is None:  # not beside tracer (an unusual install): python's search
        return importlib.import_module("export")
    module = importlib.util.module_from_spec(spec)
    sys.modules["export"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("export", None)
        raise
    return module


def main() -> int:
    export = load_export()
    if getattr(export, "__gradtrace__", None) != "export":
        found = getattr(export, "__file__", None) or repr(export)
        print(f"gradtrace: error: 'export' is not gradtrace's: 'import export' found {found}, which hides "
              f"gradtrace's export package in {os.path.join(ROOT, 'export')}. Rename or move {found} if it is "
              "yours, or, if it is an unrelated installed package, 'pip uninstall export' and then reinstall "
              "gradtrace", file=sys.stderr)
        return 2
    cli = importlib.import_module("export.cli")  # after the check: export is gradtrace's
    return int(cli.main())


if __name__ == "__main__":
    raise SystemExit(main())
