"""An output that cannot be written, or that another process writes: what the user had is
neither lost nor changed (their modes, their file), and the error says so as it is."""

from __future__ import annotations

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tracer
from export.cli import main


class CountingMode(TorchFunctionMode):
    """The program's own TorchFunctionMode: counts the torch calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_trace_file_that_cannot_be_opened_raises_its_oserror_and_leaves_the_callers_modes(tmp_path, monkeypatch):
    missing = tmp_path / "missing" / "x.gtrace"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with torch.device("meta"), CountingMode() as mode:
        with pytest.raises(FileNotFoundError) as err, tracer.trace(out=os.fspath(missing)):
            raise AssertionError("the block must not run")
        assert err.value.filename == os.fspath(missing)
        with pytest.raises(NotADirectoryError):
            tracer.trace(out=os.fspath(not_a_dir / "x.gtrace")).__enter__()
        # one rank of a torchrun job: the per-rank file is the one that cannot be opened
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(FileNotFoundError) as err:
            tracer.trace(out=os.fspath(missing)).__enter__()
        assert err.value.filename == os.fspath(tmp_path / "missing" / "x.rank1.gtrace")
        monkeypatch.delenv("RANK")
        # step traces: at once, not at the first chosen step
        for steps in ("0", "5"):
            with pytest.raises(FileNotFoundError) as err:
                tracer.trace(steps=steps, out=os.fspath(missing))
            assert err.value.filename in (os.fspath(missing), os.fspath(missing.parent))
        assert mode.calls == 0
        x = torch.ones(1)
        assert mode.calls == 1 and x.device.type == "meta"  # both of the caller's modes still apply
    assert torch.ones(1).device.type == "cpu" and not missing.parent.exists()
    assert not list(tmp_path.glob("**/*.lock"))


def test_demo_to_a_missing_directory_says_one_line_and_exits_2(tmp_path, capsys):
    out = tmp_path / "missing" / "x.gtrace"
    assert main(["demo", "-o", os.fspath(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"gradtrace demo: error: {out}: No such file or directory\n"
