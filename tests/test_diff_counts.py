"""The counts ``gradtrace diff`` prints say what they count.

- The Summary table's calls are counted per phase: the ``optimizer`` row (the headline's word for
  the calls after backward) counts the optimizer's calls, the ``forward`` row the forward's, each
  checked here against the traces' calls by phase (the row named ``optimizer`` once counted every
  call outside backward, forward calls included).
- Parameters only one trace has (an extra layer in B) are not compared: ``4 of 4 in both traces;
  2 only in B``, not ``6 of 6`` where A has 4; the same in the text, the JSON and the HTML page.
- A tensor whose shape differs between A and B is no infinite difference: the per-module table
  says ``shapes differ`` and its max abs is of the differences measured, never ``inf``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import tracer
from export.diff import diff, diff_html, diff_payload, module_table
from tests.browser import opened
from tests.models import diff_output, saved, traced_sum_step
from tracer.model.display import format_number

torch.set_num_threads(1)


def _mlp(width: int, extra: bool) -> nn.Sequential:
    """``Linear(4, width), ReLU, Linear(width, 2)`` (4 parameters); ``extra``: one more
    ``Linear(width, width), ReLU`` before the last layer (6 parameters)."""
    layers: list[nn.Module] = [nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2)]
    if extra:
        layers[2:2] = [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


class _Scaled(nn.Module):
    """A linear layer; ``scaled``: behind a registered buffer of ones (a buffer only this model has)."""

    def __init__(self, scaled: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.scaled = scaled
        if scaled:
            self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x * self.scale if self.scaled else x)
        return out


def _step(lr: float = 0.1, shift: float = 0.0, width: int = 3, extra: bool = False,
          model: nn.Module | None = None) -> tracer.Trace:
    """One SGD step of ``_mlp`` (or ``model``), seeded: another ``lr``, input (``shift``), width
    or an extra layer."""
    torch.manual_seed(0)
    net = model if model is not None else _mlp(width, extra)
    return traced_sum_step(net, torch.optim.SGD(net.parameters(), lr=lr), shift)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("counts")
    made = {"base": _step(), "lr": _step(lr=0.2), "input": _step(shift=0.5), "extra": _step(extra=True),
            "wide": _step(width=5)}
    torch.manual_seed(0)
    plain = _Scaled(False)
    torch.manual_seed(0)
    made |= {"plain": _step(model=plain), "buffered": _step(model=_Scaled(True))}
    return saved(where, made)


_cli = diff_output


def _table(text: str, title: str) -> dict[str, list[str]]:
    """A table of the text output: first cell -> the other cells, a cell wrapped over several
    lines joined with spaces."""
    start = text.index(f"\n{title}") + 1
    rows: dict[str, list[str]] = {}
    last: list[str] | None = None
    for line in text[start:text.index("└", start)].splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0]:
            last = rows[cells[0]] = cells[1:]
        elif last is not None:  # a wrapped cell goes on
            last[:] = [f"{x} {y}".strip() for x, y in zip(last, cells[1:])]
    return rows


def _by_phase(path: Path) -> Counter[str]:
    """The trace's calls per phase, those the calls' section holds (all but backward's)."""
    return Counter(c.phase for c in tracer.load(str(path)).calls if c.phase != "backward")


# ---- 1. the calls' rows count the calls of their phase ----------------------------------------------
def test_the_optimizer_row_counts_only_the_optimizer_calls(traces: dict[str, Path], capsys: Any) -> None:
    text = _cli(capsys, str(traces["base"]), str(traces["lr"]))
    assert text.startswith("DIVERGED — optimizer: first at SGD0 (torch.optim.sgd.SGD.step in <root>, optimizer): ")
    rows = _table(text, "Summary")
    assert list(rows) == ["forward", "optimizer", "backward", "parameters"]
    # linear, relu, linear, sum: equal; the SGD step read equal values with another lr
    assert rows["forward"] == ["4", "0", "0", "0", "equal (4 aligned)"]
    assert rows["optimizer"] == ["1", "1", "0", "0", "first at SGD0 (torch.optim.sgd.SGD.step in <root>, optimizer): "
                                 "inputs match, arguments differ ('lr=0.1' vs 'lr=0.2'), outputs differ"]
    for side in ("base", "lr"):  # every call of each phase aligned: compared is the trace's count
        assert _by_phase(traces[side]) == {"forward": 4, "optimizer": 1}
    assert {p: int(rows[p][0]) for p in ("forward", "optimizer")} == _by_phase(traces["base"])
    data = json.loads(_cli(capsys, str(traces["base"]), str(traces["lr"]), "--json"))
    assert data["forward"]["phases"] == {
        "forward": {"compared": 4, "differing": 0, "inserted": 0, "removed": 0},
        "optimizer": {"compared": 1, "differing": 1, "inserted": 0, "removed": 0}}
    assert data["forward"]["compared"] == 5  # the section as a whole: every call outside backward
    assert data["backward"]["phases"] == {"backward": {"compared": 10, "differing": 0, "inserted": 0, "removed": 0}}


def test_the_forward_row_counts_only_the_forward_calls(traces: dict[str, Path], capsys: Any) -> None:
    text = _cli(capsys, str(traces["base"]), str(traces["input"]))
    assert text.startswith("DIVERGED — forward: first at linear0 (torch.nn.functional.linear in 0): ")
    rows = _table(text, "Summary")
    assert list(rows) == ["forward", "optimizer", "backward", "parameters"]
    assert rows["forward"][:4] == ["4", "4", "0", "0"]
    assert rows["forward"][4] == ("first at linear0 (torch.nn.functional.linear in 0): first call to read the changed "
                                  "input input0: input differs, outputs differ; 3 later records contaminated; 1 call "
                                  "after backward differs via gradients")
    assert rows["optimizer"] == ["1", "1", "0", "0", "1 call differs only because gradients differ"]
    assert {p: int(rows[p][0]) for p in ("forward", "optimizer")} == _by_phase(traces["base"]) \
        == _by_phase(traces["input"])
    r = diff(traces["base"], traces["input"])
    phases = r.forward.phase_counts()
    assert [(c.phase, c.compared, c.differing, c.later, c.via_gradients) for c in phases] == \
        [("forward", 4, 4, 3, 0), ("optimizer", 1, 1, 0, 1)]
    assert sum(c.compared for c in phases) == r.forward.compared == 5


# ---- 2. parameters only one trace has are counted apart -----------------------------------------------
def test_an_extra_layer_counts_the_parameters_both_have_and_those_only_in_b(
        traces: dict[str, Path], capsys: Any) -> None:
    text = _cli(capsys, str(traces["base"]), str(traces["extra"]))
    # A: 0.weight, 0.bias, 2.weight, 2.bias; B: those (2.* of another shape) and 4.weight, 4.bias.
    # 2.* of another shape are not one parameter changed: counted apart, as the verdict says.
    assert "\nParameters that differ (2 of 2 in both traces; 2 of another shape, 2 only in B)" in text
    assert "6 of 6" not in text
    assert _table(text, "Summary")["parameters"] == [
        "2", "2", "2", "0", "2 parameters differ (gradient, value after the step); 2 of another shape, 2 only in B"]
    data = json.loads(_cli(capsys, str(traces["base"]), str(traces["extra"]), "--json"))
    assert (data["params_compared"], data["buffers_compared"]) == (2, 0)
    assert (data["params_only_in"], data["buffers_only_in"]) == ({"A": 0, "B": 2}, {"A": 0, "B": 0})
    assert (data["params_of_another_shape"], data["buffers_of_another_shape"]) == (2, 0)
    assert [(p["name"], p["only_in"]) for p in data["params"]] == [
        ("2.weight", None), ("2.bias", None), ("0.weight", None), ("0.bias", None), ("4.weight", "B"),
        ("4.bias", "B")]
    r = diff(traces["base"], traces["extra"])
    a, b = tracer.load(str(traces["base"])), tracer.load(str(traces["extra"]))
    assert diff_payload(r, a, b)["params_of"] == "2 of 2 in both traces; 2 of another shape, 2 only in B"
    assert (">parameters</th><td style=\"text-align:left\">2 of 2 in both traces differ; 2 of another shape, 2 only "
            "in B: ") in r._repr_html_()
    # the other way round: B's extra layer is A's, removed
    back = _cli(capsys, str(traces["extra"]), str(traces["base"]))
    assert "\nParameters that differ (2 of 2 in both traces; 2 of another shape, 2 only in A)" in back
    assert _table(back, "Summary")["parameters"] == [
        "2", "2", "0", "2", "2 parameters differ (gradient, value after the step); 2 of another shape, 2 only in A"]


def test_a_buffer_only_in_one_trace_is_counted_as_a_buffer(traces: dict[str, Path], capsys: Any) -> None:
    text = _cli(capsys, str(traces["plain"]), str(traces["buffered"]))
    rows = _table(text, "Summary")
    assert rows["parameters"] == ["2", "0", "", "", "equal"]  # x * 1 is x: the gradients are equal
    assert rows["buffers"] == ["0", "0", "1", "0", "1 buffer only in B"]
    # (the title wraps over the narrow table)
    assert "Buffers that differ (0 of 2 parameters in both traces; 1 buffer only in B)" in " ".join(text.split())
    data = json.loads(_cli(capsys, str(traces["plain"]), str(traces["buffered"]), "--json"))
    assert (data["params_compared"], data["buffers_compared"]) == (2, 0)
    assert (data["params_only_in"], data["buffers_only_in"]) == ({"A": 0, "B": 0}, {"A": 0, "B": 1})
    assert [(p["name"], p["buffer"], p["only_in"]) for p in data["params"]] == [("scale", True, "B")]


# ---- 3. a shape mismatch is no infinite difference -----------------------------------------------------
def test_a_shape_mismatch_reads_shapes_differ_not_inf(traces: dict[str, Path], capsys: Any) -> None:
    text = _cli(capsys, str(traces["base"]), str(traces["wide"]))  # Linear(4, 3) against Linear(4, 5)
    mods = _table(text, "Per module")
    for m, backward in (("0", "2"), ("1", "1"), ("2", "2")):
        assert mods[m] == ["0", backward, "0", "shapes differ", "", ""], m
    assert "inf" not in text[text.index("\nPer module"):]
    r = diff(traces["base"], traces["wide"])
    by_module = {m["module"]: m for m in module_table(r)}
    assert [(m, by_module[m]["max_abs"], by_module[m]["max_rel"], by_module[m]["shapes_differ"])
            for m in ("0", "1", "2")] == [("0", 0.0, 0.0, 2), ("1", 0.0, 0.0, 1), ("2", 0.0, 0.0, 2)]
    # the records: the backward origin's difference is its shapes, with no number
    o = r.backward.origin
    assert o is not None and (o.a, o.shapes, o.max_abs, o.max_rel) == \
        ("linear1/AddmmBackward0", "shape [3, 3] vs [3, 5]", 0.0, 0.0)
    assert o.describe() == "shape [3, 3] vs [3, 5]" and not o.checksum_only
    assert "│ difference │ shape [3, 3] vs [3, 5] " in text
    weight = next(p for p in r.params if p.name == "0.weight")
    assert (weight.value.abs, weight.value.rel, weight.value.describe()) == (None, None, "shape [3, 4] vs [5, 4]")
    data = r.to_json()
    assert data["backward"]["per_module"]["0"]["max_abs"] == 0.0 and data["backward"]["per_module"]["0"]["shapes_differ"] == 2
    assert "inf" not in json.dumps(data["backward"]["per_module"]) + json.dumps(data["forward"]["per_module"])
    # with a tolerance: beyond it by the shapes, not by a relative difference of inf (or of 0)
    loose = diff(traces["base"], traces["wide"], rtol=1e-3)
    # (linear1 read inputs of other shapes: it did not align, so nothing says its forward matched)
    assert loose.backward.reason == ("gradients in within tolerance, outputs beyond it (shape [3, 3] vs [3, 5]); its "
                                     "forward call did not align: linear1 is only in A's forward, linear1 only in B's")
    assert [(m["module"], m["max_abs"], m["shapes_differ"]) for m in module_table(loose)][-3:] == \
        [("0", 0.0, 2), ("1", 0.0, 1), ("2", 0.0, 2)]


def test_a_shape_mismatch_does_not_win_the_max_abs_column(traces: dict[str, Path], capsys: Any) -> None:
    """Module 2 is Linear(3, 2) in A, Linear(3, 3) in B: some of its tensors differ in shape, others
    in value; the max abs is the largest measured, next to the words."""
    r = diff(traces["base"], traces["extra"])
    m = next(x for x in module_table(r) if x["module"] == "2")
    measured = [row.max_abs for d in (r.forward, r.backward) for row in d.rows
                if row.module == "2" and row.a is not None and row.b is not None and row.max_abs is not None]
    assert m["shapes_differ"] == 2 and math.isfinite(m["max_abs"]) and m["max_abs"] == max(measured) > 0
    assert math.isfinite(m["max_rel"])
    cells = _table(_cli(capsys, str(traces["base"]), str(traces["extra"])), "Per module")["2"]
    assert cells[3:5] == [f"{format_number(m['max_abs'], 3)}, shapes differ", format_number(m["max_rel"], 3)]
    for d in (r.forward, r.backward):
        assert d.largest is None or math.isfinite(d.largest.max_rel or 0.0)


@pytest.mark.browser
def test_the_html_page_says_the_same_counts(traces: dict[str, Path], tmp_path: Path) -> None:
    a, b = tracer.load(str(traces["base"])), tracer.load(str(traces["extra"]))
    path = tmp_path / "diff.html"
    diff_html(diff(a, b), a, b, path)
    with opened(path) as (page, errors):
        assert errors == []
        section = page.locator("section", has_text="Parameters that differ")
        assert section.locator("h2").inner_text() == "Parameters that differ"
        assert section.locator(".note").first.inner_text() == "2 of 2 in both traces; 2 of another shape, 2 only in B"
        modules = page.locator("section", has_text="Per module")
        row = modules.locator("tr", has_text="shapes differ")
        assert row.count() == 1 and row.locator("td").nth(4).inner_text().endswith(", shapes differ")
        assert "inf" not in modules.inner_text()
