"""The NaN report of issue 20: the first NaN and the first Inf of each phase, then counts and a
range of modules; the full list on request (``t.anomalies.full()``, ``summary --all-anomalies``);
the same text in the warning, ``print(t.anomalies)`` and ``gradtrace summary``."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import transformers as tf

import tracer
from export.cli.main import main
from tests.fresh_stack import on_a_fresh_stack
from tracer.model.frames import fold_label, frame_class

HERE = os.path.abspath(__file__)


def _planted_nan(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x - 10.0)  # every element is below 10: NaN everywhere


def _runs(stack: tuple[tracer.Frame, ...]) -> list[str]:
    """The expected stack lines: user frames and the innermost one, each run of others folded."""
    lines: list[str] = []
    run: list[tracer.Frame] = []
    for i, f in enumerate(stack):
        if frame_class(f.file) != "user" and i != len(stack) - 1:
            run.append(f)
            continue
        if run:
            lines.append(f"  ... {fold_label(run)}")
            run = []
        lines += [f'  File "{f.file}", line {f.line}, in {f.function}', f"    {f.code}"]
    return lines


@pytest.fixture(scope="module", name="planted")
def planted_fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[tracer.Trace, str, list[warnings.WarningMessage]]:
    return on_a_fresh_stack(planted, tmp_path_factory)  # the same frames under any test runner


def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[tracer.Trace, str, list[warnings.WarningMessage]]:
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=12, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = tf.GPT2LMHeadModel(cfg)
    model.transformer.h[7].mlp.act.forward = _planted_nan
    ids = torch.arange(8).unsqueeze(0)
    path = str(tmp_path_factory.mktemp("nan") / "gpt2.gtrace")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with tracer.trace(out=path, check_numerics=True) as t:
            model(ids, labels=ids).loss.backward()
    return t, path, [w for w in seen if issubclass(w.category, tracer.NumericsWarning)]


def test_planted_nan_in_a_12_layer_gpt2_is_reported_briefly(planted: tuple[tracer.Trace, str, list[Any]]) -> None:
    t, _, _ = planted
    report = t.anomalies
    fwd, bwd = report.forward_nan, report.backward_nan
    assert fwd is not None and bwd is not None
    assert report.forward_inf is None and report.backward_inf is None
    # The planted line is the innermost frame, and the user's line that ran the model is shown.
    assert fwd.stack[-1].file == HERE and fwd.stack[-1].code == "return torch.sqrt(x - 10.0)  # every element is below 10: NaN everywhere"
    assert [f.function for f in fwd.stack if frame_class(f.file) == "user"] == ["planted", "_planted_nan"]
    # The story: the headline (where the NaN was made, the user's line), its stack, then what it
    # reached as a count and a range, never a list.
    line = _planted_nan.__code__.co_firstlineno + 1
    headline = ("NaN made by sqrt0 (torch.sqrt) in forward, module transformer.h.7.mlp.act — "
                f"test_reading_anomalies.py:{line}: return torch.sqrt(x - 10.0)  # every element is below 10: NaN everywhere")
    assert report.headline is fwd and report.origin is fwd and report.headline_text() == headline
    expected = "\n".join([
        headline,
        *_runs(fwd.stack),
        "  then 1,088 more values with NaN (forward 179, backward 909), in 139 modules, from "
        "transformer.h.7.mlp.c_proj (forward) to transformer.wte (backward)",
    ])
    assert str(report) == expected
    assert len(str(report).splitlines()) == len(expected.splitlines()) < 12
    # the backward's first NaN follows from the forward's: not an origin, and not the headline
    assert bwd.from_forward and not bwd.origin and bwd.order > fwd.order


def test_the_warning_carries_the_same_brief_report(planted: tuple[tracer.Trace, str, list[Any]]) -> None:
    t, _, seen = planted
    assert len(seen) == 1
    assert str(seen[0].message) == "gradtrace: " + str(t.anomalies)


def test_full_lists_every_module_one_a_line(planted: tuple[tracer.Trace, str, list[Any]]) -> None:
    t, _, _ = planted
    full = t.anomalies.full().splitlines()
    fwd, bwd = t.anomalies.forward_nan, t.anomalies.backward_nan
    assert fwd is not None and bwd is not None
    head = full.index("  then 1,088 more values with NaN (forward 179, backward 909), in 139 modules, from "
                      "transformer.h.7.mlp.c_proj (forward) to transformer.wte (backward):")
    modules = full[head + 1: head + 1 + len(t.anomalies.spread.by_module)]
    assert modules[:3] == ["    transformer.h.7.mlp.c_proj (forward): 3", "    transformer.h.7.mlp.dropout (forward): 1",
                           "    transformer.h.7 (forward): 1"]
    assert modules[-1] == "    transformer.wte (backward): 1"
    assert sum(int(m.rsplit(": ", 1)[1]) for m in modules) == 1088
    # then the first of the other phase, in full
    assert full[head + 1 + len(modules)].startswith("first in backward: NaN in backward first at "
                                                    "cross_entropy0/LogSoftmaxBackward0 (LogSoftmaxBackward0), "
                                                    "carried from the values of its forward call")
    # every frame of each stack, none folded
    assert "folded" not in t.anomalies.full()
    assert sum(line.startswith('  File "') for line in full) == len(fwd.stack) + len(bwd.stack)


def test_summary_prints_the_brief_report_and_the_full_list_on_request(
        planted: tuple[tracer.Trace, str, list[Any]], capsys: pytest.CaptureFixture[str]) -> None:
    t, path, _ = planted
    assert main(["summary", path]) == 0
    out = capsys.readouterr().out
    assert str(t.anomalies) in out
    assert "then 1,088 more values with NaN (forward 179, backward 909)" in out
    assert main(["summary", path, "--all-anomalies"]) == 0
    out = capsys.readouterr().out
    assert "to transformer.wte (backward):\n    transformer.h.7.mlp.c_proj (forward): 3\n" in out
    assert "folded" in out  # frames stay folded unless --all-frames
    assert main(["summary", path, "--all-anomalies", "--all-frames"]) == 0
    out = capsys.readouterr().out
    assert t.anomalies.full() in out
