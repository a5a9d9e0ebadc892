"""The HTML report in a real browser: headless Debian chromium driven by Playwright.

One browser for the module; each test opens its own page from ``file://`` and records console
errors and every request that is not ``file:``/``data:``/``about:``. Skipped cleanly where
chromium or playwright is missing.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import tracer
from export.html import html as write_html
from export.html.data import build_payload, rows
from tests.test_html import HOSTILE, hostile_trace, record_step

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not (os.path.exists(CHROMIUM) or shutil.which("chromium")), reason="needs Debian's chromium"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


# True when the drawn graph lies inside the visible graph area.
GRAPH_FITS = """(() => {
  const g = document.getElementById('gt-vp').getBoundingClientRect(), v = document.getElementById('gt-svg').getBoundingClientRect();
  return g.top >= v.top && g.bottom <= v.bottom && g.left >= v.left && g.right <= v.right;
})()"""


class Opened:
    """A report page plus what it did: console errors, page errors, requests, dialogs."""

    def __init__(self, browser: Any, path: Path) -> None:
        self.page = browser.new_page(viewport={"width": 1500, "height": 950})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.goto(path.as_uri())
        self.page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        self.page.set_default_timeout(5_000)
        self.zoom_out_to_whole()   # the whole graph in view, so every box can be clicked

    def zoom_out_to_whole(self) -> None:
        """Zoom out (the − button, as a user would) until the graph's height fits the view: "fit"
        fits the width only."""
        for _ in range(40):
            if self.page.evaluate(GRAPH_FITS):
                return
            self.page.click("#gt-zout")
        raise AssertionError("the graph never fit the view")

    def external_requests(self) -> list[str]:
        return [u for u in self.requests if not u.startswith(("file:", "data:", "about:"))]

    def details_title(self) -> str:
        return self.page.inner_text("#gt-details h2")


@pytest.fixture
def opened(browser: Any, tmp_path: Path) -> Iterator[Any]:
    pages: list[Opened] = []

    def open_trace(trace: tracer.Trace, name: str = "step.html") -> Opened:
        path = tmp_path / name
        write_html(trace, path)
        pages.append(Opened(browser, path))
        return pages[-1]

    yield open_trace
    for o in pages:
        o.page.close()


@pytest.fixture(scope="module")
def step() -> tracer.Trace:
    return record_step()


def test_loads_with_no_errors_and_no_network(opened: Any, step: tracer.Trace) -> None:
    o = opened(step)
    assert o.errors == [] and o.external_requests() == [] and o.dialogs == []
    assert o.page.inner_text("#gt-title") == "gradtrace · Net"
    assert "calls " + str(len(step.calls)) in o.page.inner_text("#gt-summary")
    # every call outside the folded optimizer line is drawn, and every grad node
    drawn = set(o.page.eval_on_selector_all("#gt-vp [data-name]", "els => els.map(e => e.getAttribute('data-name'))"))
    assert {"linear0", "relu0", "mul0", "linear3", "pow0", "mean0"} <= drawn
    assert {n.name for n in step.grad_nodes} <= drawn


def test_click_a_call_shows_its_stack_and_links_to_its_grad_node_and_back(opened: Any, step: tracer.Trace) -> None:
    o = opened(step)
    page = o.page
    page.click('#gt-vp [data-name="linear3"]')
    assert o.details_title() == "linear3"
    frames = page.locator("#gt-details .frame.user").all_inner_texts()
    assert any("test_html.py" in f and "loss = model(x).pow(2).mean()" in f for f in frames)
    assert "return self.out(self.head(h))" in frames[-1]   # the innermost user frame: Net.forward
    assert "torch.nn.functional.linear" in page.inner_text("#gt-details .kv")
    assert page.get_attribute('#gt-vp [data-name="linear3/AddmmBackward0"]', "class").split().count("mate") == 1
    page.click('#gt-details [data-goto="linear3/AddmmBackward0"]')
    assert o.details_title() == "linear3/AddmmBackward0"
    assert "sel" in page.get_attribute('#gt-vp [data-name="linear3/AddmmBackward0"]', "class").split()
    assert "mate" in page.get_attribute('#gt-vp [data-name="linear3"]', "class").split()
    run = step.backward_runs[0]
    assert f"step {run.order.index('linear3/AddmmBackward0') + 1} of {len(run.order)} in backward0" in page.inner_text("#gt-details")
    page.click('#gt-details [data-goto="linear3"]')
    assert o.details_title() == "linear3"
    assert o.errors == []


def test_a_lean_trace_says_a_built_in_nodes_run_was_not_recorded(opened: Any) -> None:
    """hash="none" (node_runs unset): a built-in node has no recorded run, and the page says
    so instead of "did not run"; an accumulator's run is there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with tracer.trace(hash="none") as t:
        model(torch.randn(2, 3)).sum().backward()
    o = opened(t)
    page = o.page
    page.click('#gt-vp [data-name="linear1/AddmmBackward0"]')
    assert o.details_title() == "linear1/AddmmBackward0"
    assert "no recorded run (this trace records built-in nodes’ runs only with checksums or stats" \
        in page.inner_text("#gt-details")
    page.click('#gt-vp [data-name="2.weight/AccumulateGrad"]')
    run = t.backward_runs[0]
    assert f"step {run.order.index('2.weight/AccumulateGrad') + 1} of {len(run.order)} in backward0" \
        in page.inner_text("#gt-details")
    assert o.errors == []


def test_a_hooks_op_shows_in_backward_beside_the_call_whose_node_ran_it(opened: Any) -> None:
    """A tensor hook's op (recorded since the backward runs under the recorder's mode) is a call
    during backward, placed in the module of the call whose grad node ran the hook, and its
    details name the node and the gradient it received."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with tracer.trace(hash="none") as t:
        h = model[1](model[0](torch.randn(2, 3)))
        h.register_hook(lambda g: g * 0.5)
        model[2](h).sum().backward()
    hook_call = next(c for c in t.calls if c.phase == "backward")
    assert hook_call.parent == "tanh0/TanhBackward0" and hook_call.inputs == ["tanh0:out@grad"]
    o = opened(t)
    page = o.page
    page.click(f'#gt-vp [data-name="{hook_call.name}"]')
    assert o.details_title() == hook_call.name
    details = page.inner_text("#gt-details")
    assert "during backward" in details and "tanh0:out@grad" in details
    assert "bwdphase" in page.get_attribute(f'#gt-vp [data-name="{hook_call.name}"]', "class").split()
    # In the page's data, the hook's op sits in the group of tanh0, whose node ran the hook.
    calls = rows(build_payload(t)["calls"])
    group = {c["name"]: c["group"] for c in calls}
    assert group[hook_call.name] == group["tanh0"]
    assert o.errors == []


def test_search_finds_linear3(opened: Any, step: tracer.Trace) -> None:
    o = opened(step)
    o.page.click("#gt-search")
    o.page.keyboard.type("linear3")
    first = o.page.locator("#gt-results .result").first
    assert first.get_attribute("data-name") == "linear3"
    o.page.keyboard.press("Enter")
    assert o.details_title() == "linear3"
    assert "sel" in o.page.get_attribute('#gt-vp [data-name="linear3"]', "class").split()


def test_unfolding_a_module_shows_its_calls(opened: Any, step: tracer.Trace) -> None:
    o = opened(step)
    page = o.page
    page.click("#gt-foldall")
    assert page.locator('#gt-vp [data-name="linear0"]').count() == 0
    enc = page.locator('.n.fold[data-group="m:enc"]').first
    assert "3 calls" in enc.text_content()
    enc.click()
    assert page.locator('.box-head[data-group="m:enc"]').count() == 2      # open on both sides
    assert page.locator('.n.fold[data-group="m:enc.0"]').count() == 2      # its children, folded
    page.locator('.n.fold[data-group="m:enc.0"]').first.click()
    assert page.locator('#gt-vp [data-name="linear0"]').count() == 1
    assert page.locator('#gt-vp [data-name="linear0/AddmmBackward0"]').count() == 1
    page.locator('.box-head[data-group="m:enc"]').first.click()            # fold it again
    assert page.locator('#gt-vp [data-name="linear0"]').count() == 0
    # the optimizer line starts folded; clicking it shows one part per parameter
    line = page.locator('.n.fold[data-group^="l:"]').first
    assert "opt.step()" in line.text_content()
    line.click()
    assert page.locator('.n.fold[data-group^="p:"]').count() == 8
    assert o.errors == []


def test_hostile_strings_render_as_text_and_run_nothing(opened: Any, tmp_path: Path) -> None:
    o = opened(hostile_trace(tmp_path), "hostile.html")
    page = o.page
    assert o.errors == [] and o.dialogs == [] and o.external_requests() == []
    assert page.locator("img").count() == 0
    assert HOSTILE in page.inner_text("#gt-module")          # the module list shows the name as text
    page.click('#gt-vp [data-name="linear0"]')
    assert HOSTILE in page.inner_text("#gt-details .kv")
    assert "we'ird \"dir\" <x>" in page.inner_text("#gt-details .stack")
    assert page.locator("img").count() == 0 and o.dialogs == []


def test_nan_is_red_and_the_table_sorts(opened: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with tracer.trace(hash="md5") as t:
        model(torch.randn(3, 4)).log().sum().backward()   # log of negatives: NaN
    bad = [n for n, r in t.tensors.items() if r.stats is not None and not r.stats.finite]
    assert bad[0] == "log0:out"
    o = opened(t, "nan.html")
    page = o.page
    # the banner tells the numerics report's story, in its words
    assert page.text_content("#gt-story .story-head") == t.anomalies.headline_text()
    assert t.anomalies.headline_text().startswith("NaN made by log0 (Tensor.log) in forward")
    assert "bad" in page.get_attribute('#gt-vp [data-name="log0"]', "class").split()
    assert "bad" not in page.get_attribute('#gt-vp [data-name="linear1"]', "class").split()
    page.click("#gt-banners a")                                    # jumps to the first NaN's call
    assert o.details_title() == "log0"
    assert "4 NaN" in page.inner_text("#gt-details")
    page.click('[data-tab="table"]')
    assert page.locator("#gt-table tbody tr").count() == len(t.calls) + len(t.grad_nodes)
    page.click('#gt-table th[data-col="bad"]')
    page.click('#gt-table th[data-col="bad"]')                     # descending: NaN rows first
    first = page.locator("#gt-table tbody tr").first
    assert "bad" in first.get_attribute("class").split() and first.locator("td").nth(1).inner_text() in ("log0", "sum0")
    page.click('#gt-table th[data-col="name"]')
    names = page.locator("#gt-table tbody tr td:nth-child(2)").all_inner_texts()
    assert names == sorted(names, key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)])
    assert o.errors == []


def test_invisible_characters_in_names_show_as_escapes(opened: Any, tmp_path: Path) -> None:
    # A module named with a zero-width space (a real one: add_module takes any string) and a
    # call renamed in the file to lin\u200bear0: the page never shows a name that reads as
    # linear0, in the graph, the details, the module list or the table.
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("lin\u200bear", nn.Linear(4, 3))
    with tracer.trace() as t:
        model(torch.randn(2, 4)).sum().backward()
    path = tmp_path / "zw.gtrace"
    t.save(os.fspath(path))
    path.write_text(path.read_text(encoding="utf-8").replace('"linear0', '"lin\u200bear0\U000e0041'),
                    encoding="utf-8")
    o = opened(tracer.load(path), "zw.html")
    page = o.page
    page.click('#gt-vp [data-name="lin\u200bear0\U000e0041"]')
    assert o.details_title() == "lin\\u200bear0\\U000e0041"
    assert "lin\\u200bear" in page.inner_text("#gt-details .kv")          # its module
    assert "lin\\u200bear" in page.inner_text("#gt-module")
    page.click('[data-tab="table"]')
    assert "lin\\u200bear0\\U000e0041" in page.locator("#gt-table tbody").inner_text()
    shown = page.evaluate("document.body.innerText")
    assert "\u200b" not in shown and "\U000e0041" not in shown and "lin\\u200bear0" in shown
    assert o.errors == []


@pytest.mark.slow
def test_gpt2_12_layers_opens_folded_and_fast(opened: Any) -> None:
    """The load budget (3 s on a 2-core machine) is measured by benchmarks/html_load.py; this
    only guards against a gross regression, with a generous bound."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 256, (2, 32))
    t = record_step(_LossOf(model), ids)
    assert len(t.calls) + len(t.grad_nodes) > 3000
    o = opened(t, "gpt2.html")
    assert o.errors == [] and o.external_requests() == []
    ready_ms = o.page.evaluate("gradtrace.readyMs")
    assert ready_ms < 15_000
    assert 50 < o.page.evaluate("gradtrace.visible()") <= 400    # folded, not thousands of boxes
    o.page.click("#gt-expand")                                     # one more level stays interactive
    assert o.page.evaluate("gradtrace.visible()") <= 1500


class _LossOf(torch.nn.Module):
    """GPT-2 returning logits, so record_step's ``.pow(2).mean()`` is its loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def test_memory_tab_shows_the_timeline_with_hover_owners(tmp_path, browser):
    import torch

    import tracer
    from export.html import html

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    with tracer.trace(hash="none", memory=True) as t:
        model(torch.randn(32, 64)).sum().backward()
    out = tmp_path / "mem.html"
    html(t, out)
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(out.as_uri())
    page.click('button[data-tab="memory"]')
    assert page.locator("#gt-memory-svg").is_visible()
    titles = page.locator("#gt-memory-svg circle.pt title").all_text_contents()
    assert any(" by linear0" in s for s in titles) and any("[backward]" in s for s in titles)
    assert "peak" in page.locator("#gt-memory-svg .peak-label").text_content()
    assert not errors
    page.close()


def test_multi_rank_page_switches_between_ranks(tmp_path, browser):
    import torch

    import tracer
    from export.html import html_ranks

    traces = []
    for rank in (0, 1):
        with tracer.trace() as t:
            torch.full((3,), float(rank)).exp()
        t.header["distributed"] = {"rank": rank, "world_size": 2}
        traces.append(t)
    out = tmp_path / "ranks.html"
    html_ranks(traces[::-1], out)  # given out of order: the page sorts by rank
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(out.as_uri())
    assert page.locator("#gt-ranks button").all_text_contents() == ["rank 0", "rank 1"]
    assert page.locator('iframe[data-rank="0"]').is_visible()
    page.click('#gt-ranks button[data-rank="1"]')
    assert page.locator('iframe[data-rank="1"]').is_visible() and not page.locator('iframe[data-rank="0"]').is_visible()
    frame = page.frame_locator('iframe[data-rank="1"]')
    assert "exp0" in frame.locator("#gt-data").text_content()
    assert not errors
    page.close()
