"""Where ``check_numerics`` says a NaN or Inf started, on faults that hide behind an intended Inf
or turn into NaN one op later, and on a NaN made inside a nested custom Function's backward:
the report, ``raise_on_nonfinite`` and the saved trace name the op and the line that made it.
And masks that are meant (-inf over heads, ``where``) stay quiet."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer
from tracer.analysis.numerics import Anomaly, carries_intended_inf


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracer.NumericsWarning)
        yield


def _line_of(fn: Callable[..., object], marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def _raised(step: Callable[[], object]) -> Anomaly:
    with pytest.raises(tracer.NonFiniteError) as info, tracer.check_numerics(raise_on_nonfinite=True):
        step()
    return info.value.anomaly


def test_an_inf_loss_from_a_masked_target_logit_is_reported_where_it_is_made() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    x = torch.randn(3, 4)
    allowed = torch.tensor([True, False, True, True, True])
    target = torch.tensor([1, 0, 2])  # sample 0's class is masked out

    def step() -> None:
        logits = model(x).masked_fill(~allowed, float("-inf"))
        loss = F.cross_entropy(logits, target)  # loss: +inf
        loss.backward()

    with tracer.check_numerics() as t:
        step()
    a = t.anomalies.forward
    assert a is not None and (a.what, a.producer, a.origin) == ("Inf", "cross_entropy0", True)
    assert a.stack[-1].line == _line_of(step, "loss: +inf")
    assert t.anomalies.intended_inf == 1  # the mask itself
    raised = _raised(step)
    assert (raised.producer, raised.what) == ("cross_entropy0", "Inf")


def test_an_inf_that_turns_into_nan_is_the_headline() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def step() -> None:
        h = model(x)
        y = h / torch.zeros(3, 1)  # the fault: +/-inf
        (y - y.flip(0)).sum().backward()  # inf - inf: NaN

    with tracer.check_numerics() as t:
        step()
    report = t.anomalies
    assert report.forward is report.forward_inf
    assert (report.forward.producer, report.forward.origin) == ("div0", True)
    assert report.forward.stack[-1].line == _line_of(step, "the fault")
    nan = report.forward_nan
    assert nan is not None and not nan.origin and nan.bad_inputs  # propagated from the Inf
    assert str(report).startswith("Inf made by div0 (Tensor.div) in forward, module <root> — test_numerics_truth.py:")
    assert report.headline is report.forward_inf
    assert report.anomalies()[0] is report.forward_inf


def test_an_inf_made_in_backward_is_the_backward_headline() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def step() -> None:
        h = model(x)
        y = torch.sqrt(torch.relu(h) * 0)  # finite, its backward: inf
        (y + h).sum().backward()

    with tracer.check_numerics() as t:
        step()
    b = t.anomalies.backward
    assert b is not None and (b.what, b.producer_kind, b.origin) == ("Inf", "SqrtBackward0", True)
    assert b.stack[-1].line == _line_of(step, "its backward: inf")


def test_an_overflow_beside_an_intended_mask_is_reported() -> None:
    torch.manual_seed(0)
    q = (torch.randn(1, 4, 8) * 150).half()
    k = (torch.randn(1, 4, 8) * 150).half()

    def step() -> None:
        mask = torch.zeros(1, 4, 4, dtype=torch.half).masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
        scores = torch.baddbmm(mask, q, k.transpose(1, 2))  # fp16 overflow
        torch.softmax(scores.float(), -1)

    with tracer.check_numerics() as t:
        step()
    a = t.anomalies.forward
    assert a is not None and (a.what, a.producer, a.origin, a.bad_inputs) == ("Inf", "baddbmm0", True, [])
    assert a.stack[-1].line == _line_of(step, "fp16 overflow")
    assert _raised(step).producer == "baddbmm0"


def test_raise_mode_and_the_report_agree_on_an_inf_from_outside_beside_a_mask() -> None:
    bias = torch.zeros(3, 4)
    bias[2, 3] = float("inf")  # bad data from outside the block
    w = torch.randn(3, 4, requires_grad=True)

    def step() -> None:
        s = w.masked_fill(torch.eye(3, 4, dtype=torch.bool), float("-inf"))
        y = s + bias  # the unintended +inf arrives
        y.exp().sum().backward()

    with tracer.check_numerics() as t:
        step()
    a = t.anomalies.forward
    assert a is not None and (a.producer, a.origin) == ("add0", False) and len(a.bad_inputs) == 1
    raised = _raised(step)
    assert (raised.phase, raised.producer) == ("forward", "add0")
    assert raised.stack[-1].line == _line_of(step, "unintended +inf arrives")


class Inner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return g * torch.log(x - 100)  # NaN made here


class Outer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            y = Inner.apply(xd)
        ctx.xd, ctx.y = xd, y
        return y.detach()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (gx,) = torch.autograd.grad(ctx.y, ctx.xd, g)
        return gx


def test_a_nan_inside_a_run_that_a_custom_backward_started_is_named_there(tmp_path: Path) -> None:
    x = torch.randn(4, requires_grad=True)
    with tracer.check_numerics() as t:
        Outer.apply(x).sum().backward()
    runs = {r.name: r for r in t.backward_runs}
    assert runs["grad0"].parent == "Outer0/OuterBackward" and runs["backward0"].parent is None
    line = _line_of(Inner.backward, "NaN made here")
    t.save(tmp_path / "t.gtrace")
    for trace in (t, tracer.load(tmp_path / "t.gtrace")):
        b = trace.anomalies.backward
        assert b is not None and (b.producer, b.node, b.origin) == ("log0", "Inner0/InnerBackward", True)
        assert b.stack[-1].line == line
    assert tracer.load(tmp_path / "t.gtrace").backward_runs[1].parent == "Outer0/OuterBackward"
    raised = _raised(lambda: Outer.apply(x).sum().backward())
    assert (raised.producer, raised.stack[-1].line) == ("log0", line)


def test_masks_meant_as_masks_stay_quiet() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    x = torch.randn(2, 5, 8)
    keep = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])

    def step() -> None:  # (masks made in the block: an Inf from outside is data, reported)
        causal = torch.full((5, 5), float("-inf")).triu(1)
        pad = torch.zeros(2, 5).masked_fill(~keep, float("-inf"))
        q = model(x).view(2, 1, 5, 8).expand(2, 4, 5, 8)  # 4 heads
        scores = q @ q.transpose(-1, -2) + causal + pad[:, None, None, :]  # masks broadcast over heads
        att = scores.softmax(-1)
        lse = torch.where(scores > 0, scores, float("-inf")).logsumexp(-1)  # rows may be all -inf
        (att.sum() + torch.nan_to_num(lse, neginf=0.0).sum()).backward()

    with tracer.check_numerics() as t:
        step()
    assert t.anomalies.clean and t.anomalies.intended_inf > 0
    with tracer.check_numerics(raise_on_nonfinite=True):
        step()


def test_the_rule_for_infs_carried_on() -> None:
    assert carries_intended_inf([(8, 16)], [(2, 4, True)])  # a mask of 4 broadcast to 16
    assert not carries_intended_inf([(9, 16)], [(2, 4, True)])  # one more: made here
    assert not carries_intended_inf([(1, 1)], [(2, 4, True)])  # a reduction that kept one
    assert carries_intended_inf([(1, 1)], [(1, 1, True)])  # a scalar carried on
    assert not carries_intended_inf([(2, 4)], [(2, 4, True), (1, 4, False)])  # an unintended input
    assert not carries_intended_inf([(2, 4)], [])  # from finite inputs


def test_values_that_no_later_value_keeps_are_not_anomalies() -> None:
    # T5's relative position buckets: log(0) = -inf, cast to integers, then where() throws it
    # away. And the idiom where(x > 0, log(x), 0). Made, never kept: not reported (counted).
    import transformers as tf

    torch.manual_seed(0)
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(num_layers=1, num_decoder_layers=1, d_model=16, d_ff=32,
                                                   d_kv=8, num_heads=2, vocab_size=50, decoder_start_token_id=0,
                                                   pad_token_id=0))
    ids = torch.randint(1, 50, (2, 6))
    with tracer.check_numerics() as t:
        t5(input_ids=ids, labels=ids).loss.backward()
    report = t.anomalies
    assert report.clean and report.dropped >= 3  # log, div, mul of each attention's buckets
    assert str(report).startswith(f"numerics: no NaN or unintended Inf kept among {report.checked} checked tensors")
    assert "that no later value keeps: cast to integers, selected away or masked by a softmax" in str(report)
    assert report.to_json()["dropped"] == report.dropped

    x = torch.tensor([2.0, -1.0, 0.5, -3.0], requires_grad=True)
    with tracer.check_numerics() as t:
        y = torch.where(x > 0, torch.log(x), 0.0)
        y.sum().backward()
    assert t.anomalies.clean and t.anomalies.dropped == 1

    def kept() -> None:
        z = torch.exp(torch.log(x.detach() - 1))  # log's NaN reaches exp's output: kept
        z.sum()

    with tracer.check_numerics() as t:
        kept()
    a = t.anomalies.forward
    assert a is not None and (a.producer, a.origin) == ("log0", True) and t.anomalies.dropped == 0


def test_raise_mode_stops_where_a_value_is_made_even_one_dropped_later() -> None:
    # Documented: raise_on_nonfinite cannot see ahead; it stops at log(0) in T5's buckets.
    x = torch.tensor([2.0, 0.0])
    with pytest.raises(tracer.NonFiniteError) as info, tracer.check_numerics(raise_on_nonfinite=True):
        torch.log(x).to(torch.long)
    assert info.value.anomaly.producer == "log0"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_inf_loss_from_a_masked_target_logit_on_the_gpu() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 5).cuda()
    x = torch.randn(3, 4, device="cuda")
    allowed = torch.tensor([True, False, True, True, True], device="cuda")
    target = torch.tensor([1, 0, 2], device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).float().masked_fill(~allowed, float("-inf"))
        F.cross_entropy(logits, target).backward()

    with tracer.check_numerics() as t:
        step()
    a = t.anomalies.forward
    assert a is not None and (a.what, a.producer, a.origin) == ("Inf", "cross_entropy0", True)
    assert _raised(step).producer == "cross_entropy0"


def test_two_finfo_min_masks_that_overflow_where_softmax_masks_are_not_anomalies() -> None:
    # GPT-Neo's attention: where(causal, w, finfo.min) plus a finfo.min padding mask overflows to
    # -inf at the masked positions, which softmax turns into 0. A +inf there is still NaN.
    torch.manual_seed(0)
    w = torch.randn(2, 4, 4, requires_grad=True)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    low = torch.finfo(torch.float32).min
    with tracer.check_numerics() as t:
        scores = torch.where(causal, w, torch.tensor(low))
        mask = torch.zeros(2, 1, 4).masked_fill(torch.tensor([[[False, False, False, True]]]), low)
        (scores + mask).softmax(-1).sum().backward()
    assert t.anomalies.clean and t.anomalies.dropped == 1
    with tracer.check_numerics() as t:
        (w + torch.full((2, 4, 4), torch.finfo(torch.float32).max) * 2).softmax(-1).sum()
    assert t.anomalies.forward is not None and t.anomalies.forward.what == "Inf"
