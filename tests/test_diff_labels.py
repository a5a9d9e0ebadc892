"""Every surface of ``gradtrace diff`` tells one story: the calls' row of the Summary table that
holds the origin (a row per phase, each counting its own calls) and the origin's heading name the
phase the headline names (``optimizer`` when the first divergence is an optimizer step,
``forward`` otherwise), and parameters and buffers are counted apart (a count of
both next to "N parameters differ" is no count of parameters): the text, the JSON, the notebook
card and the HTML page."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import tracer
from export.diff import diff, diff_html, diff_payload
from tests.browser import opened
from tests.models import diff_output, saved, traced_sum_step

LR_REASON = "inputs match, arguments differ ('lr=0.001' vs 'lr=0.002'), outputs differ"


class Scaled(nn.Module):
    """A linear layer behind a registered buffer (as a rotary table or running statistics are)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.linspace(0.5, 1.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x * self.scale)
        return out


def _step(lr: float = 1e-3, shift: float = 0.0, scale: float = 1.0) -> tracer.Trace:
    """One AdamW step of ``Scaled``: another ``lr``, input (``shift``) or buffer (``scale``)."""
    torch.manual_seed(0)
    model = Scaled()
    model.scale.mul_(scale)
    return traced_sum_step(model, torch.optim.AdamW(model.parameters(), lr=lr), shift)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("labels")
    return saved(where, {"base": _step(), "lr": _step(lr=2e-3), "input": _step(shift=0.5),
                         "buffer": _step(scale=2.0)})


_cli = diff_output


def _verdict(text: str) -> str:
    """The verdict, the first lines of the output, unwrapped."""
    return re.sub(r" ?\n", " ", text[:text.index("\nnote: ")])


def _rows(text: str) -> dict[str, list[str]]:
    """The Summary table's rows: section -> [compared, differing, inserted, removed, verdict's
    first line]."""
    table = text[text.index("Summary"):text.index("└")]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if len(cells) == 6 and cells[0] and cells[0] != "section":
            rows[cells[0]] = cells[1:]
    return rows


def test_an_optimizer_origin_is_named_optimizer_in_the_summary_and_its_heading(
        traces: dict[str, Path], capsys: Any) -> None:
    text = _cli(capsys, str(traces["base"]), str(traces["lr"]))
    assert _verdict(text).startswith("DIVERGED — optimizer: first at AdamW0 (torch.optim.adamw.AdamW.step in "
                                     f"<root>, optimizer): {LR_REASON} | backward: equal")
    rows = _rows(text)
    # a row per phase of the calls, each counting its own: mul, linear, sum; AdamW0
    assert list(rows) == ["forward", "optimizer", "backward", "parameters", "buffers"]
    assert rows["forward"] == ["3", "0", "0", "0", "equal (3 aligned)"]
    assert rows["optimizer"][:4] == ["1", "1", "0", "0"]
    assert rows["optimizer"][4].startswith("first at AdamW0 (torch.optim.adamw.AdamW.step in <root>,")
    assert f"\nFirst optimizer divergence: {LR_REASON}" in text
    assert "First forward divergence" not in text
    # the API says the same
    r = diff(traces["base"], traces["lr"])
    assert r.forward.label == "optimizer" and r.backward.label == "backward" and r.forward.section == "forward"
    assert repr(r.forward).startswith("<Divergence optimizer: first at AdamW0 ")
    card = r._repr_html_()
    assert re.search(r">optimizer</th><td[^>]*>first at AdamW0 ", card) and ">forward</th>" not in card


def test_parameters_and_buffers_are_counted_apart(traces: dict[str, Path], capsys: Any) -> None:
    text = _cli(capsys, str(traces["base"]), str(traces["lr"]))
    rows = _rows(text)
    assert rows["parameters"] == ["2", "2", "", "", "2 parameters differ (value after the step)"]
    assert rows["buffers"] == ["1", "0", "", "", "equal"]
    assert "\nParameters that differ (2 of 2 parameters, 0 of 1 buffer)" in text
    data = json.loads(_cli(capsys, str(traces["base"]), str(traces["lr"]), "--json"))
    assert (data["params_compared"], data["buffers_compared"]) == (2, 1)
    assert [(p["name"], p["buffer"]) for p in data["params"]] == [("fc.weight", False), ("fc.bias", False)]
    card = diff(traces["base"], traces["lr"])._repr_html_()
    assert ">parameters and buffers</th><td style=\"text-align:left\">2 of 2 parameters, 0 of 1 buffer differ: " in card
    # a buffer that differs is counted as a buffer, in its row
    changed = _rows(_cli(capsys, str(traces["base"]), str(traces["buffer"])))
    assert changed["parameters"] == ["2", "1", "", "", "1 parameter differs (gradient)"]
    assert changed["buffers"] == ["1", "1", "", "", "1 buffer differs (value)"]
    data = json.loads(_cli(capsys, str(traces["base"]), str(traces["buffer"]), "--json"))
    assert (data["params_compared"], data["buffers_compared"]) == (2, 1)
    assert [(p["name"], p["buffer"]) for p in data["params"]] == [("scale", True), ("fc.weight", False)]


def test_a_forward_origin_is_still_named_forward(traces: dict[str, Path], capsys: Any) -> None:
    text = _cli(capsys, str(traces["base"]), str(traces["input"]))
    assert _verdict(text).startswith("DIVERGED — forward: first at mul0 (Tensor.mul in <root>): ")
    rows = _rows(text)
    assert list(rows) == ["forward", "optimizer", "backward", "parameters", "buffers"]
    assert rows["forward"][:4] == ["3", "3", "0", "0"]
    assert rows["optimizer"] == ["1", "1", "0", "0", "1 call differs only because gradients differ"]
    assert rows["forward"][4].startswith("first at mul0 (Tensor.mul in <root>): first call to read")
    assert rows["parameters"] == ["2", "1", "", "", "1 parameter differs (gradient, value after the step)"]
    assert rows["buffers"] == ["1", "0", "", "", "equal"]
    assert "\nFirst forward divergence: first call to read the changed input input0: input differs, outputs differ" \
        in text
    assert "\nFirst backward divergence: forward values saved by linear0 differ" in text
    assert "\nParameters that differ (1 of 2 parameters, 0 of 1 buffer)" in text
    assert "optimizer divergence" not in text
    r = diff(traces["base"], traces["input"])
    assert r.forward.label == "forward" and repr(r.forward).startswith("<Divergence forward: first at mul0 ")


@pytest.mark.browser
def test_the_html_page_names_the_buffers_it_lists(traces: dict[str, Path], tmp_path: Path) -> None:
    a, b = tracer.load(str(traces["base"])), tracer.load(str(traces["buffer"]))
    result = diff(a, b)
    assert [(p["name"], p["buffer"]) for p in diff_payload(result, a, b)["params"]] == \
        [("scale", True), ("fc.weight", False)]
    path = tmp_path / "diff.html"
    diff_html(result, a, b, path)
    with opened(path) as (page, errors):
        assert errors == []
        section = page.locator("section", has_text="Parameters and buffers that differ")
        assert section.locator("h2").inner_text() == "Parameters and buffers that differ"
        names = [section.locator("tr").nth(i).locator("td").first.inner_text() for i in (1, 2)]
        assert names == ["scale (buffer)", "fc.weight"]
