"""The HTML report without a browser: the embedded JSON against the trace, escaping, the byte
budget, the CLI and the notebook view. Browser behaviour is in test_html_browser.py."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import tracer
from export.cli import main as cli_main
from export.html import default_output, json_for_script, notebook_html, render
from export.html import html as write_html
from export.html.data import build_payload, rows
from tracer.model.frames import frame_class

ASSETS = Path(__file__).resolve().parents[1] / "export" / "assets"
HOSTILE = "</script><img src=x onerror=alert(1)>"
DATA_RE = re.compile(r'<script type="application/json" id="gt-data">(.*?)</script>', re.DOTALL)


class Double(torch.autograd.Function):
    """A custom Function with an op inside its forward, so the report shows nesting."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = Double.apply(self.enc(x))
        return self.out(self.head(h))


def record_step(model: nn.Module | None = None, x: torch.Tensor | None = None,
                optimizer_ops: bool = True) -> tracer.Trace:
    """One training step of ``Net`` (or ``model``) with the optimizer step on its own line (by
    default with every op inside it recorded: many calls from one line, as a page groups them)."""
    torch.manual_seed(0)
    model = model or Net()
    x = torch.randn(2, 3, 8) if x is None else x
    opt = torch.optim.AdamW(model.parameters())
    with tracer.trace(hash="md5", optimizer_ops=optimizer_ops) as t:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    return t


def embedded(page: str) -> dict:
    """The JSON the page carries, read back the way the page's script reads it."""
    m = DATA_RE.search(page)
    assert m is not None, "no embedded data"
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def step() -> tracer.Trace:
    return record_step()


@pytest.fixture(scope="module")
def page(step: tracer.Trace) -> str:
    return render(step)


# ---- the embedded data is the trace ------------------------------------------------------------
def test_embedded_json_matches_the_trace(step: tracer.Trace, page: str) -> None:
    data = embedded(page)
    assert data["format"] == "gradtrace-html" and data["version"] == 2
    calls = rows(data["calls"])
    assert [c["name"] for c in calls] == [c.name for c in step.calls]
    for row, c in zip(calls, step.calls):
        assert (row["api"], row["module"], row["inputs"], row["outputs"], row["grad_nodes"], row["stack"], row["parent"]) == \
               (c.api, c.module, c.inputs, c.outputs, c.grad_nodes, c.stack_id, c.parent)
    nodes = rows(data["nodes"])
    assert [n["name"] for n in nodes] == [n.name for n in step.grad_nodes]
    for row, n in zip(nodes, step.grad_nodes):
        assert (row["kind"], row["call"], row["param"], row["next"], row["grads_in"], row["grads_out"]) == \
               (n.kind, n.call, n.param, n.next, n.grads_in, n.grads_out)
    tensors = {t["name"]: t for t in rows(data["tensors"])}
    assert set(tensors) == set(step.tensors)
    for name, t in step.tensors.items():
        row = tensors[name]
        assert (row["md5"], tuple(row["shape"]), row["dtype"], row["device"], row["role"]) == (t.md5, t.shape, t.dtype, t.device, t.role)
        assert row["stats"] == (None if t.stats is None else t.stats.to_json())
    assert data["frames"] == [[f.file, f.line, f.function, f.code, frame_class(f.file)] for f in step.frames]
    assert data["stacks"] == [list(s) for s in step.stacks]
    assert data["modules"] == step.modules
    s = data["summary"]
    assert (s["model"], s["calls"], s["grad_nodes"], s["tensors"], s["backward_runs"]) == \
           ("Net", len(step.calls), len(step.grad_nodes), len(step.tensors), 1)
    assert s["params"] == 8 and s["param_numel"] == sum(p.numel() for p in Net().parameters())
    assert s["devices"] == ["cpu"] and s["header"]["hash"] == "md5"


def test_the_md5_on_the_page_is_the_md5_of_the_bytes(page: str) -> None:
    torch.manual_seed(0)
    expected = Net().enc[0].weight.detach()
    tensors = {t["name"]: t for t in rows(embedded(page)["tensors"])}
    assert tensors["enc.0.weight"]["md5"] == hashlib.md5(expected.contiguous().numpy().tobytes()).hexdigest()


def test_edges_follow_the_tensors(step: tracer.Trace, page: str) -> None:
    data = embedded(page)
    names = [c.name for c in step.calls]
    fwd = {(names[s], names[d]): ts for s, d, ts in data["fwd_edges"]}
    assert fwd[("linear0", "relu0")] == ["linear0:out"]
    assert fwd[("linear1", "Double0")] == ["linear1:out"]
    assert fwd[("linear3", "pow0")] == ["linear3:out"]
    for (src, dst), ts in fwd.items():  # every edge carries tensors the consumer read and the producer made
        assert set(ts) <= set(step[dst].inputs)
        assert all(step.tensors[t].producer == src for t in ts)
    node_names = [n.name for n in step.grad_nodes]
    bwd = {(node_names[s], node_names[d]): slots for s, d, slots in data["bwd_edges"]}
    expected = {(n.name, m): [i for i, x in enumerate(n.next) if x == m]
                for n in step.grad_nodes for m in set(n.next) if m is not None}
    assert bwd == expected


def test_grad_nodes_know_their_place_in_the_backward_run(step: tracer.Trace, page: str) -> None:
    run = step.backward_runs[0]
    for n in rows(embedded(page)["nodes"]):
        if n["name"] in run.order:
            assert (n["run"], n["step"]) == (0, run.order.index(n["name"]))
        else:
            assert (n["run"], n["step"]) == (None, None)
    assert run.order[0] == "mean0/MeanBackward0"


def test_the_default_optimizer_step_is_one_box_with_its_params_in_and_out() -> None:
    t = record_step(optimizer_ops=False)
    calls = rows(embedded(render(t))["calls"])
    step = next(c for c in calls if c["name"] == "AdamW0")
    assert step["api"] == "torch.optim.adamw.AdamW.step" and step["kind"] == "optimizer"
    names = [n for n, _ in Net().named_parameters()]
    assert step["outputs"][:len(names)] == [f"{n}@v1" for n in names]
    assert [c["name"] for c in calls if c["kind"] == "optimizer"] == ["AdamW0"]
    assert not any(c["api"].startswith("torch._foreach") for c in calls)


def test_groups_follow_modules_functions_and_the_optimizer_line(step: tracer.Trace, page: str) -> None:
    data = embedded(page)
    groups = rows(data["groups"])
    calls = rows(data["calls"])
    by_call = {c["name"]: groups[c["group"]] for c in calls}
    assert by_call["linear0"]["id"] == "m:enc.0" and by_call["linear0"]["cls"] == "Linear"
    assert groups[by_call["linear0"]["parent"]]["id"] == "m:enc"
    assert by_call["linear3"]["id"] == "m:out"
    # the custom Function is a group standing for its call, with the op inside it
    fn = by_call["Double0"]
    assert (fn["id"], fn["kind"], fn["call"]) == ("f:Double0", "function", [c["name"] for c in calls].index("Double0"))
    assert by_call["mul0"]["id"] == "f:Double0"
    # the optimizer step: one line group, one part per parameter, labelled with its name
    line = next(g for g in groups if g["kind"] == "line")
    assert line["label"] == "opt.step()" and line["where"].endswith(f"test_html.py:{_line_of('opt.step()')}")
    parts = [g for g in groups if g["kind"] == "part"]
    assert [p["label"] for p in parts] == [n for n, _ in Net().named_parameters()]
    assert all(groups[p["parent"]]["id"] == line["id"] for p in parts)
    opt_calls = [c for c in step.calls if c.stack and c.stack[-1].code.strip() == "opt.step()"]
    assert line["ncalls"] == len(opt_calls) == sum(p["ncalls"] for p in parts)
    # counts add up, and grad nodes sit with their calls (accumulators with their module)
    assert groups[0]["ncalls"] == len(step.calls) and groups[0]["nnodes"] == len(step.grad_nodes)
    nodes = rows(data["nodes"])
    by_node = {n["name"]: groups[n["group"]]["id"] for n in nodes}
    assert by_node["linear0/AddmmBackward0"] == "m:enc.0"
    assert by_node["enc.0.weight/AccumulateGrad"] == "m:enc.0"
    assert by_node["Double0/DoubleBackward"] == "f:Double0"
    # small: everything but the optimizer line starts unfolded
    assert {groups[i]["id"] for i in data["open"]} == {g["id"] for g in groups if g["kind"] in ("root", "module", "function")}


def _line_of(code: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == code)


def test_initial_folding_keeps_a_large_trace_small() -> None:
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)) for _ in range(60)])
    with tracer.trace(hash="none") as t:
        layers(torch.randn(2, 4)).sum().backward()
    data = build_payload(t)
    groups = rows(data["groups"])
    opened = {groups[i]["id"] for i in data["open"]}
    assert opened == {"root"}   # 60 blocks of 3 calls + 6 nodes would be over the budget one level down
    assert sum(1 for g in groups if g["parent"] == 0) == 60


# ---- a safe page ------------------------------------------------------------------------------
def test_json_for_script_escapes_everything_that_could_end_the_script() -> None:
    value = {"s": "</script><!-- & \u2028 \u2029 <b>", "n": [1.5, None]}
    text = json_for_script(value)
    assert not set("<>&\u2028\u2029") & set(text)
    assert json.loads(text) == value


def test_page_is_one_file_with_nothing_external(page: str) -> None:
    assert page.count("<script") == 3 and page.count("</script>") == 3   # data, dagre, ours
    assert not re.search(r"<(link|img|iframe|object|embed)\b", page, re.IGNORECASE)
    assert not re.search(r"""\b(src|href)\s*=\s*["']?(https?:|//)""", page, re.IGNORECASE)
    assert not re.search(r"@import|url\(\s*['\"]?https?:", page)
    assert "sourceMappingURL" not in page
    assert "default-src 'none'" in page   # Content-Security-Policy: the page may not fetch anything
    # the vendored library is the one scripts/vendor_assets.sh fetched, with its licence beside it
    sums = dict(reversed(line.split()) for line in (ASSETS / "vendor" / "SHA256SUMS").read_text().splitlines())
    dagre = (ASSETS / "vendor" / "dagre.min.js").read_bytes()
    assert hashlib.sha256(dagre).hexdigest() == sums["dagre.min.js"]
    assert "Permission is hereby granted" in (ASSETS / "vendor" / "dagre.LICENSE").read_text()
    assert "@dagrejs/dagre 3.1.3" in (ASSETS / "vendor" / "VERSIONS").read_text()


def hostile_trace(tmp_path: Path) -> tracer.Trace:
    """A module named like markup, run from a file whose path holds quotes and ``<``."""
    src_dir = tmp_path / "we'ird \"dir\" <x>"
    src_dir.mkdir()
    src = src_dir / "hostile_model.py"
    src.write_text("def run(model, x):\n    return model(x).sum()\n")
    spec = importlib.util.spec_from_file_location("hostile_model", src)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = nn.Sequential()
    model.add_module(HOSTILE, nn.Linear(3, 2))
    with tracer.trace(hash="md5") as t:
        mod.run(model, torch.randn(1, 3)).backward()
    assert any(HOSTILE in c.module for c in t.calls)
    assert any(str(src) == f.file for f in t.frames)
    return t


def test_hostile_strings_stay_inside_the_json(tmp_path: Path) -> None:
    t = hostile_trace(tmp_path)
    page = render(t)
    assert HOSTILE not in page and "<img" not in page
    assert page.count("</script>") == 3
    data = embedded(page)
    assert HOSTILE in data["modules"]
    assert any("we'ird \"dir\" <x>" in f[0] for f in data["frames"])
    nb = notebook_html(t)
    assert HOSTILE not in nb and "<img" not in nb


# ---- the byte budget ----------------------------------------------------------------------------
def test_past_the_budget_the_page_keeps_a_prefix_of_calls_and_says_so(step: tracer.Trace, tmp_path: Path) -> None:
    full = len(render(step).encode())
    budget = full - 20_000
    out = tmp_path / "cut.html"
    size = write_html(step, out, max_bytes=budget)
    assert size == out.stat().st_size <= budget
    data = embedded(out.read_text(encoding="utf-8"))
    kept = [c["name"] for c in rows(data["calls"])]
    assert 0 < len(kept) < len(step.calls)
    assert kept == [c.name for c in step.calls[: len(kept)]]
    assert data["omitted"]["calls"] == len(step.calls) - len(kept)
    assert f"first {len(kept)} of {len(step.calls)} calls" in data["omitted"]["message"]
    kept_set = set(kept)
    assert all(n["call"] in kept_set or n["call"] is None for n in rows(data["nodes"]))
    with pytest.raises(ValueError, match="too small"):
        render(step, max_bytes=10_000)


def test_a_trace_far_past_the_budget_is_never_built_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept prefix grows from 1,024 calls and is then bisected to within 2%: the page of
    the whole trace (the costliest build) is not made when a prefix already overflows."""
    from export.html import page as page_module

    x = torch.ones(3)
    with tracer.trace(hash="none", stacks=False) as t:
        for _ in range(6000):
            x = x + 1
    whole = len(render(t).encode())
    built: list[int] = []
    real = page_module.build_payload
    monkeypatch.setattr(page_module, "build_payload", lambda tr: built.append(len(tr.calls)) or real(tr))
    budget = whole // 3
    page = render(t, max_bytes=budget)
    kept = len(rows(embedded(page)["calls"]))
    assert len(page.encode()) <= budget and 1024 < kept < 6000
    assert max(built) < 6000 and len(built) <= 12


# ---- CLI and notebook -----------------------------------------------------------------------------
def test_cli_report_writes_beside_the_trace_and_prints_the_size(step: tracer.Trace, tmp_path: Path, capsys) -> None:
    trace_path = tmp_path / "step.gtrace"
    step.save(os.fspath(trace_path))
    assert cli_main(["report", os.fspath(trace_path)]) == 0
    out = tmp_path / "step.html"
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"{out} (") and printed.endswith(f"{out.stat().st_size} bytes)")
    # a loaded trace renders the same data as the live one
    assert embedded(out.read_text(encoding="utf-8"))["calls"] == embedded(render(step))["calls"]
    other = tmp_path / "other.html"
    assert cli_main(["report", os.fspath(trace_path), "-o", os.fspath(other)]) == 0 and other.exists()
    capsys.readouterr()
    budget = out.stat().st_size - 20_000
    assert cli_main(["report", os.fspath(trace_path), "-o", os.fspath(other), "--max-bytes", str(budget),
                     "--force"]) == 0
    assert other.stat().st_size <= budget
    assert "note: This page shows the first" in capsys.readouterr().err


def test_cli_report_errors_are_one_line(tmp_path: Path, capsys) -> None:
    assert cli_main(["report", os.fspath(tmp_path / "missing.gtrace")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such trace file" in err
    assert default_output("runs/a.gtrace.gz") == "runs/a.html"


def test_notebook_view_is_small_and_inline(step: tracer.Trace) -> None:
    nb = step._repr_html_()
    assert nb == notebook_html(step)
    assert "gradtrace · Net" in nb and f"{len(step.calls)} calls" in nb
    assert "<code>linear0</code>" in nb and f"… {len(step.calls) - 12} more calls" in nb
    assert nb.count("<tr") == 13
    assert "<iframe" not in nb and "export.html(t, 'step.html')" in nb   # the report is a file, or inline on request
