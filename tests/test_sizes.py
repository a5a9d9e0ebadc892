"""One grammar for every size gradtrace reads (``tracer.model.fileformat.parse_size``): ``k``/``M``/``G``
(and ``kB``, ``MB``, ...) are powers of 1000, ``KiB``/``MiB``/``GiB`` powers of 1024, the same in
``gradtrace run --max-bytes`` and ``--keep-values-bytes``, ``report --max-bytes``, every reading
command's ``--max-decompressed`` and ``GRADTRACE_MAX_DECOMPRESSED``. (``run --max-bytes 64MiB``
meant 64,000,000 while the loader's 64MiB meant 67,108,864; ``report --max-bytes 20M`` was refused.)"""

from __future__ import annotations

import os

import pytest
import torch

import tracer
from export.cli import main
from export.cli.main import COMMANDS, build_parser
from tracer.model.fileformat import default_max_decompressed, parse_size

WRITTEN = {"4096": 4096, "4096B": 4096, "2k": 2_000, "2kB": 2_000, "2KiB": 2_048, "2Ki": 2_048, "20M": 20_000_000,
           "20 MB": 20_000_000, "64MiB": 67_108_864, "64mib": 67_108_864, "1.5G": 1_500_000_000,
           "4.1G": 4_100_000_000, "2GiB": 2_147_483_648, "1T": 10**12, "1TiB": 2**40}
REFUSED = ["", "lots", "-5", "1e3", "0", "0.5", "64iB", "5 X", "MiB"]


@pytest.mark.parametrize("text, size", WRITTEN.items())
def test_a_size_reads_as_written(text, size) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", REFUSED)
def test_what_is_not_a_size_is_refused(text) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


# Every command-line option that takes a size: (the command line before the size, after it, dest).
READS = {"summary": ["t"], "show": ["t", "x"], "md5": ["t"], "dot": ["t"], "report": ["t"], "diff": ["a", "b"],
         "memory": ["t"], "diff-ranks": ["a", "b"]}
SIZE_OPTIONS = [(["run", "--max-bytes"], ["s.py"], "max_bytes"),
                (["run", "--keep-values-bytes"], ["s.py"], "keep_values_bytes"),
                (["report", "--max-bytes"], ["t"], "max_bytes"),
                *(([name, "--max-decompressed"], rest, "max_decompressed") for name, rest in READS.items())]


@pytest.mark.parametrize("before, after, dest", SIZE_OPTIONS, ids=[" ".join(o[0]) for o in SIZE_OPTIONS])
def test_every_size_option_reads_the_one_grammar(before, after, dest, capsys) -> None:
    parser = build_parser()
    for text, size in WRITTEN.items():
        assert getattr(parser.parse_args([*before, text, *after]), dest) == size
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([*before, "20Q", *after])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("gradtrace ") and "not a size: '20Q'" in err
    assert len(err.splitlines()) == 1


def test_the_commands_that_read_traces_are_all_listed_above(capsys) -> None:
    """A new reading command (its --help names --max-decompressed) gets a line in READS."""
    with_limit = set()
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            build_parser().parse_args([command.name, "--help"])
        if "--max-decompressed SIZE" in capsys.readouterr().out:
            with_limit.add(command.name)
    assert with_limit == set(READS)


def test_the_environment_variable_reads_the_one_grammar(monkeypatch) -> None:
    monkeypatch.setenv("GRADTRACE_MAX_DECOMPRESSED", "64MiB")
    assert default_max_decompressed() == 67_108_864
    monkeypatch.setenv("GRADTRACE_MAX_DECOMPRESSED", "64M")
    assert default_max_decompressed() == 64_000_000


@pytest.fixture
def step_trace(tmp_path) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    out = os.fspath(tmp_path / "step.gtrace")
    with tracer.trace(out=out):
        model(torch.randn(2, 8)).sum().backward()
    return out


def test_report_takes_20M(step_trace, tmp_path, capsys) -> None:
    page = tmp_path / "step.html"
    assert main(["report", step_trace, "-o", os.fspath(page), "--max-bytes", "20M"]) == 0
    assert page.stat().st_size > 10_000 and "limit" not in capsys.readouterr().err


def test_run_max_bytes_stops_at_the_size_written(tmp_path, monkeypatch, capsys) -> None:
    """``2KiB`` is 2,048 bytes in the trace's own note, ``2k`` 2,000."""
    (tmp_path / "loop.py").write_text("import torch\nw = torch.nn.Parameter(torch.ones(4))\n"
                                      "opt = torch.optim.SGD([w], lr=0.1)\n"
                                      "for _ in range(2):\n"
                                      "    for _ in range(50):\n        (w * 2).sin().sum().backward()\n"
                                      "    opt.step()\n")
    monkeypatch.chdir(tmp_path)
    for text, size in (("2KiB", 2048), ("2k", 2000)):
        with pytest.warns(RuntimeWarning, match=f"max_bytes={size}"):
            assert main(["run", "--no-progress", "--max-bytes", text, "-o", f"{text}.gtrace", "loop.py"]) == 0
        assert tracer.load(f"{text}.gtrace").notes[0].startswith(f"recording stopped at max_bytes={size}")
    capsys.readouterr()
