"""The terminal commands: summary, show, md5 and demo, in-process and as real processes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from rich.console import Console

import tracer
from export.cli import demo_step as demo_command
from export.cli import main
from export.summary import md5_lines, render_record, render_summary

FORWARD_MARK = "# <- the line that makes linear0"
BACKWARD_MARK = "# <- the line that runs backward0"


def _line_of(mark: str) -> int:
    with open(__file__, encoding="utf-8") as fh:
        return next(i for i, line in enumerate(fh, 1) if line.rstrip().endswith(mark))


def md5_hex(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


@dataclass
class Recorded:
    path: str
    trace: tracer.Trace
    hashes: dict[str, str]  # tensor name -> hashlib md5 computed here, outside the tracer


def _record_step(path: str) -> Recorded:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 3, 8)
    hashes = {"input0": md5_hex(x)}
    hashes.update({name: md5_hex(p) for name, p in model.named_parameters()})
    with torch.no_grad():
        hashes["linear0:out"] = md5_hex(model[0](x))
    with tracer.trace() as t:
        out = model(x)  # <- the line that makes linear0
        loss = out.pow(2).mean()
        loss.backward()  # <- the line that runs backward0
        opt.step()
    for name, p in model.named_parameters():
        assert p.grad is not None
        hashes[f"{name}@grad"] = md5_hex(p.grad)
        hashes[f"{name}@v1"] = md5_hex(p)  # after the AdamW step, recorded as one call (AdamW0)
    t.save(path)
    return Recorded(path, t, hashes)


@pytest.fixture(scope="module")
def rec(tmp_path_factory) -> Recorded:
    return _record_step(os.fspath(tmp_path_factory.mktemp("cli") / "step.gtrace"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_line_error(rc: int, out: str, err: str, command: str) -> str:
    assert rc == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"gradtrace {command}: error: ")
    return lines[0]


# ---- md5 -------------------------------------------------------------------------------------------
def test_md5_prints_every_tensor_in_order_and_nothing_else(rec, capsys):
    rc, out, err = run(capsys, "md5", rec.path)
    assert rc == 0 and err == ""
    loaded = tracer.load(rec.path)
    expected = [f"{t.name}:{t.md5}" for t in loaded.tensors_in_order()]
    assert out == "".join(line + "\n" for line in expected)
    assert out.splitlines() == md5_lines(rec.trace)
    assert len(expected) == len(loaded.tensors) and all(t.md5 for t in loaded.tensors.values())
    # The checksums are the bytes' MD5: recompute the ones we can from the tensors themselves.
    got = dict(line.rsplit(":", 1) for line in out.splitlines())
    for name, digest in rec.hashes.items():
        assert got[name] == digest, name
    assert len(rec.hashes) == 1 + 4 + 1 + 4 + 4


def test_md5_marks_unhashed_tensors_with_a_dash(tmp_trace, capsys):
    with tracer.trace() as t:
        torch.ones(3) * 2
        torch.empty(2, device="meta") + 1
    t.save(tmp_trace)
    rc, out, _ = run(capsys, "md5", tmp_trace)
    assert rc == 0
    assert out.splitlines() == ["ones0:out:" + md5_hex(torch.ones(3)), "mul0:out:" + md5_hex(torch.full((3,), 2.0)),
                                "empty0:out:-", "add0:out:-"]


def test_md5_of_a_trace_without_hashes_is_an_error(tmp_trace, capsys):
    with tracer.trace(hash="none") as t:
        torch.ones(3) * 2
    t.save(tmp_trace)
    line = assert_one_line_error(*run(capsys, "md5", tmp_trace), "md5")
    assert "hash='none'" in line


# ---- summary ---------------------------------------------------------------------------------------
def test_summary_states_the_facts_of_the_trace(rec, capsys):
    rc, out, err = run(capsys, "summary", rec.path)
    assert rc == 0 and err == ""
    t = rec.trace
    assert re.search(r"^status\s+ok\s*$", out, re.M)
    assert re.search(rf"^torch\s+{re.escape(torch.__version__)}\s*$", out, re.M)
    assert re.search(r"^hash\s+md5\s*$", out, re.M)
    assert (f"{len(t.calls)} calls, {len(t.grad_nodes)} grad nodes, {len(t.tensors)} tensors, "
            f"1 backward run") in out
    # 8*16 + 16 + 16*8 + 8 float32 parameters
    assert "280 elements in 4 tensors (1.1 KiB)" in out
    assert re.search(r"^module\s+Sequential\s*$", out, re.M)
    assert re.search(r"^\s+F\.linear\s+2\s+7\s*$", out, re.M)  # 2 calls made 3 + 4 grad nodes
    for path, cls, calls, nodes in (("0", "Linear", 1, 3), ("1", "GELU", 1, 1), ("2", "Linear", 1, 4)):
        assert re.search(rf"^\s+{path}\s+{cls}\s+{calls}\s+{nodes}\s*$", out, re.M), path
    run_row = re.search(r"^\s+backward0\s+Tensor\.backward\s+(\d+)\s+ok\s+(\S+)\s+(.*?)\s*$", out, re.M)
    assert run_row is not None
    assert int(run_row.group(1)) == len(t.backward_runs[0].steps) == 14
    assert run_row.group(2).endswith(f"test_cli.py:{_line_of(BACKWARD_MARK)}")
    assert run_row.group(3).startswith("loss.backward()")
    assert f"No NaN or Inf in the {len(t.tensors)} tensors with stats." in out
    assert all(len(line) <= 120 for line in out.splitlines())  # plain and fixed width when piped


def _render(fn, *args) -> str:
    buf = io.StringIO()
    fn(*args, Console(file=buf, width=120, color_system=None))
    return buf.getvalue()


def test_summary_lists_nan_and_inf_tensors():
    with tracer.trace() as t:
        x = torch.tensor([-1.0, 0.0, 4.0])
        y = torch.log(x)  # nan, -inf, finite
        torch.sqrt(y.abs())
    out = _render(render_summary, t)
    assert "Values with NaN or unintended Inf (3 of 4 with stats)" in out
    for name in ("log0", "abs0", "sqrt0"):  # log(-1) = nan, log(0) = -inf, and both carry on
        assert re.search(rf"^\s+{name}:out\s+\[3\]\s+float32\s+output\s+{name}\s+1\s+1\s*$", out, re.M)
    assert "tensor0:out" not in out
    # A trace without stats says so instead of claiming there is no NaN.
    with tracer.trace(hash="none") as t2:
        torch.log(torch.tensor([-1.0]))
    assert "No tensor stats recorded" in _render(render_summary, t2)


def test_summary_of_a_failed_trace_shows_the_error(tmp_trace, capsys):
    with pytest.raises(ValueError, match="boom"), tracer.trace() as t:
        torch.ones(2) + 1
        raise ValueError("boom")
    t.save(tmp_trace)
    rc, out, _ = run(capsys, "summary", tmp_trace)
    assert rc == 0
    assert re.search(r"^status\s+failed\s*$", out, re.M)
    assert re.search(r"^error\s+ValueError: boom \(last call add0\)\s*$", out, re.M)


def test_a_multi_line_error_is_shown_in_lines_with_its_control_characters_still_escaped(tmp_trace, capsys):
    class Refuses(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad input\n  expected 3 dims\x1b[2J\n  got 2")

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g

    with pytest.raises(ValueError, match="bad input"), tracer.trace() as t:
        Refuses.apply(torch.ones(2, 4, requires_grad=True))
    t.save(tmp_trace)
    for command in (("show", tmp_trace, "Refuses0"), ("summary", tmp_trace)):
        rc, out, _ = run(capsys, *command)
        assert rc == 0
        assert re.search(r"^error\s+ValueError: bad input\s*$", out, re.M), command
        assert re.search(r"^\s+expected 3 dims\\x1b\[2J\s*$", out, re.M), command
        assert re.search(r"^\s+got 2( \(last call Refuses0\))?\s*$", out, re.M), command
        assert "\x1b" not in out and "\\n" not in out, command


def test_summary_of_a_truncated_file_warns_on_one_line(rec, tmp_path, capsys):
    with open(rec.path, encoding="utf-8") as fh:
        lines = fh.readlines()
    cut = tmp_path / "cut.gtrace"
    cut.write_text("".join(lines[: len(lines) // 2]), encoding="utf-8")
    rc, out, err = run(capsys, "summary", os.fspath(cut))
    assert rc == 0
    assert re.search(r"^status\s+truncated\s*$", out, re.M)
    assert len(err.strip().splitlines()) == 1 and err.startswith("gradtrace: warning: ")
    assert "Traceback" not in err


def test_show_of_a_value_whose_producer_a_cut_file_lost_does_not_call_it_made_outside(tmp_path, capsys):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    full = tmp_path / "full.gtrace"
    with tracer.trace(out=os.fspath(full)):
        m(torch.ones(2, 4)).sum().backward()
    lines = full.read_text(encoding="utf-8").splitlines(keepends=True)
    records = [json.loads(line)["t"] for line in lines]
    cut = tmp_path / "cut.gtrace"
    cut.write_text("".join(lines[: records.index("call")]), encoding="utf-8")  # every tensor, no call
    rc, out, _ = run(capsys, "show", os.fspath(cut), "linear0:out")
    assert rc == 0
    assert re.search(r"^producer\s+linear0\s*$", out, re.M)
    assert "Stack: unknown (its producer linear0 is not in this file: the trace was cut off)" in out
    assert "made outside" not in out


# ---- show ------------------------------------------------------------------------------------------
def test_show_call_prints_fields_links_and_stack(rec, capsys):
    rc, out, err = run(capsys, "show", rec.path, "linear0")
    assert rc == 0 and err == ""
    t = rec.trace
    assert out.startswith("call linear0\n")
    assert re.search(r"^api\s+torch\.nn\.functional\.linear\s*$", out, re.M)
    assert re.search(r"^module\s+0 \(Linear\)\s*$", out, re.M)
    for i, name in enumerate(["input0", "0.weight", "0.bias"]):
        rec_t = t.tensors[name]
        assert re.search(rf"^\s+{i}\s+{re.escape(name)}\s+\[{','.join(map(str, rec_t.shape))}\]\s+f32\s+"
                         rf"{rec.hashes[name]}\s", out, re.M), name
    assert re.search(rf"^\s+0\s+linear0:out\s+\[2,3,16\]\s+f32\s+{rec.hashes['linear0:out']}\s", out, re.M)
    for node in t["linear0"].grad_nodes:
        assert node in out
    assert "linear0/AddmmBackward0   AddmmBackward0   0.bias/AccumulateGrad, -, linear0/TBackward0" in out
    # The stack, printed as Python prints a traceback, ends at the line in this file; pytest's
    # frames above the test are folded (one line, and a footer counting them).
    tail = out.rstrip("\n").splitlines()[-3:]
    assert tail[:2] == [f'  File "{__file__}", line {_line_of(FORWARD_MARK)}, in _record_step',
                        f"    out = model(x)  {FORWARD_MARK}"]
    assert re.fullmatch(r"\(\d+ frames folded: --all-frames shows every frame\)", tail[2])
    assert "Stack (most recent call last):" in out


def test_show_grad_node_links_call_next_nodes_and_gradients(rec, capsys):
    rc, out, _ = run(capsys, "show", rec.path, "linear0/AddmmBackward0")
    assert rc == 0
    assert re.search(r"^call\s+linear0  \(torch\.nn\.functional\.linear, module 0 \(Linear\)\)\s*$", out, re.M)
    assert re.search(r"^ran in\s+backward0 step \d+\s*$", out, re.M)
    assert re.search(r"^fed by\s+linear0/ViewBackward0\s*$", out, re.M)
    assert re.search(r"^\s+0\s+0\.bias/AccumulateGrad\s+0\.bias@grad\s*$", out, re.M)
    assert re.search(r"^\s+1\s+- \(no edge\)\s+-\s*$", out, re.M)  # the input needs no gradient
    assert re.search(r"^\s+2\s+linear0/TBackward0\s+linear0/AddmmBackward0:grad2\s*$", out, re.M)
    assert re.search(rf"^\s+0\s+0\.bias@grad\s+\[16\]\s+f32\s+{rec.hashes['0.bias@grad']}\s", out, re.M)
    assert f'line {_line_of(FORWARD_MARK)}, in _record_step' in out


def test_show_tensor_links_producer_and_consumers(rec, capsys):
    rc, out, _ = run(capsys, "show", rec.path, "linear0:out")
    assert rc == 0
    assert out.startswith("tensor linear0:out\n")
    assert re.search(r"^producer\s+linear0  \(call torch\.nn\.functional\.linear\)\s*$", out, re.M)
    assert re.search(rf"^md5\s+{rec.hashes['linear0:out']}\s*$", out, re.M)
    assert re.search(r"^\s+gelu0\s+torch\.nn\.functional\.gelu\s+1 \(GELU\)\s*$", out, re.M)
    assert "Stack of producer linear0 (most recent call last):" in out
    # A parameter changed in place by the optimizer links to its next version.
    rc, out, _ = run(capsys, "show", rec.path, "0.weight")
    assert rc == 0
    assert re.search(r"^next version\s+0\.weight@v1\s*$", out, re.M)
    assert re.search(r"^producer\s+- \(made outside the traced block\)\s*$", out, re.M)
    assert re.search(r"^\s+linear0\s+torch\.nn\.functional\.linear\s+0 \(Linear\)\s*$", out, re.M)


def test_show_backward_run_lists_steps_and_call_site(rec, capsys):
    rc, out, _ = run(capsys, "show", rec.path, "backward0")
    assert rc == 0
    assert re.search(r"^roots\s+mean0:out\s*$", out, re.M)
    assert re.search(r"^nodes run\s+14\s*$", out, re.M)
    assert "   0  mean0/MeanBackward0  <- mean0:out@grad  -> pow0:out@grad\n" in out
    assert "  linear0/AddmmBackward0  <- linear0/ViewBackward0:grad0  -> 0.bias@grad, -, " \
           "linear0/AddmmBackward0:grad2\n" in out
    assert out.rstrip("\n").splitlines()[-3:-1] == [
        f'  File "{__file__}", line {_line_of(BACKWARD_MARK)}, in _record_step',
        f"    loss.backward()  {BACKWARD_MARK}"]


def test_render_record_works_on_a_live_trace(rec):
    assert _render(render_record, rec.trace, "linear0").startswith("call linear0\n")


def test_show_unknown_name_suggests_close_names(rec, capsys):
    line = assert_one_line_error(*run(capsys, "show", rec.path, "lnear0"), "show")
    assert "no call, tensor, grad node or backward run named 'lnear0'" in line
    assert "did you mean" in line and "linear0" in line


# ---- files that are not (readable) traces ----------------------------------------------------------
def _bad_files(tmp_path, good: str) -> dict[str, str]:
    corrupt = tmp_path / "corrupt.gtrace"
    with open(good, encoding="utf-8") as fh:
        lines = fh.readlines()
    lines[5] = '{"t": "call", "name": \n'  # a broken record in the middle, not at the end
    corrupt.write_text("".join(lines), encoding="utf-8")
    foreign = tmp_path / "notes.txt"
    foreign.write_text("just some notes\n", encoding="utf-8")
    other_json = tmp_path / "data.json"
    other_json.write_text(json.dumps({"hello": 1}) + "\n", encoding="utf-8")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)))
    newer = tmp_path / "newer.gtrace"
    header = json.loads(lines[0])
    header["version"] = 99
    newer.write_text(json.dumps(header) + "\n" + "".join(lines[1:]), encoding="utf-8")
    return {"corrupt": os.fspath(corrupt), "foreign": os.fspath(foreign), "json": os.fspath(other_json),
            "binary": os.fspath(binary), "newer": os.fspath(newer),
            "missing": os.fspath(tmp_path / "missing.gtrace")}


@pytest.mark.parametrize("command", ["summary", "show", "md5"])
def test_unreadable_files_exit_2_with_one_line(rec, tmp_path, capsys, command):
    bad = _bad_files(tmp_path, rec.path)
    # A JSON file of another program is reported at its line 1 (tracer.load's wording).
    expect = {"corrupt": "corrupt record at line 6", "foreign": "not a gradtrace file",
              "json": "line 1", "binary": "not a gradtrace file",
              "newer": "version 99 is newer than this gradtrace reads", "missing": "no such file"}
    for kind, path in bad.items():
        argv = [command, path] + (["linear0"] if command == "show" else [])
        line = assert_one_line_error(*run(capsys, *argv), command)
        assert expect[kind] in line, (kind, line)


# ---- demo ------------------------------------------------------------------------------------------
def test_demo_writes_a_trace_with_a_linked_custom_function(tmp_path, capsys):
    out_path = os.fspath(tmp_path / "demo.gtrace")
    rc, out, err = run(capsys, "demo", "-o", out_path, "--no-report")
    assert rc == 0, err
    assert f"Wrote {out_path}\n" in out
    assert f"gradtrace show {out_path} linear3" in out and f"gradtrace md5 {out_path}" in out
    assert re.search(r"^module\s+TinyGPT\s*$", out, re.M)
    assert not (tmp_path / "demo.html").exists()

    t = tracer.load(out_path)
    assert t.status == "ok" and len(t.calls) > 0 and len(t.grad_nodes) > 0
    assert len(t.backward_runs) == 1 and t.backward_runs[0].steps
    fns = [c for c in t.calls if c.kind == "function"]
    assert [c.name for c in fns] == ["StraightThroughClamp0", "StraightThroughClamp1"]
    fn = fns[0]
    assert fn.module == "h.0.mlp" and fn.api == "tracer.demo.StraightThroughClamp.apply"
    assert fn.grad_nodes == ["StraightThroughClamp0/StraightThroughClampBackward"]
    node = t[fn.grad_nodes[0]]
    assert node.call == fn.name and node.next == ["gelu0/GeluBackward0"]
    assert node.name in t.backward_runs[0].order
    assert [c.name for c in t.calls if c.parent == fn.name] == ["clamp0"]
    assert all(f.file.endswith(os.path.join("tracer", "demo.py")) for f in fn.stack[-3:])
    assert t["linear3"].module == "h.0.mlp.c_proj"  # the call the printed next step shows

    rc, out, _ = run(capsys, "show", out_path, "linear3")
    assert rc == 0 and "    return self.c_proj(h)" in out


def test_demo_custom_function_stack_ends_at_the_apply_line(tmp_path, capsys):
    out_path = os.fspath(tmp_path / "demo.gtrace")
    assert run(capsys, "demo", "-o", out_path, "--no-report")[0] == 0
    frame = tracer.load(out_path)["StraightThroughClamp0"].stack[-1]
    assert (frame.function, frame.code) == ("MLP.forward", "h = StraightThroughClamp.apply(h, self.clamp)")


def test_demo_writes_html_when_the_exporter_exists(tmp_path, capsys, monkeypatch):
    calls: list[tuple[tracer.Trace, str]] = []

    def fake_html(trace: tracer.Trace, path: str) -> None:
        calls.append((trace, path))
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("<html></html>")

    monkeypatch.setattr(demo_command, "html", fake_html)
    out_path = os.fspath(tmp_path / "step.gtrace")
    rc, out, _ = run(capsys, "demo", "-o", out_path)
    assert rc == 0
    html_path = os.fspath(tmp_path / "step.html")
    assert [p for _, p in calls] == [html_path]
    assert len(calls[0][0].calls) == len(tracer.load(out_path).calls)
    assert f"Wrote {out_path}, {html_path}\n" in out


def test_demo_does_not_overwrite_a_file_that_is_not_a_trace(tmp_path, capsys):
    precious = tmp_path / "demo.gtrace"
    precious.write_text("my notes\n", encoding="utf-8")
    line = assert_one_line_error(*run(capsys, "demo", "-o", os.fspath(precious)), "demo")
    assert "is not a gradtrace trace" in line
    assert precious.read_text(encoding="utf-8") == "my notes\n"


def test_demo_model_is_small_and_seeded():
    from tracer.demo import build_demo, demo_step

    model, opt, (idx, targets) = build_demo(seed=0)
    state = torch.random.get_rng_state()
    model2, _, (idx2, _) = build_demo(seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
    assert torch.equal(idx, idx2) and torch.equal(idx[:, 1:], targets[:, :-1])
    assert idx.shape == (4, 32) and int(idx.max()) < 128
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert model.wte.weight.shape == (128, 64) and sum(p.numel() for p in model.parameters()) == 110_336
    loss1 = demo_step(model, opt, (idx, targets))
    loss2 = demo_step(model, opt, (idx, targets))
    assert loss1.shape == () and float(loss2) < float(loss1)  # AdamW made progress on the batch


# ---- as real processes -----------------------------------------------------------------------------
def _gradtrace_exe() -> str:
    exe = shutil.which("gradtrace") or os.path.join(os.path.dirname(sys.executable), "gradtrace")
    if not os.path.exists(exe):
        pytest.skip("the gradtrace console script is not installed (pip install -e .)")
    return exe


def _proc(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}  # piped output must not depend on the caller's terminal
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


def test_commands_run_as_gradtrace_and_as_python_m_tracer(rec, tmp_path, capsys):
    expected = "".join(line + "\n" for line in md5_lines(tracer.load(rec.path)))
    p = _proc([_gradtrace_exe(), "md5", rec.path])
    assert p.returncode == 0 and p.stdout == expected and p.stderr == ""

    p = _proc([sys.executable, "-m", "tracer", "show", rec.path, "linear0"])
    assert p.returncode == 0, p.stderr
    lines = p.stdout.rstrip("\n").splitlines()
    assert lines[-1].endswith("folded: --all-frames shows every frame)")  # the footer of a folded stack
    assert lines[-3:-1] == [
        f'  File "{__file__}", line {_line_of(FORWARD_MARK)}, in _record_step',
        f"    out = model(x)  {FORWARD_MARK}"]
    rc, in_process, _ = run(capsys, "show", rec.path, "linear0")
    assert rc == 0 and p.stdout == in_process

    bad = _bad_files(tmp_path, rec.path)
    p = _proc([_gradtrace_exe(), "summary", bad["newer"]])
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and "version 99 is newer" in p.stderr


def test_an_unknown_command_is_offered_the_listed_commands_only(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nosuch"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    offered = re.search(r"invalid choice: '?nosuch'? \(choose from (.*?)\)", err)
    assert offered is not None, err
    # (quoted by repr or not, as Python versions differ)
    assert re.findall(r"[\w-]+", offered.group(1)) == [
        "summary", "show", "md5", "demo", "dot", "report", "diff", "run", "bisect", "memory"]
    # The old spelling it leaves out still runs.
    with pytest.raises(SystemExit) as help_:
        main(["diff-ranks", "--help"])
    assert help_.value.code == 0 and "usage: gradtrace diff-ranks" in capsys.readouterr().out
