"""Records, ``t.anomalies``, memory records and diff results in a REPL and a notebook: exact
one-line reprs of a small model's records, HTML cards that escape hostile names and stay small,
the Trace view within its byte budget, and a real notebook executed by ``nbclient`` whose HTML
outputs render in Chromium without a console error."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import export
import tracer
from export.html import NOTEBOOK_MAX_BYTES, inline_report, notebook_html
from tests.test_html import HOSTILE, hostile_trace

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
SCRIPT = "<script>alert(1)</script>"


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.fixture(scope="module")
def nan_step() -> tracer.Trace:
    """A forward NaN planted at ``torch.sqrt`` of a negative value, and its backward."""
    model = small_model()
    x = torch.randn(2, 3)
    with tracer.trace(hash="md5") as t:
        loss = torch.sqrt(model(x) - 10).sum()
        loss.backward()
    return t


# ---- one line each ----------------------------------------------------------------------------------
def test_records_repr_in_one_line(nan_step: tracer.Trace) -> None:
    t = nan_step
    assert [repr(c) for c in t.calls] == [
        "<Call linear0 F.linear op in 0: input0, 0.weight, 0.bias -> linear0:out>",
        "<Call relu0 F.relu op in 1: linear0:out -> relu0:out>",
        "<Call linear1 F.linear op in 2: relu0:out, 2.weight, 2.bias -> linear1:out>",
        "<Call sub0 Tensor.sub op: linear1:out -> sub0:out>",
        "<Call sqrt0 torch.sqrt op: sub0:out -> sqrt0:out>",
        "<Call sum0 Tensor.sum op: sqrt0:out -> sum0:out>",
    ]
    nodes = {n.name: repr(n) for n in t.grad_nodes}
    assert nodes["linear1/AddmmBackward0"] == "<GradNode linear1/AddmmBackward0 of linear1 -> 3 edges>"
    assert nodes["0.weight/AccumulateGrad"] == "<GradNode 0.weight/AccumulateGrad accumulates into 0.weight>"
    assert nodes["sqrt0/SqrtBackward0"] == "<GradNode sqrt0/SqrtBackward0 of sqrt0 -> 1 edge>"
    md5 = {name: (rec.md5 or "")[:12] for name, rec in t.tensors.items()}
    assert len(md5["linear0:out"]) == 12
    assert repr(t.tensors["linear0:out"]) == \
        f"<TensorRecord linear0:out f32[2,4] cpu output of linear0 requires_grad md5 {md5['linear0:out']}>"
    assert repr(t.tensors["input0"]) == f"<TensorRecord input0 f32[2,3] cpu input md5 {md5['input0']}>"
    assert repr(t.tensors["sqrt0:out"]) == \
        f"<TensorRecord sqrt0:out f32[2,2] cpu output of sqrt0 requires_grad md5 {md5['sqrt0:out']} NaN 4 Inf 0>"
    assert repr(t.tensors["sum0:out"]).startswith("<TensorRecord sum0:out f32[] cpu output of sum0")
    assert repr(t.backward_runs[0]) == "<BackwardRun backward0 Tensor.backward from sum0:out: 12 steps, ok>"
    for rec in [*t.calls, *t.grad_nodes, *t.tensors.values(), *t.backward_runs]:
        assert "\n" not in repr(rec) and len(repr(rec)) < 400


def test_anomalies_repr_names_each_phase(nan_step: tracer.Trace) -> None:
    report = nan_step.anomalies
    headline = ("NaN made by sqrt0 (torch.sqrt) in forward, module <root> — test_reading_notebook.py:41: "
                "loss = torch.sqrt(model(x) - 10).sum()")
    assert repr(report) == f"<NumericsReport {headline}; 11 more; 23 checked>"
    assert repr(report.forward_nan) == f"<Anomaly {headline}>"
    html = report._repr_html_()
    assert "NaN in forward" in html and "origin: made here from finite inputs" in html
    assert "then 11 more values with NaN (forward 1, backward 10)" in html
    # the user's line, linked to its file
    assert f'href="file://{Path(__file__).as_posix()}"' in html
    assert "loss = torch.sqrt(model(x) - 10).sum()" in html.replace("&#x27;", "'")


def test_memory_record_card() -> None:
    model = small_model()
    x = torch.randn(2, 3)
    with tracer.record_memory() as rec:
        model(x).sum().backward()
    assert re.fullmatch(r"<MemoryRecord \d+ allocs, \d+ frees, net -?\d+(\.\d)? (B|KiB), peak \d+ B on cpu>", repr(rec))
    card = rec._repr_html_()
    assert "<b>memory record</b>" in card and "peak" in card and f"{len(rec.allocs)} allocs" in card
    assert "<script" not in card


def test_diff_result_repr_and_card(nan_step: tracer.Trace) -> None:
    a = nan_step
    model = small_model()
    x = torch.randn(2, 3)  # the same draws as nan_step's
    with torch.no_grad():
        model[0].weight[0, 0] += 0.5
    with tracer.trace(hash="md5") as b:
        torch.sqrt(model(x) - 10).sum().backward()
    result = export.diff(a, b)
    assert repr(result).startswith("<DiffResult A vs B: DIVERGED — 1 parameter differs: 0.weight (stats differ: ")
    assert repr(result.forward.origin) == repr(result.forward.rows[0])
    # a difference of stats (no values kept) says so
    assert repr(result.forward.rows[0]).startswith("<Row linear0 torch.nn.functional.linear in 0: origin, stats max |Δ| ")
    assert repr(result.params[0]) == "<ParamDiff 0.weight value differ, grad equal>"
    card = result._repr_html_()
    assert "<b>diff</b> <code>DIFFERENT</code>" in card and "<code>0.weight</code>" in card
    assert len(card) < 6000


# ---- hostile names ----------------------------------------------------------------------------------
def script_trace() -> tracer.Trace:
    """A module named ``<script>alert(1)</script>`` and a very long hostile name."""
    model = nn.Sequential()
    model.add_module(SCRIPT, nn.Linear(3, 2))
    model.add_module(HOSTILE * 400, nn.ReLU())
    with tracer.trace(hash="md5") as t:
        model(torch.randn(1, 3)).sum().backward()
    return t


def test_cards_escape_hostile_names(tmp_path: Path) -> None:
    for t in (script_trace(), hostile_trace(tmp_path)):
        cards = [r._repr_html_() for r in [*t.calls, *t.grad_nodes, *t.tensors.values(), *t.backward_runs]]
        cards += [t._repr_html_(), t.anomalies._repr_html_()]
        for card in cards:
            assert "<script" not in card and "<img" not in card
            assert len(card.encode()) < 8_000
        assert any("&lt;script&gt;alert(1)&lt;/script&gt;" in c or "&lt;/script&gt;&lt;img" in c for c in cards)
    long_call = next(c for c in script_trace().calls if c.module.startswith(HOSTILE))
    assert len(repr(long_call)) < 400 and repr(long_call).count("…") >= 1


def test_trace_view_stays_within_its_budget() -> None:
    t = script_trace()
    view = t._repr_html_()
    assert view == notebook_html(t) and len(view.encode()) <= NOTEBOOK_MAX_BYTES
    assert "<iframe" not in view and "export.html(t, &#x27;step.html&#x27;)" not in view
    assert "export.html(t, 'step.html')" in view and "export.inline_report(t)" in view
    # a tight budget drops rows, counts them, and still holds
    budget = len(notebook_html(t, top=0).encode()) + 200
    tight = notebook_html(t, max_bytes=budget)
    assert len(tight.encode()) <= budget and f"… {len(t.calls)} more calls" in tight and "<td>" not in tight
    # the full report stays available, on request
    inline = inline_report(t)._repr_html_()
    assert inline.startswith('<iframe srcdoc="') and 'sandbox="allow-scripts"' in inline
    assert SCRIPT not in inline


def test_seven_call_model_view_is_small() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    with tracer.trace(hash="md5") as t:
        (model(x) ** 2).mean().backward()
    assert len(t.calls) == 7
    size = len(t._repr_html_().encode())
    assert size < 4_000, size   # was 165 kB with the report embedded


# ---- a real notebook --------------------------------------------------------------------------------
nbformat = pytest.importorskip("nbformat", reason="needs nbformat (test extras)")
nbclient = pytest.importorskip("nbclient", reason="needs nbclient (test extras)")

CELLS = [
    f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
    "import torch, torch.nn as nn, tracer, export\n"
    "torch.manual_seed(0)\n"
    "model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))\n"
    f"model.add_module({SCRIPT!r}, nn.Linear(2, 2))\n"
    "x = torch.randn(2, 3)\n"
    "with tracer.trace(hash='md5') as t:\n"
    "    torch.sqrt(model(x) - 10).sum().backward()",
    "t",
    "t.calls[0]",
    "t['sqrt0:out']",
    "t['linear1/AddmmBackward0']",
    "t.backward_runs[0]",
    "t.anomalies",
    "export.diff(t, t)",
]


@pytest.fixture(scope="module")
def executed() -> Any:
    if shutil.which("jupyter") is None and not any(
            os.path.exists(os.path.join(p, "jupyter", "kernels", "python3")) for p in (sys.prefix + "/share",)):
        pytest.skip("no python3 Jupyter kernel")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    return nb


def outputs(nb: Any, i: int) -> dict[str, str]:
    data: dict[str, str] = {}
    for out in nb.cells[i].outputs:
        assert out.output_type != "error", out
        data.update(out.get("data", {}))
    return data


def test_notebook_outputs_hold_the_reprs(executed: Any) -> None:
    nb = executed
    assert outputs(nb, 1)["text/plain"].startswith("<Trace ok: 7 calls")
    assert outputs(nb, 2)["text/plain"] == "<Call linear0 F.linear op in 0: input0, 0.weight, 0.bias -> linear0:out>"
    assert outputs(nb, 3)["text/plain"].startswith("<TensorRecord sqrt0:out f32[2,2] cpu output of sqrt0")
    assert outputs(nb, 4)["text/plain"] == "<GradNode linear1/AddmmBackward0 of linear1 -> 3 edges>"
    assert outputs(nb, 5)["text/plain"].startswith("<BackwardRun backward0 Tensor.backward from sum0:out")
    assert outputs(nb, 6)["text/plain"].startswith("<NumericsReport NaN made by sqrt0 (torch.sqrt) in forward")
    assert outputs(nb, 7)["text/plain"].startswith("<DiffResult A vs B: EQUAL")
    for i in range(1, len(CELLS)):
        html = outputs(nb, i)["text/html"]
        assert "<script" not in html and len(html.encode()) <= NOTEBOOK_MAX_BYTES
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in outputs(nb, 1)["text/html"]
    total = sum(len(str(o)) for c in nb.cells for o in c.outputs)
    assert total < 40_000, total


sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        pytest.skip("needs Debian's chromium")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.mark.browser
def test_notebook_html_renders_in_chromium(executed: Any, browser: Any, tmp_path: Path) -> None:
    body = "".join(f'<section id="cell{i}">{outputs(executed, i)["text/html"]}</section>' for i in range(1, len(CELLS)))
    path = tmp_path / "outputs.html"
    path.write_text(f"<!doctype html><meta charset=utf-8><title>outputs</title><body>{body}</body>", encoding="utf-8")
    page = browser.new_page()
    errors: list[str] = []
    dialogs: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    assert errors == [] and dialogs == []
    assert page.locator("script").count() == 0
    assert page.locator(".gradtrace-summary").count() == 1
    assert page.locator(".gradtrace-record").count() >= 6
    text = page.inner_text("#cell1")
    assert SCRIPT in text   # the hostile module name shows as text
    hrefs = page.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))")
    assert hrefs and all(h.startswith("file:///") for h in hrefs)
    page.close()
