"""``gradtrace report`` and ``gradtrace dot`` never overwrite a file silently: one line, exit 2,
unless ``--force``; the demo's own outputs are rewritten as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tracer
from export.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lin = torch.nn.Linear(3, 2)
    path = tmp_path_factory.mktemp("t") / "step.gtrace"
    with tracer.trace(out=os.fspath(path)):
        lin(torch.randn(4, 3)).sum().backward()
    return path


@pytest.mark.parametrize("command, suffix", [("report", ".html"), ("dot", ".dot")])
def test_existing_output_is_refused_without_force(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  command: str, suffix: str) -> None:
    out = tmp_path / f"mine{suffix}"
    out.write_text("the user's own file", encoding="utf-8")
    assert main([command, os.fspath(saved), "-o", os.fspath(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"gradtrace {command}: error: {out} exists; pass --force to overwrite it, or choose another name with -o\n"
    assert out.read_text(encoding="utf-8") == "the user's own file"  # nothing lost
    assert main([command, os.fspath(saved), "-o", os.fspath(out), "--force"]) == 0
    assert out.read_text(encoding="utf-8") != "the user's own file"


def test_default_output_is_refused_the_second_time(saved: Path, tmp_path: Path) -> None:
    trace = tmp_path / "step.gtrace"
    trace.write_bytes(saved.read_bytes())
    assert main(["dot", os.fspath(trace)]) == 0
    assert main(["dot", os.fspath(trace)]) == 2
    assert main(["dot", os.fspath(trace), "-f"]) == 0


def test_demo_outputs_are_rewritten_without_force(saved: Path, tmp_path: Path) -> None:
    demo = tmp_path / "demo.gtrace"
    demo.write_bytes(saved.read_bytes())
    (tmp_path / "demo.html").write_text("an older demo page", encoding="utf-8")
    assert main(["report", os.fspath(demo)]) == 0
    assert "gradtrace" in (tmp_path / "demo.html").read_text(encoding="utf-8")
    assert main(["dot", os.fspath(demo)]) == 0 and main(["dot", os.fspath(demo)]) == 0
    # another name beside the demo is still the user's
    assert main(["dot", os.fspath(demo), "-o", os.fspath(tmp_path / "mine.dot")]) == 0
    assert main(["dot", os.fspath(demo), "-o", os.fspath(tmp_path / "mine.dot")]) == 2
