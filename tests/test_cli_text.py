"""What the command line says: ``--help`` with examples, one spelling of each command in the help
and the docs, and counts with their plural forms ("1 backward run", "3 allocs")."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest
import torch

import tracer
from export.cli import main
from export.cli.main import EXAMPLES, build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "docs/api.md")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


# ---- --help ------------------------------------------------------------------------------------
def test_help_lists_the_commands_then_examples_and_where_the_docs_are(capsys):
    out = _help(capsys)
    listed = re.findall(r"^    (\S+)", out, re.M)
    assert listed == ["summary", "show", "md5", "demo", "dot", "report", "diff", "run", "bisect", "memory"]
    assert "diff-ranks" not in out  # the older spelling parses but is not offered
    tail = out[out.index("examples:"):]
    assert tail.rstrip("\n") == EXAMPLES
    assert "gradtrace diff --ranks step.rank*.gtrace" in tail and "README.md" in tail and "docs/api.md" in tail


def _example_lines(text: str) -> list[str]:
    return [line.strip().split("  ")[0] for line in text.splitlines() if line.strip().startswith("gradtrace ")]


def _argv(line: str) -> list[str]:
    """A documented command line as the shell would pass it: the glob of rank files expanded."""
    line = re.sub(r"(\w+)\.rank\*\.gtrace", r"\1.rank0.gtrace \1.rank1.gtrace", line)
    return shlex.split(line.replace("[", "").replace("]", "").replace("...", ""))[1:]


def test_every_example_in_the_help_is_a_valid_command_line(capsys):
    examples = _example_lines(EXAMPLES)
    for command in ("run", "diff", "bisect"):
        examples += _example_lines(_help(capsys, command).split("examples:")[1])
    assert len(examples) == 8 + 6 + 4 + 3
    parser = build_parser()
    for line in examples:
        args = parser.parse_args(_argv(line))
        assert args.command == line.split()[1], line


def _documented_command_lines() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
            text = fh.read()
        spans = re.findall(r"`(gradtrace [a-z][^`]*)`", text) + re.findall(r"^\$ (gradtrace .*)$", text, re.M)
        found += [(doc, s) for s in spans if "COMMAND" not in s and "--help" not in s]
    return found


def _options_of(command: str) -> set[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", out.getvalue()))


def test_the_docs_spell_each_command_as_the_help_does():
    lines = _documented_command_lines()
    assert len(lines) > 20
    parser = build_parser()
    listed = set(re.findall(r"^    (\S+)", parser.format_help(), re.M))
    bad = []
    for doc, line in lines:
        argv = _argv(line)
        if argv == ["diff-ranks"] and doc == "docs/api.md":
            continue  # the one sentence that names the older spelling
        if argv[0] not in listed:
            bad.append(f"{doc}: {line}")
        elif all(a.startswith("-") for a in argv[1:]):  # a command and options named in a sentence
            bad += [f"{doc}: {line} ({a}?)" for a in argv[1:] if a not in _options_of(argv[0])]
        else:
            try:
                parser.parse_args(argv)
            except SystemExit:
                bad.append(f"{doc}: {line} (does not parse)")
    assert bad == []


def test_diff_ranks_is_still_understood_and_options_for_two_traces_are_refused_with_ranks(capsys, tmp_path):
    rc, out, err = run(capsys, "diff-ranks", str(tmp_path / "a.gtrace"), str(tmp_path / "b.gtrace"))
    assert (rc, out) == (2, "") and err == f"gradtrace diff-ranks: error: no such trace: {tmp_path / 'a.gtrace'}\n"
    rc, out, err = run(capsys, "diff", "--ranks", "a.gtrace", "b.gtrace", "--html", "d.html", "--rtol", "0.1")
    assert (rc, out) == (2, "")
    assert err == "gradtrace diff: error: --html, --rtol compare two traces, not --ranks: drop --html, --rtol\n"
    assert not (tmp_path / "d.html").exists()


# ---- plural forms ------------------------------------------------------------------------------
@pytest.fixture
def single(tmp_path) -> str:
    """One call, one parameter of one element, one backward run, one free."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False)
    x, grad = torch.ones(1, 1), torch.ones(1, 1)
    with tracer.trace(memory=True) as t:
        model(x).backward(grad)
    path = str(tmp_path / "single.gtrace")
    t.save(path)
    return path


def test_summary_of_one_call_and_one_backward_run_in_the_singular(single, capsys):
    t = tracer.load(single)
    assert repr(t) == "<Trace ok: 1 call, 3 grad nodes, 6 tensors, 1 backward run, hash=md5>"
    rc, out, err = run(capsys, "summary", single)
    assert rc == 0 and err == ""
    assert re.search(r"^records\s+1 call, 3 grad nodes, 6 tensors, 1 backward run\s*$", out, re.M)
    assert re.search(r"^parameters\s+1 element in 1 tensor \(4 B\)\s*$", out, re.M)
    assert "No NaN or Inf in the 6 tensors with stats." in out


def test_memory_of_one_free_in_the_singular(single, capsys):
    rec = tracer.MemoryRecord.from_trace(tracer.load(single))
    assert (len(rec.allocs), len(rec.frees)) == (3, 1)
    assert repr(rec).startswith("<MemoryRecord 3 allocs, 1 free, net 8 B")
    rc, out, err = run(capsys, "memory", single)
    assert rc == 0 and err == ""
    assert out.splitlines()[0].startswith("cpu (storages): 3 allocs 12 B, 1 free 4 B, net 8 B; ")


def test_run_progress_of_a_one_call_step(tmp_path, monkeypatch, capsys):
    (tmp_path / "one.py").write_text("import torch\n"
                                     "w = torch.nn.Parameter(torch.ones(2))\n"
                                     "opt = torch.optim.SGD([w], lr=0.1)\n"
                                     "opt.step()\n"
                                     "opt.step()\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--steps", "1", "one.py"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "gradtrace: step 1 traced: 1 call, 0 grad nodes, 0 backward runs"


def test_summary_says_which_tensors_have_no_stats_and_why(tmp_path, capsys):
    """The header counts every tensor, the NaN/Inf verdict only those with stats: the difference
    is said, by reason (the records' ``uninitialized``, ``hash_note`` and shape)."""
    w = torch.ones(4, requires_grad=True)
    with tracer.trace() as t:
        buf = torch.empty(4)  # uninitialised memory: no checksum, no stats
        buf2 = torch.empty_like(w)
        meta = torch.ones(3, device="meta") * 2  # meta tensors: no data to hash
        none = torch.zeros(0)  # no elements: nothing to take stats of
        (w * 3).sum().backward()
    path = str(tmp_path / "kinds.gtrace")
    t.save(path)
    loaded = tracer.load(path)
    without = {n: r for n, r in loaded.tensors.items() if r.stats is None}
    assert sorted(without) == ["empty0:out", "empty_like0:out", "mul0:out", "ones0:out", "zeros0:out"]
    assert without["empty0:out"].uninitialized and without["empty_like0:out"].uninitialized
    assert without["ones0:out"].hash_note == "not hashed: meta tensor (no data)"
    with_stats = len(loaded.tensors) - len(without)
    rc, out, err = run(capsys, "summary", path)
    assert rc == 0 and err == ""
    assert out.splitlines()[-2:] == [
        f"No NaN or Inf in the {with_stats} tensors with stats.",
        "5 tensors without stats: 2 uninitialised, 2 not hashed (meta tensor), 1 empty."]
    del buf, buf2, meta, none
