"""Reading a trace in the HTML report, round two (issue 20), in headless chromium: "fit" fits the
width and the graph scrolls; search + Enter selects the call; "+ level" stops before 1,000
boxes; NaN badges on the side that was non-finite; the first forward/backward NaN buttons; the
Memory tab's tables; the multi-rank page marking the rank that departed first."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tracer
from export.cli import main
from export.diff.ranks import diff_ranks
from export.html import html_ranks
from tests import test_html_browser as shared
from tests.models import gpt2_12l
from tests.test_html import HOSTILE, embedded, hostile_trace, record_step
from tracer.analysis.memory import MemoryRecord
from tracer.analysis.memory_views import record_tables_data
from tracer.model.display import format_bytes

pytestmark = shared.pytestmark
browser = shared.browser  # the module's fixtures, shared
opened = shared.opened

VIEW = """(() => {
  const g = document.getElementById('gt-vp').getBoundingClientRect(), v = document.getElementById('gt-svg').getBoundingClientRect();
  return {gl: g.left, gt: g.top, gw: g.width, gh: g.height, gb: g.bottom, vl: v.left, vt: v.top, vw: v.width, vh: v.height, vb: v.bottom};
})()"""
DRAWN = "document.querySelectorAll('#gt-vp .n').length"  # boxes on the page: calls, grad nodes, folded groups


@pytest.fixture(scope="module")
def gpt2() -> tracer.Trace:
    """A 12-layer GPT-2 training step (built from a config, no download): 2,300 calls, 850 grad nodes."""
    pytest.importorskip("transformers")
    model, ids = gpt2_12l()
    return record_step(shared._LossOf(model), ids)


def graph_box(o: Any) -> dict[str, float]:
    return dict(o.page.evaluate(VIEW))


# ---- fit ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fit_fits_the_width_and_the_wheel_scrolls_the_rest(opened: Any, gpt2: tracer.Trace) -> None:
    o = opened(gpt2, "gpt2.html")
    page = o.page
    page.set_default_timeout(30_000)   # a 3,000-box graph on a busy 2-core machine
    page.click("#gt-zin")
    page.click("#gt-zin")
    page.click("#gt-fit")
    b = graph_box(o)
    # the graph spans the view's width (20 px margins), not shrunk to a ribbon that fits the height
    assert abs(b["gw"] - (b["vw"] - 40)) < 1 and abs(b["gl"] - (b["vl"] + 20)) < 1
    assert b["gh"] > 3 * b["vh"]
    assert 0 <= b["gt"] - b["vt"] < 30                      # its top is at the top of the view
    assert page.locator("#gt-vscroll").is_visible()
    track = page.locator("#gt-vscroll").bounding_box()
    thumb = page.locator("#gt-vthumb").bounding_box()
    assert track is not None and thumb is not None
    assert thumb["y"] == track["y"] and thumb["height"] < track["height"] / 3
    # the wheel scrolls down by what it turned, at the same scale
    page.mouse.move(b["vl"] + b["vw"] / 2, b["vt"] + b["vh"] / 2)
    page.mouse.wheel(0, 600)
    page.wait_for_function(f"document.getElementById('gt-vp').getBoundingClientRect().top < {b['gt'] - 1}")
    after = graph_box(o)
    assert abs(after["gt"] - (b["gt"] - 600)) < 1 and abs(after["gw"] - b["gw"]) < 0.5
    # ... and no further than the graph's end: its bottom stays in view
    page.mouse.wheel(0, 100_000)
    page.wait_for_function(f"document.getElementById('gt-vp').getBoundingClientRect().top < {after['gt'] - 1}")
    end = graph_box(o)
    assert end["vb"] - 60 < end["gb"] <= end["vb"]
    thumb_end = page.locator("#gt-vthumb").bounding_box()
    assert thumb_end is not None and abs(thumb_end["y"] + thumb_end["height"] - (track["y"] + track["height"])) < 1.5
    page.mouse.wheel(0, -100_000)
    page.wait_for_function(f"document.getElementById('gt-vp').getBoundingClientRect().top > {end['gt'] + 1}")
    assert abs(graph_box(o)["gt"] - b["gt"]) < 1            # back at the top
    # ctrl + wheel zooms
    page.keyboard.down("Control")
    page.mouse.wheel(0, -300)
    page.keyboard.up("Control")
    page.wait_for_function(f"document.getElementById('gt-vp').getBoundingClientRect().width > {b['gw'] + 1}")
    assert o.errors == []


# ---- + level ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_plus_level_stops_before_1000_boxes_and_says_why(opened: Any, gpt2: tracer.Trace, tmp_path: Path) -> None:
    o = opened(gpt2, "gpt2.html")
    page = o.page
    page.set_default_timeout(30_000)   # a 3,000-box graph on a busy 2-core machine
    expand = page.locator("#gt-expand")
    clicks = 0
    while expand.is_enabled():
        assert expand.get_attribute("title").startswith("unfold the next module level")
        page.click("#gt-expand")
        clicks += 1
        assert page.evaluate(DRAWN) == page.evaluate("gradtrace.visible()") <= 1000
    assert clicks >= 1
    title = expand.get_attribute("title")
    m = re.fullmatch(r"One more level would draw ([\d,]+) boxes, more than 1,000 \(the page would get slow\): "
                     r"click the boxes you want to unfold, or pick a module\.", title)
    assert m is not None, title
    promised = int(m.group(1).replace(",", ""))
    assert promised > 1000
    # Unfolding that level by hand, box by box, draws exactly the number the tooltip gave.
    groups = embedded((tmp_path / "gpt2.html").read_text(encoding="utf-8"))["groups"]
    fields = groups["fields"]
    depth = {r[fields.index("id")]: r[fields.index("depth")] for r in groups["rows"]}
    kind = {r[fields.index("id")]: r[fields.index("kind")] for r in groups["rows"]}
    folded = {g for g in page.eval_on_selector_all("#gt-vp .n.fold", "els => els.map(e => e.getAttribute('data-group'))")
              if kind[g] in ("module", "function")}
    level = min(depth[g] for g in folded)
    for g in sorted(g for g in folded if depth[g] == level):
        page.evaluate("g => document.querySelector(`#gt-vp .n.fold[data-group=\"${g}\"]`)"
                      ".dispatchEvent(new MouseEvent('click', {bubbles: true}))", g)
    assert page.evaluate(DRAWN) == promised
    assert o.errors == []


# ---- search + Enter -----------------------------------------------------------------------------------
class Named(nn.Module):
    """Submodules named after their op, as people write them: module ``gelu`` holds call ``gelu0``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.gelu = nn.GELU()
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gelu(self.linear(x)))


def test_enter_selects_the_call_not_the_module_it_sits_in(opened: Any) -> None:
    t = record_step(Named(), torch.randn(3, 8))
    assert t["gelu0"].module == "gelu"
    o = opened(t, "named.html")
    page = o.page
    page.click("#gt-search")
    page.keyboard.type("gelu")
    rows = page.locator("#gt-results .result")
    assert rows.first.get_attribute("data-name") == "gelu0" and "active" in rows.first.get_attribute("class").split()
    assert rows.nth(1).get_attribute("data-name") == "m:gelu"      # the exact module name comes after the call
    page.keyboard.press("Enter")
    assert o.details_title() == "gelu0"
    assert page.inner_text("#gt-details .badge.call") == "call"
    assert "sel" in page.get_attribute('#gt-vp [data-name="gelu0"]', "class").split()
    assert page.locator("#gt-vp .sel").count() == 1
    assert "gelu (GELU)" in page.inner_text("#gt-details .kv")     # its module, one click away
    # the arrow keys still choose: down to the module, Enter selects it
    page.fill("#gt-search", "")
    page.click("#gt-search")
    page.keyboard.type("gelu")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")
    assert o.details_title() == "gelu"
    assert page.inner_text("#gt-details .badge.grp") == "module"
    # no call's name matches "out" (the module's call is linear1): Enter selects the module
    page.fill("#gt-search", "")
    page.click("#gt-search")
    page.keyboard.type("out")
    assert page.locator("#gt-results .result").first.get_attribute("data-name") == "m:out"
    page.keyboard.press("Enter")
    assert o.details_title() == "out"
    assert page.inner_text("#gt-details .badge.grp") == "module"
    assert o.errors == []


# ---- NaN badges and the first-NaN buttons -------------------------------------------------------------
class ZeroNorm(nn.Module):
    """The norm of a zero vector: every forward value finite, the gradient of sqrt at 0 infinite
    and NaN after it (the classic NaN that exists only in backward), down to the weights' grads.
    (Through a ReLU that gave zeros the NaN would be selected away: dropped, not reported.)"""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.Tanh()
        with torch.no_grad():
            self.lin.weight.zero_()  # every pre-activation 0, tanh(0) = 0 exactly, its gradient 1
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x))
        return h.pow(2).sum(-1).sqrt()


def nonfinite(t: tracer.Trace, name: str | None) -> bool:
    rec = t.tensors.get(name or "")
    return rec is not None and rec.stats is not None and not rec.stats.finite


def drawn_bad(o: Any, side: str) -> list[str]:
    return o.page.eval_on_selector_all(
        f'#gt-vp .n.bad[data-key^="{side}"]', "els => els.map(e => e.getAttribute('data-name') || e.getAttribute('data-group'))")


def test_nan_only_in_backward_badges_only_grad_nodes(opened: Any) -> None:
    model = ZeroNorm()
    with tracer.trace(hash="md5") as t:
        model(torch.randn(3, 4)).sum().backward()
    assert not any(nonfinite(t, n) for c in t.calls for n in c.outputs)
    bad_nodes = {n.name for n in t.grad_nodes if any(nonfinite(t, g) for g in (*n.grads_in, *n.grads_out))}
    assert bad_nodes == {"sqrt0/SqrtBackward0", "sum0/SumBackward1", "pow0/PowBackward0", "tanh0/TanhBackward0",
                         "linear0/AddmmBackward0", "linear0/TBackward0", "lin.weight/AccumulateGrad",
                         "lin.bias/AccumulateGrad"}
    o = opened(t, "zeronorm.html")
    page = o.page
    assert drawn_bad(o, "f") == [] and page.locator('#gt-vp [data-key^="f"] .badtag').count() == 0
    assert set(drawn_bad(o, "b")) == bad_nodes
    assert page.locator('#gt-vp [data-key^="b"] .badtag').count() == len(bad_nodes)
    page.click("#gt-foldall")   # folded: the module's backward box is red, its forward box is not
    assert drawn_bad(o, "f") == []
    assert set(drawn_bad(o, "b")) == {"m:act", "m:lin", "pow0/PowBackward0", "sum0/SumBackward1", "sqrt0/SqrtBackward0"}
    # the button finds the story's headline: the first bad node in the order backward ran them
    bwd = page.locator("#gt-nan-first")
    assert bwd.is_enabled()
    # backward ran sum, sqrt (Inf: 1/sqrt(0)), then pow (Inf × 0 = NaN): the Inf came first, and
    # the NaN pow made from it is carried on from there
    run = t.backward_runs[0].order
    first = next(n for n in run if any(nonfinite(t, g) for g in t[n].grads_out if g in t.tensors))
    assert first == "sqrt0/SqrtBackward0" == t.anomalies.backward.producer
    nan = t.anomalies.backward_nan
    assert nan is not None and nan.producer == "pow0/PowBackward0" and not nan.origin
    bad_grad = t.anomalies.backward.tensor
    rec = t.tensors[bad_grad]
    assert t.anomalies.backward.kind == "inf" and rec.stats.inf and not rec.stats.nan
    assert t.anomalies.headline is t.anomalies.backward
    assert bwd.inner_text() == "first Inf"
    assert bwd.get_attribute("title") == f"Select {first}: {t.anomalies.headline_text()}"
    # an Inf-only box is badged Inf, the NaN pow made from it NaN
    assert page.locator(f'#gt-vp [data-name="{first}"] .badtag').text_content() == "Inf"
    assert page.locator('#gt-vp [data-name="pow0/PowBackward0"] .badtag').text_content() == "NaN"
    assert page.locator("#gt-story .story-head").text_content() == t.anomalies.headline_text()
    bwd.click()
    assert o.details_title() == first
    assert "sel" in page.get_attribute(f'#gt-vp [data-name="{first}"]', "class").split()
    assert o.errors == []


def test_nan_in_forward_badges_only_calls(opened: Any) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with tracer.trace(hash="md5") as t:
        model(torch.randn(3, 4)).log().sum().backward()   # log of negatives: NaN forward, finite gradients
    assert not any(nonfinite(t, g) for n in t.grad_nodes for g in (*n.grads_in, *n.grads_out))
    o = opened(t, "fwdnan.html")
    page = o.page
    assert set(drawn_bad(o, "f")) == {"log0", "sum0"} and drawn_bad(o, "b") == []
    fwd = page.locator("#gt-nan-first")
    assert fwd.inner_text() == "first NaN"
    assert fwd.get_attribute("data-target") == "log0" == t.anomalies.headline.producer
    page.click("#gt-foldall")
    fwd.click()                                               # unfolds what hides it and selects it
    assert o.details_title() == "log0"
    assert "sel" in page.get_attribute('#gt-vp [data-name="log0"]', "class").split()
    assert o.errors == []


def test_a_nan_from_an_unchecked_optimizer_state_says_so_on_the_button(opened: Any) -> None:
    """check_numerics leaves the optimizer's state out: a NaN planted in AdamW's exp_avg_sq shows
    first in the parameter the step updates, and the button's title says the state was not checked."""
    from tests.test_numerics import _nan_state_step

    t = _nan_state_step()
    assert t.anomalies.headline.state_unchecked and t.anomalies.headline.phase == "optimizer"
    o = opened(t, "state.html")
    fwd = o.page.locator("#gt-nan-first")
    assert fwd.get_attribute("data-target") == "AdamW0"
    assert fwd.get_attribute("title") == f"Select AdamW0: {t.anomalies.headline_text()}"
    assert "the optimizer's state was not checked" in t.anomalies.describe()
    assert o.errors == []


# ---- the Memory tab's tables ---------------------------------------------------------------------------
def test_memory_tab_shows_the_tables_of_gradtrace_memory(opened: Any, tmp_path: Path, capsys: Any) -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    with tracer.trace(hash="none", memory=True, out=tmp_path / "mem.gtrace") as t:
        model(torch.randn(32, 64)).sum().backward()
    assert main(["memory", str(tmp_path / "mem.gtrace")]) == 0
    printed = capsys.readouterr().out
    o = opened(t, "mem.html")
    page = o.page
    page.click('button[data-tab="memory"]')
    tables = page.locator("#gt-memory-tables table")
    captions = page.locator("#gt-memory-tables caption").all_inner_texts()
    owners = {e["owner"] for e in t.memory if e["action"] in ("alloc", "free")}
    assert captions[:3] == [f"Top allocators by bytes (of {len(owners)})", "Per module", "By phase"]
    peak = max((e for e in t.memory if e["action"] in ("alloc", "free")), key=lambda e: e["allocated_after"])
    assert captions[3].startswith(f"Peak on cpu: {format_bytes(peak['allocated_after'])} allocated at event #{peak['seq']}")
    assert len(captions) == 4 and tables.count() == 4
    # the forward/backward table, checked against the events themselves
    phases = tables.nth(2).locator("tbody tr")
    for i, phase in enumerate(("forward", "backward")):
        allocs = [e["bytes"] for e in t.memory if e["action"] == "alloc" and e["phase"] == phase]
        frees = [e["bytes"] for e in t.memory if e["action"] == "free" and e["phase"] == phase]
        assert phases.nth(i).locator("td").all_inner_texts() == [
            phase, str(len(allocs)), format_bytes(sum(allocs)), str(len(frees)), format_bytes(sum(frees))]
    # the tables `gradtrace memory` printed (its captions; its rows, from the data it prints)
    lines = [" ".join(line.split()) for line in printed.splitlines()]
    assert all(caption in lines for caption in captions)
    data = record_tables_data(MemoryRecord.from_trace(t))
    assert captions == [d.title for d in data.tables]
    for i, d in enumerate(data.tables):
        assert [tables.nth(i).locator("thead th").all_inner_texts()] == [list(d.columns)]
        cells = [r.locator("td").all_inner_texts() for r in tables.nth(i).locator("tbody tr").all()]
        assert cells == [list(row) for row in d.rows]
    assert len(data.tables[0].rows) == len(owners) <= 15
    assert page.inner_text("#gt-memory-tables .gt-mem-total") == " ".join(lines[0:2])
    assert page.inner_text("#gt-memory-tables .gt-mem-note") == " ".join(lines[2].split())
    # a name in the tables leads to the graph
    top_owner = tables.nth(0).locator("tbody tr td").first
    name = top_owner.inner_text()
    top_owner.locator("a").click()
    assert page.locator("#gt-graph").is_visible() and o.details_title() == name
    assert o.errors == []


# ---- the multi-rank page -------------------------------------------------------------------------------
@pytest.mark.slow
def test_ranks_page_marks_the_rank_that_departed_first(browser: Any, tmp_path: Path) -> None:
    from tests.test_distributed import PERTURBED, SCRIPT, _torchrun  # a 2-rank gloo run under torchrun

    _torchrun(tmp_path, SCRIPT, "--out", str(tmp_path / "step.gtrace"), "--perturb", PERTURBED)
    traces = [tracer.load(tmp_path / f"step.rank{r}.gtrace") for r in (0, 1)]
    first = diff_ranks(traces).first
    assert first is not None and (first.rank, first.call) == (1, "add_0")
    param = f"module.{PERTURBED}"
    html_ranks(traces[::-1], tmp_path / "ranks.html")
    page = browser.new_page(viewport={"width": 1500, "height": 950})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto((tmp_path / "ranks.html").as_uri())
    buttons = page.locator("#gt-ranks button")
    assert buttons.all_inner_texts() == ["rank 0", "rank 1 departed first"]
    assert page.get_attribute('#gt-ranks button[data-rank="1"]', "data-state") == "departed-first"
    assert page.locator('#gt-ranks button[data-rank="0"] .badge').count() == 0
    verdict = page.inner_text("#gt-rank-verdict")
    assert verdict.startswith(f"Rank 1 departed first at reduced gradient {param}@grad@v2 (parameter {param}): "
                              f"only rank 1 has {param}@grad@v2; rank 0 does not.")
    assert "made by add_0 (Tensor.add_) in module <root> at " in verdict
    stack = first.stack[-1]
    assert f"{stack.file}:{stack.line} param.grad.add_(1e-6)" in verdict
    others = len(diff_ranks(traces).departures) - 1
    assert f"Reference: rank 0; {others} more departing record{'' if others == 1 else 's'}." in verdict
    assert page.locator('iframe[data-rank="0"]').is_visible()
    page.click("#gt-show-departure")                          # the departing rank's report, on the call
    assert page.locator('iframe[data-rank="1"]').is_visible() and not page.locator('iframe[data-rank="0"]').is_visible()
    frame = page.frame_locator('iframe[data-rank="1"]')
    assert frame.locator("#gt-details h2").inner_text() == "add_0"
    assert "sel" in frame.locator('#gt-vp [data-name="add_0"]').get_attribute("class").split()
    assert errors == []
    page.close()


def test_ranks_page_says_when_replicas_agree(browser: Any, tmp_path: Path) -> None:
    traces = []
    for rank in (0, 1):
        with tracer.trace(hash="md5") as t:
            w = torch.ones(3, requires_grad=True)
            (w * 2).sum().backward()
        t.header["distributed"] = {"rank": rank, "world_size": 2}
        traces.append(t)
    html_ranks(traces, tmp_path / "ranks.html")
    page = browser.new_page()
    page.goto((tmp_path / "ranks.html").as_uri())
    assert page.locator("#gt-ranks .badge").count() == 0
    assert page.get_attribute("#gt-rank-verdict", "class") == "agree"
    assert page.inner_text("#gt-rank-verdict") == diff_ranks(traces).verdict()
    assert page.inner_text("#gt-rank-verdict").startswith("REPLICAS AGREE: ranks 0, 1")
    page.close()


def test_ranks_page_says_why_ranks_cannot_be_compared(browser: Any, tmp_path: Path) -> None:
    traces = []
    for rank in (0, 1):
        with tracer.trace(hash="none") as t:
            torch.ones(2).exp()
        t.header["distributed"] = {"rank": rank, "world_size": 2}
        traces.append(t)
    html_ranks(traces, tmp_path / "ranks.html")
    page = browser.new_page()
    page.goto((tmp_path / "ranks.html").as_uri())
    assert page.get_attribute("#gt-rank-verdict", "class") == "unknown"
    assert page.inner_text("#gt-rank-verdict") == "CANNOT COMPARE: the traces have no checksums (recorded with hash='none')"
    assert page.locator("#gt-ranks .badge").count() == 0
    page.close()


def test_ranks_page_shows_hostile_names_as_text(browser: Any, tmp_path: Path) -> None:
    traces = []
    for rank in (0, 1):
        (tmp_path / str(rank)).mkdir()
        t = hostile_trace(tmp_path / str(rank))
        t.header["distributed"] = {"rank": rank, "world_size": 2}
        traces.append(t)
    bias = f"{HOSTILE}.bias"
    traces[1].tensors[bias].md5 = "0" * 32   # rank 1's copy of the parameter differs
    first = diff_ranks(traces).first
    assert first is not None and (first.rank, first.record, first.module) == (1, bias, HOSTILE)
    html_ranks(traces, tmp_path / "ranks.html")
    text = (tmp_path / "ranks.html").read_text(encoding="utf-8")
    assert HOSTILE not in text and "<img" not in text
    page = browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto((tmp_path / "ranks.html").as_uri())
    verdict = page.inner_text("#gt-rank-verdict")
    assert verdict.startswith(f"Rank 1 departed first at parameter {bias}: differs from rank 0.")
    assert f"in module {HOSTILE} at " in verdict and "we'ird \"dir\" <x>" in verdict
    assert page.get_attribute("#gt-show-departure", "data-goto") == first.call.removesuffix(" (first read)")
    assert page.locator("img").count() == 0 and dialogs == []
    page.close()


def test_a_grad_scaler_overflow_has_its_banner(opened: Any) -> None:
    """A GradScaler step that found NaN/Inf and skipped the optimizer step: the page says so
    under the NaN/Inf banner, as the report's text does."""
    from tests.test_numerics import _scaled_step

    t, _, _, _ = _scaled_step(2.0 ** 127)
    o = opened(t, "scaler.html")
    banners = o.page.inner_text("#gt-banners")
    # the story is a skipped step, not a fault: an amber banner leads with it
    head = o.page.locator("#gt-story")
    assert "warn" in head.get_attribute("class").split()
    assert o.page.text_content("#gt-story .story-head") == t.anomalies.headline_text() == (
        "GradScaler skipped the optimizer step: the scaled gradients overflowed, found at "
        "_amp_foreach_non_finite_check_and_unscale_0 (loss scale 1.701e+38 -> 8.507e+37). Not a bug: the scaler "
        "lowers the scale and goes on")
    assert banners.startswith("GradScaler skipped the optimizer step")
    assert o.errors == []
