"""A program's own ``export.py`` / ``tracer.py`` beside gradtrace's packages of those names.

``gradtrace run`` gives the program its own modules, as ``python`` would (YOLOv5 ships an
``export.py``), while gradtrace keeps its own; a foreign ``tracer`` or ``export`` that stands in
for gradtrace's where gradtrace imports it fails at once, naming both paths. Real processes: what
is on ``sys.path`` is the point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from export import companion
from export.cli import main
from tests.watch_models import WATCHED as WATCHED_LOOP
from tracer.model import load_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# YOLOv5's export.py in spirit: a module of the project, nothing to do with gradtrace.
USER_EXPORT = textwrap.dedent('''\
    """Export a YOLOv5 model to other formats."""
    FORMATS = ["torchscript", "onnx"]


    def run(weights="yolov5s.pt", include=("torchscript",)):
        return f"exported {weights} to {', '.join(include)}"
    ''')

TRAIN = textwrap.dedent("""\
    import export
    import torch
    print("export", export.__file__, export.run(include=export.FORMATS))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    """)


def _launcher(tmp_path: Path) -> str:
    """What pip's ``gradtrace`` console script does, from a directory of its own (sys.path[0])."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "gradtrace"
    exe.write_text("import sys\nfrom export.cli import main\nsys.exit(main())\n")
    return str(exe)


def _proc(argv: list[str], cwd: Path, pythonpath: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*(pythonpath or []), ROOT])}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def yolo(tmp_path: Path) -> Path:
    project = tmp_path / "yolov5"
    project.mkdir()
    (project / "export.py").write_text(USER_EXPORT)
    (project / "train.py").write_text(TRAIN)
    return project


def test_run_gives_the_script_its_own_export_py_and_writes_the_trace_and_report(yolo, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    p = _proc([sys.executable, _launcher(tmp_path), "run", "--no-progress", "--report", str(yolo / "train.py")],
              cwd=work)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"export {yolo / 'export.py'} exported yolov5s.pt to torchscript, onnx\n"
    assert p.stderr.splitlines()[1:] == ["gradtrace: report -> train.html", "next: gradtrace summary train.gtrace"]
    steps = load_steps(str(work / "train.gtrace"))
    assert list(steps) == [0] and steps[0].status == "ok" and len(steps[0].backward_runs) == 1
    assert [c.name for c in steps[0].calls][-4:] == ["ones0", "linear0", "sum0", "SGD0"]
    assert (work / "train.html").read_text().startswith("<!DOCTYPE html>")


def test_python_m_tracer_run_from_the_scripts_directory(yolo):
    # `python -m` puts the working directory, with its export.py, first on sys.path
    p = _proc([sys.executable, "-m", "tracer", "run", "--no-progress", "train.py"], cwd=yolo)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"export {yolo / 'export.py'} exported yolov5s.pt")
    assert list(load_steps(str(yolo / "train.gtrace"))) == [0]
    p = _proc([sys.executable, "-m", "tracer", "summary", "train.gtrace"], cwd=yolo)
    assert p.returncode == 0 and "1 backward run" in p.stdout, p.stderr


def test_a_tracer_package_of_the_programs_own_and_its_traceback(tmp_path):
    """The program's `tracer/` package (with a `model` submodule, a name gradtrace's tracer has
    too) is the program's; an error raised in it keeps its frames in the traceback."""
    project = tmp_path / "proj"
    (project / "tracer").mkdir(parents=True)
    (project / "tracer" / "__init__.py").write_text("from tracer.model import build\n")
    (project / "tracer" / "model.py").write_text(textwrap.dedent("""\
        import torch


        def build(fail):
            if fail:
                raise ValueError("no such model")
            return torch.nn.Linear(4, 2)
        """))
    (project / "export.py").write_text(USER_EXPORT)
    (project / "train.py").write_text(textwrap.dedent("""\
        import sys
        import export
        import tracer
        import torch
        print("tracer", tracer.__file__, "export", export.__file__)
        model = tracer.build("--boom" in sys.argv)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        """))
    work = tmp_path / "work"
    work.mkdir()
    exe = _launcher(tmp_path)
    p = _proc([sys.executable, exe, "run", "--no-progress", str(project / "train.py")], cwd=work)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"tracer {project / 'tracer' / '__init__.py'} export {project / 'export.py'}\n"
    t = load_steps(str(work / "train.gtrace"))[0]
    assert [c.name for c in t.calls] == ["empty0", "empty1", "kaiming_uniform_0", "uniform_0", "ones0", "linear0",
                                         "sum0", "SGD0"]

    p = _proc([sys.executable, exe, "run", "--no-progress", "--out", "boom.gtrace", str(project / "train.py"),
               "--boom"], cwd=work)
    assert p.returncode == 1
    err = p.stderr.splitlines()
    assert f'  File "{project / "tracer" / "model.py"}", line 6, in build' in err
    assert err[err.index("Traceback (most recent call last):") + 1] == f'  File "{project / "train.py"}", line 6, in <module>'
    assert "ValueError: no such model" in err


def test_export_refuses_a_users_tracer_py_naming_both_paths(tmp_path):
    (tmp_path / "tracer.py").write_text("def helper():\n    return 1\n")
    p = _proc([sys.executable, "-c", "import export"], cwd=tmp_path)  # the working directory comes first
    assert p.returncode == 1
    last = p.stderr.splitlines()[-1]
    assert last == (f"ImportError: 'tracer' is not gradtrace's: 'import tracer' found {tmp_path / 'tracer.py'}, "
                    f"which hides gradtrace's tracer package in {os.path.join(ROOT, 'tracer')}. Rename or move "
                    f"{tmp_path / 'tracer.py'} if it is yours (python looks in the script's or the current directory "
                    "and PYTHONPATH first), or, if it is an unrelated installed package, 'pip uninstall tracer' and "
                    "then reinstall gradtrace")


def test_the_command_refuses_an_unrelated_tracer_package_first_on_the_path(tmp_path):
    other = tmp_path / "site" / "tracer"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('"""An unrelated tracing library."""\nfrom tracer import model\n')
    (other / "model.py").write_text("TRACER_MODEL = 1\n")  # it even has a `tracer.model`
    p = _proc([sys.executable, _launcher(tmp_path), "--version"], cwd=tmp_path, pythonpath=[str(tmp_path / "site")])
    assert p.returncode == 1 and p.stdout == ""
    last = p.stderr.splitlines()[-1]
    assert last.startswith(f"ImportError: 'tracer' is not gradtrace's: 'import tracer' found {other / '__init__.py'}, "
                           f"which hides gradtrace's tracer package in {os.path.join(ROOT, 'tracer')}.")


def test_python_m_tracer_loads_gradtraces_export_past_an_unrelated_one(tmp_path):
    other = tmp_path / "site" / "export"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('"""An unrelated export library."""\n')
    p = _proc([sys.executable, "-m", "tracer", "--version"], cwd=tmp_path, pythonpath=[str(tmp_path / "site")])
    assert (p.returncode, p.stdout, p.stderr) == (0, "gradtrace 0.1.0\n", "")


def test_the_command_says_so_when_export_is_not_gradtraces(monkeypatch, capsys):
    """The command line checks both packages: here `export` in sys.modules is another one (pip
    wrote an unrelated package's __init__ over gradtrace's)."""
    foreign = types.ModuleType("export")
    foreign.__file__ = "/site-packages/export/__init__.py"
    monkeypatch.setitem(sys.modules, "export", foreign)
    assert main(["--version"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"gradtrace: error: 'export' is not gradtrace's: 'import export' found "
                   f"/site-packages/export/__init__.py, which hides gradtrace's export package in "
                   f"{os.path.join(companion.ROOT, 'export')}. Rename or move /site-packages/export/__init__.py if it "
                   "is yours (python looks in the script's or the current directory and PYTHONPATH first), or, if it "
                   "is an unrelated installed package, 'pip uninstall export' and then reinstall gradtrace\n")


def test_a_data_directory_named_export_does_not_hide_gradtraces(tmp_path, monkeypatch, capsys):
    """A directory without __init__.py (an `export/` folder of results) is a namespace portion:
    a regular package on the path wins over it (a regular install), a finder after the path's
    does not (an editable install's). Either way the script gets what `python train.py` gives it
    in this environment, and gradtrace's modules stay where they are (in this process)."""
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "best.onnx").write_bytes(b"\0")
    (tmp_path / "train.py").write_text(TRAIN.replace("export.run(include=export.FORMATS)", "''"))
    monkeypatch.chdir(tmp_path)
    with_python = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, check=True).stdout
    own = sys.modules["export"]
    assert main(["run", "--no-progress", "train.py"]) == 0
    assert capsys.readouterr().out == with_python
    assert with_python in (f"export {own.__file__} \n", "export None \n")
    assert sys.modules["export"] is own and list(load_steps("train.gtrace")) == [0]


# The watched loop, in a program that imports its own export.py first.
WATCHED = 'import export\nprint("export", export.__file__)\n' + WATCHED_LOOP


def test_run_watch_beside_an_export_py_writes_the_incident_report(tmp_path, monkeypatch, capsys):
    """The incident's report is written while the program runs, with the program's export.py in
    sys.modules: gradtrace's report writer still is gradtrace's."""
    (tmp_path / "export.py").write_text(USER_EXPORT)
    (tmp_path / "train.py").write_text(WATCHED)
    monkeypatch.chdir(tmp_path)
    own = sys.modules["export"]
    assert main(["run", "--watch", "train.py"]) == 1  # the watch raises at the NaN, as the program chose
    out, err = capsys.readouterr()
    assert out == f"export {tmp_path / 'export.py'}\n"
    assert ("gradtrace: step 3 tripped (the loss is -Inf) -> incident.step3.gtrace, report -> incident.step3.html"
            in err.splitlines())
    assert (tmp_path / "incident.step3.html").read_text().startswith("<!DOCTYPE html>")
    assert sys.modules["export"] is own


# A script that uses gradtrace in its code, beside its own export.py.
USES_GRADTRACE = textwrap.dedent("""\
    import {first}, {second}
    import torch
    with tracer.trace() as t:
        torch.ones(2).sum()
    print("traced", len(t.calls))
    export.html(t, "step.html")
    """)


@pytest.mark.parametrize("order", ["tracer, export", "export, tracer"])
def test_importing_tracer_beside_an_export_py_names_both_files(tmp_path, order):
    (tmp_path / "export.py").write_text(USER_EXPORT)
    first, second = order.split(", ")
    (tmp_path / "train.py").write_text(USES_GRADTRACE.format(first=first, second=second))
    p = _proc([sys.executable, "train.py"], cwd=tmp_path)
    assert p.returncode == 1 and p.stdout == "traced 2\n"
    err = p.stderr.splitlines()
    assert err[0] == (
        f"{tmp_path / 'train.py'}:1: ExportShadowedWarning: 'import export' here finds {tmp_path / 'export.py'}, "
        f"not gradtrace's export package in {os.path.join(ROOT, 'export')}: export.html, export.dot, export.diff "
        "and the other reports are not reachable under that name (an AttributeError when used). Rename or move "
        f"{tmp_path / 'export.py'} to use gradtrace's (python looks in the script's or the current directory and "
        "PYTHONPATH first); if you meant your own, ignore this ('gradtrace report FILE' still writes gradtrace's "
        "reports)")
    assert err[1] == f"  import {order}"
    assert err[-1] == "AttributeError: module 'export' has no attribute 'html'"
    assert sum("ExportShadowedWarning" in line for line in err) == 1


def test_importing_tracer_where_export_is_gradtraces_says_nothing(tmp_path):
    (tmp_path / "train.py").write_text(USES_GRADTRACE.format(first="tracer", second="export"))
    p = _proc([sys.executable, "-W", "error::UserWarning", "train.py"], cwd=tmp_path)
    assert (p.returncode, p.stdout, p.stderr) == (0, "traced 2\n", "")
    assert (tmp_path / "step.html").read_text().startswith("<!DOCTYPE html>")


def test_python_m_tracer_beside_an_export_py_does_not_warn(yolo):
    # python -m tracer loads gradtrace's export from beside tracer whatever the directory holds
    p = _proc([sys.executable, "-m", "tracer", "--version"], cwd=yolo)
    assert (p.returncode, p.stdout, p.stderr) == (0, "gradtrace 0.1.0\n", "")
