"""The documentation names things that exist: every dotted ``tracer.…``/``export.…`` name in the
README and docs/ resolves to a module or an attribute, and every repository path they cite is
there. (The CHANGELOG keeps the old names of what moved, on purpose.)"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tracer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "docs/api.md", "docs/trace-format.md", "docs/architecture.md", "benchmarks/README.md"]
DOTTED = re.compile(r"`((?:tracer|export)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
PATH = re.compile(r"`((?:tracer|export|benchmarks|scripts|docs|examples|tests)/[A-Za-z0-9_/.\-]+\.(?:py|md|html|sh))`")


def _resolve(name: str) -> Any:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def _mentions(pattern: re.Pattern[str]) -> list[tuple[str, int, str]]:
    found = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                found += [(doc, n, m.group(1)) for m in pattern.finditer(line)]
    return found


def test_the_docs_mention_dotted_names() -> None:
    assert len(_mentions(DOTTED)) > 20  # the pattern still finds what it checks


@pytest.mark.parametrize("doc,line,name", _mentions(DOTTED))
def test_dotted_names_in_the_docs_exist(doc: str, line: int, name: str) -> None:
    try:
        _resolve(name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{doc}:{line} names {name}, which does not exist ({exc})")


@pytest.mark.parametrize("doc,line,path", _mentions(PATH))
def test_paths_in_the_docs_exist(doc: str, line: int, path: str) -> None:
    assert os.path.exists(os.path.join(ROOT, path)), f"{doc}:{line} cites {path}, which is not in the repository"


# ---- the README's first screens, run as a new user runs them ------------------------------------------
# Everything above "## Details": the bash lines, the Python snippet and the command table, in order.
FIRST_SCREENS_END = "\n## Details\n"
# Commands the test does not run, each for a reason: they install (the test runs on the installed
# environment) or run this very suite.
NOT_RUN = {"bash scripts/setup.sh": "installs the machine", "bash scripts/test.sh": "runs the test suite",
           "pip install torch numpy": "installs", "pip install .": "installs",
           "pip wheel --no-deps . -w dist": "builds (tests/test_packaging.py)",
           "pip install dist/gradtrace-*.whl": "installs"}
# What each command promises to write, and its exit status (diff: 1 when the runs differ, and
# two learning rates do).
PROMISES: dict[str, tuple[int, tuple[str, ...]]] = {
    "gradtrace demo": (0, ("demo.gtrace", "demo.html")),
    "<python snippet>": (0, ("step.gtrace", "step.html")),
    "gradtrace run --log a.gtsteps examples/train.py --steps 5 --trace-step 2 --out a.gtrace": (0, ("a.gtrace", "a.gtsteps")),
    "gradtrace run --log b.gtsteps examples/train.py --steps 5 --trace-step 2 --out b.gtrace --lr 3e-4":
        (0, ("b.gtrace", "b.gtsteps")),
    "torchrun --nproc-per-node 2 examples/train.py --ddp --steps 5 --trace-step 2 --out ddp.gtrace":
        (0, ("ddp.rank0.gtrace", "ddp.rank1.gtrace")),
    "gradtrace summary step.gtrace": (0, ()),
    "gradtrace show step.gtrace linear3": (0, ()),
    "gradtrace md5 step.gtrace": (0, ()),
    "gradtrace dot step.gtrace -o step.svg": (0, ("step.svg",)),
    "gradtrace report a.gtrace": (0, ("a.html",)),
    "gradtrace diff a.gtrace b.gtrace": (1, ()),
    "gradtrace run --steps 1,3 examples/train.py --lr 3e-4": (0, ("train.gtrace",)),
    "gradtrace memory step.gtrace": (0, ()),
    "gradtrace diff --ranks ddp.rank*.gtrace": (0, ()),
    "gradtrace bisect a.gtsteps b.gtsteps": (1, ()),  # two learning rates: they part at step 0
}


def _first_screens() -> list[str]:
    """The README's commands before "## Details", in order: each bash line (comments off, ``&&``
    split), ``<python snippet>`` for the Python block, each command of the table's first column."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read().split(FIRST_SCREENS_END)[0]
    commands: list[str] = []
    for block in re.finditer(r"^```(\w+)\n(.*?)^```$|^\| `([^`]+)` \|", text, re.M | re.S):
        lang, body, row = block.groups()
        if row is not None:
            commands.append(row.replace("\\|", "|"))
        elif lang == "python":
            commands.append("<python snippet>")
        elif lang == "bash":
            for line in body.splitlines():
                code = re.split(r"\s+#\s", line)[0].strip()
                commands += [c.strip() for c in code.split("&&") if c.strip()]
    return commands


def _python_snippet() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read().split(FIRST_SCREENS_END)[0]
    (snippet,) = re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)
    return str(snippet)


def _shims(bin_dir: Path) -> None:
    """``gradtrace``, ``python`` and ``torchrun`` as a user's install has them, on this interpreter
    and this checkout (PYTHONPATH), whatever is installed."""
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    for name, body in (("gradtrace", "from export.cli import main\nsys.exit(main())\n"),
                       ("torchrun", "from torch.distributed.run import main\nsys.exit(main())\n")):
        (bin_dir / name).write_text(f"#!{sys.executable}\nimport sys\n{body}")
        (bin_dir / name).chmod(0o755)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_docs_give_the_format_version_the_code_writes() -> None:
    """The format's title, its header field and the API's constant say the version written."""
    with open(os.path.join(ROOT, "docs/trace-format.md"), encoding="utf-8") as fh:
        fmt = fh.read()
    with open(os.path.join(ROOT, "docs/api.md"), encoding="utf-8") as fh:
        api = fh.read()
    v = tracer.SCHEMA_VERSION
    assert fmt.startswith(f"# The `.gtrace` file format, version {v}\n")
    assert f"| `version` | int | format version, `{v}` for this document" in fmt
    assert f"- **{v}** (gradtrace" in fmt  # (its entry under Versions)
    assert f"`tracer.SCHEMA_VERSION`: the trace format version this gradtrace writes ({v};" in api


def test_the_first_screens_list_every_command_the_test_runs_or_skips():
    commands = _first_screens()
    run = [c for c in commands if c not in NOT_RUN]
    assert sorted(set(commands) - set(run)) == sorted(NOT_RUN)
    # In the README's order (the demo comes twice, setting up and in the table); a new command
    # needs its promise here.
    assert list(dict.fromkeys(run)) == list(PROMISES) and run.count("gradtrace demo") == 2


@pytest.mark.slow
def test_the_first_screens_work_as_written_in_order_in_a_fresh_checkout(tmp_path):
    """A new user's first ten minutes: every command of the README's first screens, as written and
    in order, in a checkout of its own (the README's files, under git with its .gitignore), exits as
    promised, writes what it promises, and leaves no file git would show as untracked."""
    if shutil.which("dot") is None:
        pytest.skip("needs Graphviz's dot (the table's `gradtrace dot ... -o step.svg`)")
    clone = tmp_path / "gradtrace"
    shutil.copytree(os.path.join(ROOT, "examples"), clone / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, ".gitignore"), clone / ".gitignore")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the checkout"]):
        subprocess.run([*git, *argv], cwd=clone, check=True, capture_output=True)
    (clone / "snippet.py").write_text(_python_snippet())  # what a user pastes into a file of theirs
    _shims(tmp_path / "bin")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": ROOT,
           "PET_MASTER_PORT": str(_free_port())}  # torchrun's --master-port, free on this machine
    for command in _first_screens():
        if command in NOT_RUN:
            continue
        line = "python snippet.py" if command == "<python snippet>" else command
        proc = subprocess.run(["bash", "-c", line], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=600, check=False)
        status, files = PROMISES[command]
        assert proc.returncode == status, f"{command}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        for name in files:
            assert (clone / name).is_file(), f"{command} did not write {name}"
        if command == "<python snippet>":  # the line that made the 4th linear call: the snippet's own
            line_no = next(i for i, code in enumerate(_python_snippet().splitlines(), 1) if "model(x)" in code)
            assert proc.stdout.startswith(f'File "{clone / "snippet.py"}", line {line_no}, in <module>')
    os.remove(clone / "snippet.py")
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone, check=True,
                            capture_output=True, text=True).stdout
    assert status == "", f"following the README leaves files git does not ignore:\n{status}"


def test_parameters_inside_a_reentrant_checkpoint_get_linked_gradients():
    """What the README says of reentrant checkpointing: the region's backward is a nested run
    whose parent is the checkpoint's node, and the parameters inside it get their gradients
    there, named for that run (``1.0.weight@grad#1``), produced by the recomputed calls' nodes,
    with the bytes of ``.grad``."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8),
                                torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)),
                                torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with tracer.trace() as t:
        model[2](checkpoint(model[1], model[0](x), use_reentrant=True)).sum().backward()
    assert [(r.name, r.parent) for r in t.backward_runs] == [
        ("backward0", None), ("backward1", "CheckpointFunction0/CheckpointFunctionBackward")]
    inside = {n: p for n, p in model.named_parameters() if n.startswith("1.")}
    assert sorted(inside) == ["1.0.bias", "1.0.weight", "1.2.bias", "1.2.weight"]
    for name, param in inside.items():
        grad = t[f"{name}@grad#1"]
        assert grad.md5 == tracer.md5_of(param.grad)
        made_by = t[t[grad.producer].call]
        assert made_by.api == "torch.nn.functional.linear" and made_by.phase == "backward"
        assert f"{name}/AccumulateGrad" in t.backward_runs[1].order
