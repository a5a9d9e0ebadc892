"""Hostile and damaged trace files: refused on one line or loaded with what they hold, never a hang,
a traceback, a terminal escape or a write where it should not be (issue 21, the reading side)."""

from __future__ import annotations

import gzip
import json
import os
import time
import unicodedata
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import tracer
from export.cli import main
from export.load import open_trace
from tests.models import MLP, Scale
from tracer.model import TraceFormatError, read_trace
from tracer.model.display import inert

COMMANDS = ("summary", "md5", "dot", "report", "memory", "diff", "show")


def _record(path: str, **kw: Any) -> tracer.Trace:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(out=path, **kw) as t:
        Scale.apply(model(torch.randn(3, 8)), 2.0).pow(2).mean().backward()
        opt.step()
    return t


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = os.fspath(tmp_path_factory.mktemp("robust") / "good.gtrace")
    _record(path, memory=True)
    return path


def _records(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _write(path: str, records: list[dict[str, Any]]) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _argv(command: str, path: str, tmp: str, good: str) -> list[str]:
    return {"summary": ["summary", path], "md5": ["md5", path], "show": ["show", path, "linear0"],
            "dot": ["dot", path, "-o", os.path.join(tmp, "out.dot")],
            "report": ["report", path, "-o", os.path.join(tmp, "out.html")],
            "memory": ["memory", path], "diff": ["diff", good, path]}[command]


def _assert_refused(capsys: pytest.CaptureFixture[str], path: str, tmp: str, good: str, expect: str) -> None:
    for command in COMMANDS:
        rc, _, err = _cli(capsys, *_argv(command, path, tmp, good))
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (command, err)
        assert lines[0].startswith(f"gradtrace {command}: error: ") and expect in lines[0], (command, lines[0])


# ---- structure: cycles and links ---------------------------------------------------------------------
def _edit(good: str, tmp: str, name: str, edit: Any) -> str:
    recs = _records(good)
    for r in recs:
        edit(r)
    return _write(os.path.join(tmp, name), recs)


def test_a_cycle_of_call_parents_is_refused_by_every_command_at_once(good, tmp_path, capsys):
    def cycle(r: dict[str, Any]) -> None:  # the two-field edit of the issue
        if r.get("name") == "linear0":
            r["parent"] = "tanh0"
        if r.get("name") == "tanh0":
            r["parent"] = "linear0"
    bad = _edit(good, os.fspath(tmp_path), "cycle.gtrace", cycle)
    start = time.perf_counter()
    _assert_refused(capsys, bad, os.fspath(tmp_path), good, "calls' 'parent' links form a cycle")
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("field, edit, message", [
    ("node next", lambda r: r.update(next=[r["name"]]) if r.get("t") == "node" and r["name"].endswith(
        "AddmmBackward0") else None, "grad nodes' 'next' links form a cycle"),
    ("tensor previous", lambda r: r.update(previous=r["name"]) if r.get("name") == "linear0:out" else None,
     "tensors' 'previous' links form a cycle"),
    ("missing parent", lambda r: r.update(parent="nobody") if r.get("name") == "linear0" else None,
     "call 'linear0': parent 'nobody' is not in the file"),
    ("missing next node", lambda r: r.update(next=["ghost"]) if r.get("t") == "node" else None,
     "next node 'ghost' is not in the file"),
    ("duplicate call", lambda r: r.update(name="linear0") if r.get("name") == "tanh0" else None,
     "two calls named 'linear0'"),
    ("stack id", lambda r: r.update(stack=10_000_000) if r.get("name") == "linear0" else None,
     "refers to stack 10000000, which is not in the file"),
    ("frame id", lambda r: r.update(id=10_000_000) if r.get("t") == "frame" and r["id"] == 0 else None,
     "frame id 10000000 in a file of"),
])
def test_broken_links_are_refused_in_one_line(good, tmp_path, field, edit, message):
    bad = _edit(good, os.fspath(tmp_path), "bad.gtrace", edit)
    start = time.perf_counter()
    with pytest.raises(TraceFormatError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        tracer.load(bad)
    assert "\n" not in str(info.value) and time.perf_counter() - start < 5


def test_a_truncated_file_keeps_dangling_names_but_never_a_cycle(good, tmp_path):
    recs = [r for r in _records(good) if r["t"] != "end"]
    for r in recs:
        if r.get("name") == "linear0":
            r["outputs"] = ["not-written-yet:out"]  # a crash can cut a call's output record
    with pytest.warns(tracer.TruncatedTraceWarning):
        t = tracer.load(_write(os.fspath(tmp_path / "cut.gtrace"), recs))
    assert t.status == "truncated" and t["linear0"].outputs == ["not-written-yet:out"]
    recs[[r.get("name") for r in recs].index("tanh0")]["parent"] = "linear0"
    recs[[r.get("name") for r in recs].index("linear0")]["parent"] = "tanh0"
    with pytest.raises(TraceFormatError, match="form a cycle"), pytest.warns(tracer.TruncatedTraceWarning):
        tracer.load(_write(os.fspath(tmp_path / "cut2.gtrace"), recs))


# ---- fields: type and range --------------------------------------------------------------------------
def _header_and(tail: str) -> str:
    return '{"t":"header","format":"gradtrace","version":2}\n' + tail


@pytest.mark.parametrize("content, message", [
    ('{"t":"header","format":"gradtrace","version":true}\n', "no integer format version"),
    (_header_and('{"t":"call","name":"a","api":"x","module":"","inputs":[],"outputs":[],"seq":Infinity}\n'),
     "line 2: call record: 'seq' must be an integer"),
    (_header_and('{"t":"call","name":"a","api":"x","module":"","inputs":[],"outputs":[],"seq":' + "9" * 5000
                 + "}\n"), "corrupt record at line 2: Exceeds the limit"),
    (_header_and('{"t":"call","name":"a","api":"x","module":"","inputs":[],"outputs":[],"seq":' + "9" * 40
                 + "}\n"), "'seq' must be an integer from 0 to 2**63-1"),
    (_header_and('{"t":"meta","x":' + "[" * 100_000 + "]" * 100_000 + "}\n"), "corrupt record at line 2: nested too deeply"),
    (_header_and('{"t":"meta","x":' + "[" * 100 + "]" * 100 + "}\n"), "meta record nested more than 32 levels"),
    (_header_and('{"t":"call","name":"a\\ud800","api":"x","module":"","inputs":[],"outputs":[]}\n'),
     "lone UTF-16 surrogate"),
    (_header_and('{"t":"tensor","name":"a","shape":[2],"dtype":"f","device":"cpu","role":"output","md5":"\\u001b[2J"}\n'),
     "'md5' must be hexadecimal digits"),
    (_header_and('{"t":"tensor","name":"a","shape":[2],"dtype":"f","device":"cpu","role":"output",'
                 '"stats":[0,1,0.5,1,-1,0]}\n'), "NaN and Inf counts must be integers"),
    (_header_and('{"t":"tensor","name":"a","shape":[-2],"dtype":"f","device":"cpu","role":"output"}\n'),
     "'shape' must be a list of at most 256 integers"),
    # (a shape equal to one met before, [1, 2], is still checked for JSON's true)
    (_header_and('{"t":"tensor","name":"a","shape":[1,2],"dtype":"f","device":"cpu","role":"output"}\n'
                 '{"t":"tensor","name":"b","shape":[true,2],"dtype":"f","device":"cpu","role":"output"}\n'),
     "'shape' must be a list of at most 256 integers"),
    (_header_and('{"t":"tensor","name":"a","shape":[2],"dtype":"f","device":"cpu","role":"output","producer":7}\n'),
     "'producer' must be a string or null"),
    (_header_and('{"t":"node","name":"n","kind":"K","call":5}\n'), "'call' must be a string or null"),
    (_header_and('{"t":"call","name":"a","api":"x","module":"","inputs":[],"outputs":[],"error":{}}\n'),
     "'error' must be a string or null"),
    (_header_and('{"t":"memory","seq":0,"action":"alloc","bytes":-5}\n'), "memory record: 'bytes'"),
    (_header_and('{"t":"end","status":"fine"}\n'), "'status' must be one of ok, failed, truncated"),
    (_header_and('{"t":"frame","id":0,"file":"f","line":1.5,"function":"g","code":""}\n'), "'line' must be an integer"),
    ('{"t":"header","format":"gradtrace","version":2,"step":-1}\n', "'step' must be an integer"),
    # stated sizes: each integer fits, what they multiply to does not
    (_header_and('{"t":"tensor","name":"a","shape":[4294967296,4294967296],"dtype":"f","device":"cpu",'
                 '"role":"output"}\n'), "'shape' holds more than 2**63-1 elements"),
    ('{"t":"header","format":"gradtrace","version":2,"distributed":{"rank":true,"world_size":2}}\n',
     "'distributed.rank' must be an integer"),
    (_header_and('{"t":"call","name":"a","api":"x","module":"' + "a." * 300 + 'b","inputs":[],"outputs":[]}\n'),
     "'module' is a module path of more than 256 levels"),
    (_header_and('{"t":"module","path":"' + "a." * 300 + 'b","class":"Linear"}\n'),
     "'path' is a module path of more than 256 levels"),
    # required fields
    (_header_and('{"t":"memory","seq":0,"bytes":5,"device":"cpu"}\n'), "memory record is missing action, addr"),
])
def test_every_field_is_checked_by_type_and_range(tmp_path, content, message):
    p = tmp_path / "bad.gtrace"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(TraceFormatError) as info:
        tracer.load(p)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_corrupt_deflate_and_unreadable_inputs_are_one_line_errors(good, tmp_path, capsys):
    data = bytearray(gzip.compress(Path(good).read_bytes()))
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)  # zeros in the middle of the deflate stream
    corrupt = tmp_path / "corrupt.gtrace.gz"
    corrupt.write_bytes(bytes(data))
    _assert_refused(capsys, os.fspath(corrupt), os.fspath(tmp_path), good, "corrupt gzip data")
    _assert_refused(capsys, os.fspath(tmp_path), os.fspath(tmp_path), good, "is a directory")
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.gtrace"
        locked.write_bytes(Path(good).read_bytes())
        locked.chmod(0)
        _assert_refused(capsys, os.fspath(locked), os.fspath(tmp_path), good, "Permission denied")


def test_bad_options_are_one_line(good, capsys):
    for argv in (["memory", good, "--top", "-1"], ["summary", good, "--step", "-2"],
                 ["summary", good, "--max-decompressed", "lots"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err


# ---- gzip: truncation and bombs ----------------------------------------------------------------------
def _decodable_calls(gz: bytes) -> int:
    """Complete call lines in what zlib can decompress from a cut gzip stream (independently of
    the reader under test)."""
    d = zlib.decompressobj(31)
    text = d.decompress(gz) + d.flush()
    return sum(1 for line in text.split(b"\n")[:-1] if line.startswith(b'{"t":"call"'))


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8, 0.97])
def test_a_cut_gzip_keeps_every_record_that_decompressed(good, tmp_path, fraction):
    # Large enough that the old reader's lost 64 KiB mattered: the trace several times over.
    t = tracer.load(good)
    path = os.fspath(tmp_path / "big.gtrace.gz")
    t.save(path)
    whole = Path(path).read_bytes()
    cut = whole[: int(len(whole) * fraction)]
    (tmp_path / "cut.gtrace.gz").write_bytes(cut)
    with pytest.warns(tracer.TruncatedTraceWarning):
        loaded = tracer.load(tmp_path / "cut.gtrace.gz")
    assert loaded.status == "truncated"
    assert len(loaded.calls) == _decodable_calls(cut)


def test_a_streamed_gzip_killed_after_backward_loads_its_calls(tmp_path):
    path = os.fspath(tmp_path / "run.gtrace.gz")
    model = MLP()
    with tracer.trace(out=path) as t:
        Scale.apply(model(torch.randn(3, 8)), 2.0).pow(2).mean().backward()
        # What a SIGKILL here leaves on disk: the streamed gzip as flushed after the backward run,
        # a member without its end.
        killed = Path(path).read_bytes()
        n_calls = len(t.calls)
    (tmp_path / "killed.gtrace.gz").write_bytes(killed)
    with pytest.warns(tracer.TruncatedTraceWarning):
        loaded = tracer.load(tmp_path / "killed.gtrace.gz")
    assert loaded.status == "truncated" and len(loaded.calls) == n_calls == _decodable_calls(killed)
    assert [c.name for c in loaded.calls] == [c.name for c in t.calls[:n_calls]]
    assert len(loaded.backward_runs) == 1


def test_a_gzip_bomb_stops_at_the_limit_with_a_way_to_raise_it(tmp_path, capsys, monkeypatch):
    line = json.dumps({"t": "meta", "pad": "x" * 1000}) + "\n"
    bomb = tmp_path / "bomb.gtrace.gz"
    bomb.write_bytes(gzip.compress(_header_and(line * 20_000).encode(), 9))  # 20 MB from ~60 KB
    assert bomb.stat().st_size < 200_000
    with pytest.raises(TraceFormatError, match=r"decompresses to more than 1,000,000 bytes.*GRADTRACE_MAX_DECOMPRESSED"):
        tracer.load(bomb, max_decompressed=1_000_000)
    monkeypatch.setenv("GRADTRACE_MAX_DECOMPRESSED", "1M")
    rc, out, err = _cli(capsys, "summary", os.fspath(bomb))
    assert rc == 2 and "decompresses to more than 1,000,000 bytes" in err and len(err.splitlines()) == 1
    rc, out, err = _cli(capsys, "summary", os.fspath(bomb), "--max-decompressed", "50M")
    assert rc == 0 and "truncated" in out  # raised: the bomb is read (a header and meta, no end)
    # One endless line is refused at the record limit, long before the decompression limit.
    line_bomb = tmp_path / "line.gtrace.gz"
    line_bomb.write_bytes(gzip.compress(_header_and('{"t":"meta","x":"' + "a" * (80 << 20)).encode(), 9))
    monkeypatch.delenv("GRADTRACE_MAX_DECOMPRESSED")
    with pytest.raises(TraceFormatError, match="line 2 is longer than 67,108,864 bytes"):
        tracer.load(line_bomb)


# ---- several steps -----------------------------------------------------------------------------------
def _three_step_file(path: str) -> None:
    """Steps 0, 1 and 2 of a loop; step 2 makes a NaN; then a step 3 killed mid-run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(steps="0-2", out=path, stats=True):
        for i in range(3):
            x = torch.randn(2, 4)
            if i == 2:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    first = next(i for i, line in enumerate(lines) if line.startswith('{"t":"header"'))
    end = next(i for i, line in enumerate(lines) if line.startswith('{"t":"end"'))
    killed = [line.replace('"step":0', '"step":3') if i == first else line for i, line in enumerate(lines[first:end])]
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(killed)  # step 3's records, and no end record: killed mid-run


def test_every_command_says_which_steps_a_file_holds_and_their_status(tmp_path, capsys):
    path = os.fspath(tmp_path / "run.gtrace")
    _three_step_file(path)
    _, steps = read_trace(path)
    assert [(s.step, s.status) for s in steps] == [(0, "ok"), (1, "ok"), (2, "ok"), (3, "truncated")]
    assert [s.nonfinite > 0 for s in steps] == [False, False, True, False]
    rc, out, err = _cli(capsys, "summary", path)
    assert rc == 0
    assert "step 2: ok, " in out and "NaN/Inf in" in out.split("step 2: ok")[1].splitlines()[0]
    assert "step 3: truncated, " in out and "No NaN or Inf in the" in out and "of step 0." in out
    rc, out, err = _cli(capsys, "summary", path, "--step", "2")
    assert rc == 0 and "No NaN or Inf" not in out and "Values with NaN or unintended Inf" in out
    rc, out, err = _cli(capsys, "summary", path, "--step", "3")
    assert rc == 0 and "truncated" in out.split("status")[1].splitlines()[0]
    for command in ("md5", "dot", "show"):
        argv = _argv(command, path, os.fspath(tmp_path), path)
        rc, out, err = _cli(capsys, *argv)
        note = [line for line in err.splitlines() if line.startswith("gradtrace: note:")]
        assert rc == 0 and len(note) == 1 and "step 3: truncated" in note[0] and "--step N" in note[0], err
    rc, out, err = _cli(capsys, "md5", path, "--step", "2")
    assert rc == 0 and "gradtrace: note" not in err
    assert out.splitlines() == [f"{t.name}:{t.md5}" for t in tracer.load(path, step=2).tensors_in_order()]
    rc, out, err = _cli(capsys, "diff", path, path, "--step", "9")
    assert rc == 2 and "no step 9 in this file (steps: 0, 1, 2, 3)" in err


# ---- injection -----------------------------------------------------------------------------------------
PAYLOADS = {
    "linear0": "[link=https://evil.example/x]F.linear[/link]",
    "tanh0": "evil\x1b]0;owned\x07\x1b[2J",
    "Scale0": "[/]",
    "linear1": "two\nforged:d41d8cd98f00b204e9800998ecf8427e",
}


def test_strings_from_a_trace_print_as_inert_text_on_every_command(good, tmp_path, capsys):
    text = Path(good).read_text(encoding="utf-8")
    for old, new in PAYLOADS.items():
        text = text.replace(f'"{old}', json.dumps(new)[:-1])  # every name starting with old
    text = text.replace('"torch.nn.functional.linear"', json.dumps(PAYLOADS["linear0"]))  # APIs too
    text = text.replace('"torch.tanh"', json.dumps(PAYLOADS["tanh0"]))
    bad = tmp_path / "inject.gtrace"
    bad.write_text(text, encoding="utf-8")
    t = tracer.load(bad)
    assert PAYLOADS["linear1"] + ":out" in t.tensors
    for command in COMMANDS:
        argv = _argv(command, os.fspath(bad), os.fspath(tmp_path), os.fspath(bad))
        if command == "show":
            argv[2] = PAYLOADS["tanh0"]
        rc, out, err = _cli(capsys, *argv)
        assert rc == 0, (command, err)
        assert "\x1b" not in out + err and "\x07" not in out + err, command
    rc, out, _ = _cli(capsys, "md5", os.fspath(bad))
    lines = out.splitlines()
    assert len(lines) == len(t.tensors) and "forged:d41d8cd98f00b204e9800998ecf8427e" not in [
        line.split(":", 1)[0] for line in lines]
    assert "two\\nforged:d41d8cd98f00b204e9800998ecf8427e:out:" in out
    rc, out, _ = _cli(capsys, "summary", os.fspath(bad))
    assert "[link=https://evil.example/x]F.linear[/link]" in out and "\\x1b[2J" in out


# ---- outputs -------------------------------------------------------------------------------------------
def test_outputs_are_checked_before_any_work_and_never_overwrite_an_input(good, tmp_path, capsys):
    before = Path(good).read_bytes()
    link = tmp_path / "alias.html"
    link.symlink_to(good)
    cases = [(["report", good, "-o", good], "is the input trace"),
             (["report", good, "-o", os.fspath(link)], "is the input trace"),
             (["diff", good, good, "--html", good], "is the input trace"),
             (["memory", good, "--csv", good], "is the input trace"),
             (["dot", good, "-o", os.fspath(tmp_path / "missing" / "x.dot")], "does not exist"),
             (["report", good, "-o", os.fspath(tmp_path)], "is a directory"),
             (["memory", good, "--plot", os.fspath(tmp_path / "no" / "p.png")], "does not exist")]
    for argv, message in cases:
        rc, out, err = _cli(capsys, *argv)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, (argv, err)
    assert Path(good).read_bytes() == before


def test_save_never_follows_a_link_planted_at_a_temporary_name(good, tmp_path):
    t = tracer.load(good)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "saved.gtrace"
    (tmp_path / f"saved.gtrace.tmp-{os.getpid()}").symlink_to(victim)  # the old predictable name
    t.save(os.fspath(out))
    assert victim.read_text() == "keep me"
    assert list(tracer.load(out).records()) == list(t.records())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(  # no temporary file left behind
        ["saved.gtrace", f"saved.gtrace.tmp-{os.getpid()}", "victim.txt"])


def test_open_trace_lists_steps_of_a_plain_file(good):
    loaded = open_trace(good)
    assert not loaded.several_steps and [s.status for s in loaded.steps] == ["ok"]
    assert loaded.steps[0].calls == len(loaded.trace.calls)


def test_record_reprs_print_a_traces_control_characters_inertly():
    # A REPL shows records by repr: a module name from a hostile file must not clear the screen,
    # set the window title or reorder the line.
    hostile = "\x1b[2J\x1b]0;PWNED\x07\u202e"
    with tracer.trace(hash="md5") as t:
        torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    call = t.calls[-1]
    call.module = hostile
    rec = t.tensors[call.outputs[0]]
    rec.name = hostile + ".weight"
    for text in (repr(call), repr(rec), repr(t.grad_nodes[0]) if t.grad_nodes else "", repr(t)):
        assert not any(ch in text for ch in "\x1b\x07\u202e")
    assert "\\x1b[2J" in repr(call) and "\\u202e.weight" in repr(rec)


def test_a_gzip_of_blank_lines_is_refused_at_once(tmp_path: Path) -> None:
    # 64 KB that decompress to 64 MiB of newlines: reading them one by one up to the 4 GiB limit
    # would take most of an hour.
    path = tmp_path / "blank.gtrace.gz"
    path.write_bytes(gzip.compress(b"\n" * (64 << 20)))
    start = time.perf_counter()
    with pytest.raises(TraceFormatError, match="more than 10,000 blank lines: not a trace gradtrace wrote"):
        tracer.load(path)
    assert time.perf_counter() - start < 5


# ---- stated sizes and counts, required fields (issue 45) -----------------------------------------------
def test_stated_sizes_and_counts_cost_what_the_file_holds(good, tmp_path, capsys):
    tmp = os.fspath(tmp_path)
    recs = _records(good)
    # Two small rank files that state a world of 10**7 ranks: diff --ranks and the multi-rank
    # report do what two ranks need, and say how many are missing without listing them all.
    ranks = []
    for rank in (0, 1):
        copy = json.loads(json.dumps(recs))
        copy[0]["distributed"] = {"rank": rank, "world_size": 10**7, "backend": "gloo"}
        ranks.append(_write(os.path.join(tmp, f"step.rank{rank}.gtrace"), copy))
    start = time.perf_counter()
    rc, out, err = _cli(capsys, "diff", "--ranks", *ranks)
    assert rc == 0 and out.startswith("REPLICAS AGREE"), err
    assert "only 2 of 10000000 ranks given (missing: 2, 3, 4, 5, 6, 7, 8, 9 and 9,999,990 more)" in out
    rc, out, err = _cli(capsys, "report", *ranks, "-o", os.path.join(tmp, "ranks.html"))
    assert rc == 0 and os.path.getsize(os.path.join(tmp, "ranks.html")) < 1_000_000, err
    assert time.perf_counter() - start < 30
    copy[0]["distributed"] = {"rank": 5, "world_size": 2}
    _assert_refused(capsys, _write(os.path.join(tmp, "beyond.gtrace"), copy), tmp, good,
                    "header says rank 5 of a world of 2 ranks")

    # 10,001 empty traces in a 2 kB gzip: refused when the count passes the limit.
    segments = tmp_path / "segments.gtrace.gz"
    segments.write_bytes(gzip.compress(('{"t":"header","format":"gradtrace","version":2}\n{"t":"end"}\n'
                                        * 10_001).encode(), 9))
    assert segments.stat().st_size < 5_000
    start = time.perf_counter()
    rc, _, err = _cli(capsys, "md5", os.fspath(segments))
    assert rc == 2 and err == (f"gradtrace md5: error: {segments}: more than 10,000 traces in one file (line 20001): "
                               "not a file gradtrace reads; runs that trace more steps write one file per step "
                               "(per_step_files=True, --per-step-files)\n")
    assert time.perf_counter() - start < 10

    # 256 dimensions of 2**63-1 on a parameter: its element count has 4,900 digits.
    weight = next(r for r in recs if r.get("role") == "param")
    weight["shape"] = [2**63 - 1] * 256
    _assert_refused(capsys, _write(os.path.join(tmp, "shape.gtrace"), recs), tmp, good,
                    "tensor record: 'shape' holds more than 2**63-1 elements")


def test_memory_records_without_their_required_fields_are_refused(good, tmp_path, capsys):
    recs = _records(good)
    assert sum(r["t"] == "memory" for r in recs) > 2
    for r in recs:
        if r["t"] == "memory":
            del r["action"], r["allocated_after"]
    _assert_refused(capsys, _write(os.fspath(tmp_path / "mem.gtrace"), recs), os.fspath(tmp_path), good,
                    "memory record is missing action, allocated_after")


# ---- invisible characters, long strings (issue 45) ------------------------------------------------------
INVISIBLE = {"linear0": "lin\u200bear0", "tanh0": "tan\ufeffh\U000e0041\u061c0"}


def test_invisible_format_characters_print_escaped(good, tmp_path, capsys):
    # every format character (Unicode Cf) is escaped, as the control and bidi characters are
    unescaped = [hex(c) for c in range(0x110000) if unicodedata.category(chr(c)) == "Cf" and inert(chr(c)) == chr(c)]
    assert unescaped == []
    text = Path(good).read_text(encoding="utf-8")
    for old, new in INVISIBLE.items():
        text = text.replace(f'"{old}', f'"{new}')
    bad = tmp_path / "invisible.gtrace"
    bad.write_text(text, encoding="utf-8")
    t = tracer.load(bad)
    assert {INVISIBLE["linear0"], INVISIBLE["tanh0"]} <= {c.name for c in t.calls}
    rc, out, _ = _cli(capsys, "show", os.fspath(bad), INVISIBLE["linear0"])
    assert rc == 0 and out.splitlines()[0] == "call lin\\u200bear0"
    assert not [ch for ch in out if unicodedata.category(ch) == "Cf"]
    for command in ("summary", "md5"):
        rc, out, err = _cli(capsys, command, os.fspath(bad))
        assert rc == 0 and not [ch for ch in out + err if unicodedata.category(ch) == "Cf"], command
    rc, out, _ = _cli(capsys, "md5", os.fspath(bad))
    assert "tan\\ufeffh\\U000e0041\\u061c0:out:" in out and "lin\\u200bear0:out:" in out
    # the notebook card
    assert "lin\\u200bear0" in t[INVISIBLE["linear0"]]._repr_html_()


def test_megabyte_long_source_lines_module_paths_and_args_are_clipped_in_the_pages(good, tmp_path, capsys):
    recs = _records(good)
    code = "x = " + "a + " * 250_000  # a megabyte-long source line in every frame
    for r in recs:
        if r["t"] == "frame":
            r["code"] = code
        if r.get("name") == "linear0":
            r["args"] = "k=" + "9" * 1_000_000
            r["module"] = "m" * 1_000_000
    paths = []
    for rank in (0, 1):
        recs[0]["distributed"] = {"rank": rank, "world_size": 2}
        paths.append(_write(os.fspath(tmp_path / f"long.rank{rank}.gtrace"), recs))
    frames = sum(r["t"] == "frame" for r in recs)
    assert frames >= 5  # 5 MB of source lines: more than the page's budget below
    out = os.fspath(tmp_path / "long.html")
    rc, _, err = _cli(capsys, "report", paths[0], "-o", out, "--max-bytes", "4000000")
    assert rc == 0, err
    page = Path(out).read_text(encoding="utf-8")
    assert len(page) < 1_000_000
    assert page.count(code[:2000] + f"…[{len(code):,} characters]") == frames
    assert "k=" + "9" * 1998 + "…[1,000,002 characters]" in page and "m" * 2000 + "…[1,000,000 characters]" in page
    rc, _, err = _cli(capsys, "report", *paths, "-o", os.fspath(tmp_path / "ranks.html"), "--max-bytes", "4000000")
    assert rc == 0, err


def test_megabyte_long_args_and_source_lines_are_clipped_in_show_and_summary(good, tmp_path, capsys):
    recs = _records(good)
    code = "x = " + "a + " * 250_000
    for r in recs:
        if r["t"] == "frame":
            r["code"] = code
        if r.get("name") == "linear0":
            r["args"] = "k=" + "9" * 1_000_000
    path = _write(os.fspath(tmp_path / "long.gtrace"), recs)
    rc, out, err = _cli(capsys, "show", path, "linear0", "--all-frames")
    assert rc == 0, err
    # (the table wraps the args over lines: their first 2,000 characters, then the full length)
    assert "…[1,000,002 characters]" in " ".join(out.split()) and out.count("9") < 3_000
    assert code[:2000] + f"…[{len(code):,} characters]" in out and code[:2001] not in out
    assert len(out) < 200_000
    rc, out, err = _cli(capsys, "summary", path, "--all-frames")
    assert rc == 0, err
    assert code[:2001] not in out and len(out) < 100_000
    # the file itself is untouched: the loader still reads the whole strings
    assert tracer.load(path)["linear0"].args == "k=" + "9" * 1_000_000
