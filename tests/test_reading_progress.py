"""The commands' progress bar: nothing on stderr when it is not a terminal, a rich bar naming each
stage when it is (a terminal-like stream) or when ``GRADTRACE_PROGRESS=1`` forces it."""

from __future__ import annotations

import hashlib
import io
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from rich.console import Console

import tracer
from export.cli import main as cli_main
from export.cli.progress import Stages, describe_load
from tracer.analysis.terminal import PROGRESS_ENV, progress_console
from tracer.model.display import format_size

ANSI_CLEAR_LINE = "\x1b[2K"


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    with tracer.trace(hash="md5") as t:
        model(x).sum().backward()
    path = tmp_path_factory.mktemp("progress") / "step.gtrace"
    t.save(os.fspath(path))
    return path


COMMANDS = (["report"], ["dot"], ["summary"])


def _argv(cmd: list[str], saved: Path, tmp_path: Path) -> list[str]:
    out = {"report": ["-o", os.fspath(tmp_path / "out.html")], "dot": ["-o", os.fspath(tmp_path / "out.dot")]}
    return [*cmd, os.fspath(saved), *out.get(cmd[0], [])]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_no_progress_text_when_stderr_is_not_a_terminal(cmd: list[str], saved: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    assert cli_main(_argv(cmd, saved, tmp_path)) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "gradtrace: loading" not in captured.out


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_forced_progress_names_the_stages(cmd: list[str], saved: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert cli_main(_argv(cmd, saved, tmp_path)) == 0
    captured = capsys.readouterr()
    size = format_size(saved.stat().st_size)
    assert f"gradtrace: loading step.gtrace ({size})" in captured.err
    if cmd[0] == "report":
        assert "gradtrace: writing out.html" in captured.err
    if cmd[0] == "dot":
        assert "gradtrace: drawing out.dot" in captured.err
    assert ANSI_CLEAR_LINE in captured.err   # a live bar, erased at the end (transient)
    assert "gradtrace: loading" not in captured.out   # stdout keeps only the command's output


def test_a_terminal_gets_the_bar_and_zero_turns_it_off(saved: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert progress_console() is not None
    assert cli_main(["summary", os.fspath(saved)]) == 0
    assert "gradtrace: loading step.gtrace" in term.getvalue()
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert progress_console() is None
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert cli_main(["summary", os.fspath(saved)]) == 0
    assert quiet.getvalue() == ""


def test_stages_on_a_forced_console_count_to_the_end() -> None:
    buf = io.StringIO()
    with Stages(["load", "write"], console=Console(file=buf, force_terminal=True, width=100)) as stages:
        stages.next("loading a.gtrace")
        stages.next("writing a.html")
    text = buf.getvalue()
    assert "gradtrace: loading a.gtrace" in text and "0/2" in text
    assert "gradtrace: writing a.html" in text and "1/2" in text
    plain = io.StringIO()
    with Stages(["load"], console=Console(file=plain)) as stages:   # not a terminal: rich draws nothing live
        stages.next("loading a.gtrace")
    assert "gradtrace: loading" not in plain.getvalue()
    assert describe_load("/no/such/file.gtrace") == "loading file.gtrace"


# ---- the end of a traced block: the last checksums -----------------------------------------------
def _big_step() -> tuple[tracer.Trace, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(512, 1024)  # 2 MiB: hashed on the worker threads, collected at the block's end
    with tracer.trace(hash="md5") as t:
        y = (x * 2).exp()
    return t, y


@pytest.mark.parametrize(("stream", "setting", "shown"), [
    (Terminal, None, True), (io.StringIO, None, False), (io.StringIO, "1", True), (Terminal, "0", False)])
def test_end_of_block_checksums_show_a_bar_only_where_someone_watches(
        monkeypatch: pytest.MonkeyPatch, stream: type[io.StringIO], setting: str | None, shown: bool) -> None:
    from tracer.record import end_progress

    monkeypatch.setattr(end_progress, "SHOW_FROM_BYTES", 1 << 20)
    if setting is None:
        monkeypatch.delenv(PROGRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(PROGRESS_ENV, setting)
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    t, y = _big_step()
    text = err.getvalue()
    assert ("gradtrace: checksums of the block's last 6.3 MB" in text) is shown, text
    if shown:
        assert ANSI_CLEAR_LINE in text  # transient: the bar is gone when the checksums are done
    else:
        assert text == ""
    # the checksums are those of the bytes, bar or not
    assert t.tensors["exp0:out"].md5 == hashlib.md5(y.numpy().tobytes()).hexdigest()


def test_small_blocks_show_no_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "1")
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    _big_step()  # 6 MiB of checksums: below the default threshold
    assert err.getvalue() == ""
