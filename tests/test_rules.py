"""The named rules of the numerics analysis (tracer/analysis/rules.py): one smallest case each,
through ``check_numerics`` (the rule's ``test`` points here), and the registry kept honest: every
rule has its test and docs/api.md lists every rule."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import tracer
from tracer.analysis.rules import RULES, carries_intended_inf, has_inf_constant

ROOT = Path(__file__).resolve().parents[1]


def _checked(fn) -> tracer.NumericsReport:  # type: ignore[no-untyped-def]
    with tracer.check_numerics() as t:
        fn()
    return t.anomalies


def test_inf_constant() -> None:
    assert has_inf_constant("mask, -inf") and has_inf_constant("fill_value=inf") and not has_inf_constant("info=1")
    x = torch.randn(4, 4, requires_grad=True)
    report = _checked(lambda: x.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
                      .sum().backward())
    assert report.clean and report.intended_inf == 1


def test_carries_intended_inf() -> None:
    assert carries_intended_inf([(8, 16)], [(2, 4, True)])  # a mask of 4 broadcast to 16 places
    assert not carries_intended_inf([(1, 1)], [(2, 4, True)])  # a reduction kept one: not carried
    x = torch.randn(3, 4, requires_grad=True)
    far = torch.tensor([[False, False, True, True]])

    def masked() -> torch.Tensor:  # (a mask made in the block: one from outside is data)
        mask = torch.zeros(1, 4).masked_fill(far, float("-inf"))
        return x + mask  # broadcast over 3 rows: 6 Infs from the mask's 2

    report = _checked(lambda: masked().softmax(-1).sum().backward())
    assert report.clean and report.intended_inf == 2  # the mask and the sum that carries it
    kept = _checked(lambda: masked().sum())  # a sum that keeps the -inf: made here, reported
    assert kept.headline is not None and kept.headline.producer == "sum0" and kept.headline.kind == "inf"


def test_integer_output() -> None:
    x = torch.tensor([0.0, 2.0, 4.0])
    report = _checked(lambda: torch.log(x).to(torch.long) + 1)  # log(0) = -inf cast to an integer
    assert report.clean and report.dropped == 1


def test_selection() -> None:
    x = torch.tensor([2.0, -1.0, 0.5], requires_grad=True)
    report = _checked(lambda: torch.where(x > 0, torch.log(x), 0.0).sum().backward())
    assert report.clean and report.dropped == 1


def test_softmax_of_mask() -> None:
    # two finfo.min masks added overflow to -inf where the softmax masks anyway (GPT-Neo)
    lo = torch.finfo(torch.float32).min
    scores = torch.randn(2, 4, requires_grad=True)
    m = torch.tensor([[0.0, 0.0, lo, lo], [0.0, lo, lo, lo]])
    report = _checked(lambda: ((scores.masked_fill(m < 0, lo) + m).softmax(-1) * 1.0).sum().backward())
    assert report.clean and report.dropped >= 1


def test_dropped_in_turn() -> None:
    x = torch.tensor([0.0, 2.0])
    def step() -> None:
        bucket = torch.log(x).to(torch.long)  # -inf cast, then the integer bucket selected away
        torch.where(bucket > 0, bucket, 0).sum()
    report = _checked(step)
    assert report.clean and report.dropped == 1


def test_selection_in_backward() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    # relu gives 0 almost everywhere, sqrt's gradient at 0 is +Inf, relu's backward zeroes it there
    report = _checked(lambda: (torch.sqrt(torch.relu(x @ w - 100)).sum() + (x @ w).pow(2).mean()).backward())
    assert w.grad is not None and bool(torch.isfinite(w.grad).all())
    assert report.clean and report.dropped == 1
    # An Inf gradient an accumulator keeps in .grad is reported: nothing selected it away.
    leaf = torch.zeros(3, requires_grad=True)
    kept = _checked(lambda: torch.sqrt(leaf).sum().backward())
    assert kept.headline is not None and kept.headline.producer == "sqrt0/SqrtBackward0"


def test_every_rule_has_its_test_here_and_a_line_in_the_docs() -> None:
    defined = {n.name for n in ast.parse(Path(__file__).read_text()).body if isinstance(n, ast.FunctionDef)}
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    names = [r.name for r in RULES]
    assert len(set(names)) == len(names)
    for rule in RULES:
        path, _, function = rule.test.partition("::")
        assert path == "tests/test_rules.py" and function in defined, rule.name
        assert function == "test_" + rule.name.replace("-", "_"), rule.name
        assert rule.matches and rule.admitted_by
        assert f"`{rule.name}`" in api, f"docs/api.md does not list the rule {rule.name}"


def test_a_value_written_into_lasting_state_is_never_dropped() -> None:
    """A NaN the step writes into a buffer stays in the model after the step, however this step
    reads it (here only through nan_to_num, which the selection rule drops): reported, with
    the op that made it. A -inf mask kept as a buffer from before the block is data the step
    reads: dropped by softmax as before."""
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.register_buffer("s", torch.zeros(4))
            self.register_buffer("mask", torch.full((3, 3), float("-inf")).triu(1), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            with torch.no_grad():
                self.s.copy_(torch.sqrt(h.mean(0) - 5))
            h = (h @ x.T + self.mask).softmax(-1) @ h
            return h * self.s.nan_to_num(0.0).sum()

    m, x = Model(), torch.randn(3, 4)
    report = _checked(lambda: m(x).sum().backward())
    assert torch.isnan(m.s).all()
    first = report.headline
    assert first is not None and first.kind == "nan" and first.producer == "sqrt0" and first.phase == "forward"
    assert report.dropped == 2  # the mask and its sum with the scores, selected away by the softmax
