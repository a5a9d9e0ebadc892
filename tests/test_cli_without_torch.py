"""The commands on saved files do not import torch (importing it takes seconds on a small machine):
``summary``, ``show``, ``md5``, ``dot``, ``report``, ``diff``, ``memory``, ``bisect``, and
``--help`` of gradtrace and of every command, ``run`` and ``demo`` included. Each runs in a
process of its own, as ``gradtrace`` runs it (``export.cli.main``), on real saved traces and step
logs of a small training step; what the process imported is read at its end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tracer
from export.cli.main import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What `gradtrace` runs (the console script calls export.cli.main), then which modules that need
# torch were imported: torch itself, and gradtrace's recording side.
RUNNER = """
import json, sys
from export.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # --help and a bad command line exit through argparse
    code = exc.code
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] == "torch" or m.startswith(("tracer.record", "tracer.features", "tracer.api")))
print("RESULT " + json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _step(out: str, seed: int) -> None:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    with tracer.trace(out=out, memory=True):
        model(x).pow(2).mean().backward()
        opt.step()


def _log(out: str, lr: float) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 1))
    opt = torch.optim.SGD([w], lr=lr)
    with tracer.step_log(out, optimizer=opt):
        for x in torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(1)):
            (x @ w).square().mean().backward()
            opt.step()
            opt.zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("saved")
    files = {name: os.fspath(folder / name) for name in ("a.gtrace", "b.gtrace", "a.gtsteps", "b.gtsteps")}
    _step(files["a.gtrace"], 0)
    _step(files["b.gtrace"], 1)
    _log(files["a.gtsteps"], 0.1)
    _log(files["b.gtsteps"], 0.2)
    files["dir"] = os.fspath(folder)
    return files


def _run(words: list[str], cwd: str) -> tuple[int, list[str], str]:
    proc = subprocess.run([sys.executable, "-c", RUNNER, *words], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=120, check=False)
    line = next((ln for ln in proc.stderr.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr
    result = json.loads(line.removeprefix("RESULT "))
    return result["code"], result["heavy"], proc.stdout


# (command line with {a}, {b}, {la}, {lb}, {dir} for the saved files, its exit status, what its output says)
ON_SAVED_FILES = [
    ("summary {a}", 0, "module      Sequential"),
    ("show {a} linear1", 0, "call linear1"),
    ("show {a} linear1/AddmmBackward0", 0, "grad node linear1/AddmmBackward0"),
    ("md5 {a}", 0, "0.weight:"),
    ("dot {a} -o {dir}/a.dot", 0, "a.dot"),
    ("report {a} -o {dir}/a.html", 0, "a.html"),
    ("diff {a} {b}", 1, "DIVERGED — all 4 parameters differed as the step began"),
    ("memory {a}", 0, "attributed 100.0% of allocated bytes"),
    ("bisect {la} {lb}", 1, "The runs part at step 0: its learning rate differs: 0.1 in A, 0.2 in B"),
]


@pytest.mark.parametrize("line, code, says", ON_SAVED_FILES, ids=[c[0].split()[0] + str(i)
                                                                  for i, c in enumerate(ON_SAVED_FILES)])
def test_a_command_on_saved_files_imports_no_torch(saved, line, code, says) -> None:
    words = line.format(a=saved["a.gtrace"], b=saved["b.gtrace"], la=saved["a.gtsteps"], lb=saved["b.gtsteps"],
                        dir=saved["dir"]).split()
    got, heavy, out = _run(words, saved["dir"])
    assert (got, heavy) == (code, [])
    assert says in out
    if "-o" in words:  # the page or graph is written, not only announced
        assert os.path.getsize(words[words.index("-o") + 1]) > 1000


@pytest.mark.parametrize("words", [["--help"], [], ["--version"], *([c.name, "--help"] for c in COMMANDS)],
                         ids=lambda w: " ".join(w) or "(no command)")
def test_help_imports_no_torch(words, tmp_path) -> None:
    got, heavy, out = _run(words, os.fspath(tmp_path))
    assert (got, heavy) == (2 if not words else 0, [])
    assert out.startswith("usage: gradtrace" if words[:1] != ["--version"] else "gradtrace ")


def test_every_command_is_covered() -> None:
    """A new command gets a case above (its --help is covered by the list of commands)."""
    covered = {line.split()[0] for line, _, _ in ON_SAVED_FILES}
    assert {c.name for c in COMMANDS} - covered == {"run", "demo", "diff-ranks"}
