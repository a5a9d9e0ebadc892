"""The user install: the wheel README's ``pip wheel --no-deps . -w dist`` builds holds every
module and asset of gradtrace, and the ``gradtrace`` command it declares (a listed package once
went missing, and the installed command failed at import)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shipped_files() -> set[str]:
    """What a user install needs: every module, the assets, the templates, the type markers."""
    out = set()
    for package in ("tracer", "export"):
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, package)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in files:
                if not f.endswith((".pyc", ".pyo")):
                    out.add(os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/"))
    return out


def test_the_wheel_holds_every_module_and_asset_and_the_command(tmp_path):
    source = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside the sources
    source.mkdir()
    for name in ("tracer", "export"):
        shutil.copytree(os.path.join(ROOT, name), source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    dist = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           str(source), "-w", str(dist)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = os.listdir(dist)
    assert wheel == "gradtrace-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(dist / wheel) as zf:
        names = set(zf.namelist())
        entry_points = zf.read("gradtrace-0.1.0.dist-info/entry_points.txt").decode()
    shipped = _shipped_files()
    assert len(shipped) > 100 and "tracer/features/watch/core.py" in shipped
    assert sorted(shipped - names) == []
    assert sorted(n for n in names if not n.startswith("gradtrace-0.1.0.dist-info/")) == sorted(shipped)
    assert "[console_scripts]\ngradtrace = export.cli:main" in entry_points
