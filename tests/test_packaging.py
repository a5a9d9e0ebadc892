"""The user install: the wheel README's ``pip wheel --no-deps . -w dist`` builds holds every
module and asset of gradtrace, the ``gradtrace`` command it declares (a listed package once
went missing, and the installed command failed at import) and the license; and gradtrace runs
without numpy, which its dependencies leave out."""

from __future__ import annotations

import hashlib
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
    for name in ("pyproject.toml", "README.md", "LICENSE"):
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
        metadata = zf.read("gradtrace-0.1.0.dist-info/METADATA").decode()
        # setuptools 77 and later put license files under licenses/, older ones beside METADATA
        (license_name,) = {"gradtrace-0.1.0.dist-info/licenses/LICENSE", "gradtrace-0.1.0.dist-info/LICENSE"} & names
        shipped_license = zf.read(license_name)
    shipped = _shipped_files()
    assert len(shipped) > 100 and "tracer/features/watch/core.py" in shipped
    assert sorted(shipped - names) == []
    assert sorted(n for n in names if not n.startswith("gradtrace-0.1.0.dist-info/")) == sorted(shipped)
    assert "[console_scripts]\ngradtrace = export.cli:main" in entry_points
    with open(os.path.join(ROOT, "LICENSE"), "rb") as fh:
        assert shipped_license == fh.read()
    assert "License: Apache-2.0" in metadata.splitlines() or "License-Expression: Apache-2.0" in metadata.splitlines()


def test_the_license_is_the_apache_2_0_text_pyproject_declares():
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as fh:
        text = fh.read()
    # The standard text, as apache.org serves it (LICENSE-2.0.txt)
    assert hashlib.md5(text.encode()).hexdigest() == "3b83ef96387f14655fc854ddc3c6bd57"
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as fh:
        assert 'license = { text = "Apache-2.0" }' in fh.read().splitlines()


# Tracing, saving, loading and the reports with numpy unimportable: torch's wheels leave numpy
# out, and gradtrace needs none of it (torch alone warns at import: README says to install it).
WITHOUT_NUMPY = """\
import sys, warnings
sys.modules["numpy"] = None
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch, export, tracer
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 1))
opt = torch.optim.AdamW(model.parameters())
with tracer.trace(memory=True, keep_values=True) as t:
    model(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step()
t.save("step.gtrace")
loaded = tracer.load("step.gtrace")
assert loaded["0.weight@grad"].md5 == tracer.md5_of(model[0].weight.grad)
print(export.html(loaded, "step.html"), len(export.dot(loaded)) > 0, export.diff(loaded, t).equal)
"""


def test_gradtrace_runs_without_numpy(tmp_path):
    proc = subprocess.run([sys.executable, "-c", WITHOUT_NUMPY], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[1:] == ["True", "True"] and int(proc.stdout.split()[0]) > 0
    assert "numpy" not in proc.stderr.lower()
