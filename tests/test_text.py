"""The canonical text form (export.text.to_text) against inline expected text.

The models use small multiples of 1/2 for weights and inputs: every product and sum is exact in
float32, so the bytes (and MD5s) are the same on any CPU and any BLAS.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.nn as nn

import tracer
from export.text import to_text


class StraightClamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-2.0, 2.0)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class Outer(torch.autograd.Function):
    """Applies Double inside its forward and inside its backward (nesting both ways)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return Double.apply(x) + 1

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return Double.apply(g)


def halves(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=gen) / 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.inner = nn.Sequential(nn.ReLU())
        with torch.no_grad():
            self.fc.weight.copy_(halves(3, 4, seed=0))
            self.fc.bias.copy_(halves(3, seed=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(StraightClamp.apply(self.fc(x)))


def record_net(**kwargs) -> tuple[tracer.Trace, Net, torch.Tensor]:
    net, x = Net(), halves(2, 4, seed=2)
    with tracer.trace(**kwargs) as t:
        loss = net(x).sum()
        loss.backward()
    return t, net, x


FN = f"{__name__}.StraightClamp.apply"

EXPECTED = f"""\
  linear0  F.linear  fc  (input0, fc.weight, fc.bias) -> linear0:out f32[2,3] 814aa590
StraightClamp0  {FN}  -  (linear0:out) -> StraightClamp0:out f32[2,3] e7702b03
  clamp0  Tensor.clamp  -  (linear0:out) -> clamp0:out f32[2,3] e7702b03
    relu0  F.relu  inner.0  (StraightClamp0:out) -> relu0:out f32[2,3] 0b432eae
sum0  Tensor.sum  -  (relu0:out) -> sum0:out f32[] d9d0cc23
backward0  Tensor.backward  (sum0:out)
backward0  sum0/SumBackward0  <- sum0:out@grad -> relu0:out@grad f32[2,3] bbec5b7e
backward0  relu0/ReluBackward0  <- relu0:out@grad -> StraightClamp0:out@grad f32[2,3] 431b43b3
backward0  StraightClamp0/StraightClampBackward  <- StraightClamp0:out@grad -> linear0:out@grad f32[2,3] 431b43b3
backward0  linear0/AddmmBackward0  <- linear0:out@grad -> fc.bias@grad f32[3] 7435400a, -, linear0/AddmmBackward0:grad2 f32[4,3] 8334fe91
backward0  fc.bias/AccumulateGrad  <- fc.bias@grad -> -
backward0  linear0/TBackward0  <- linear0/AddmmBackward0:grad2 -> fc.weight@grad f32[3,4] 980354c2
backward0  fc.weight/AccumulateGrad  <- fc.weight@grad -> -
"""


def test_text_of_small_model_is_exact():
    t, _, _ = record_net()
    assert to_text(t) == EXPECTED


def test_text_without_hashes_or_backward():
    t, _, _ = record_net()
    assert to_text(t, hashes=False, backward=False) == f"""\
  linear0  F.linear  fc  (input0, fc.weight, fc.bias) -> linear0:out f32[2,3]
StraightClamp0  {FN}  -  (linear0:out) -> StraightClamp0:out f32[2,3]
  clamp0  Tensor.clamp  -  (linear0:out) -> clamp0:out f32[2,3]
    relu0  F.relu  inner.0  (StraightClamp0:out) -> relu0:out f32[2,3]
sum0  Tensor.sum  -  (relu0:out) -> sum0:out f32[]
"""
    # Without hashes the text comes from shapes alone: it is the same for a hash='none' trace
    # that records every node's run.
    t_none, _, _ = record_net(hash="none", node_runs=True)
    assert to_text(t_none, hashes=False) == to_text(t, hashes=False)
    assert " -\n" in to_text(t_none, backward=False)  # unhashed outputs show '-'
    # By default such a trace records the runs of the accumulators and the custom Function only.
    lean, _, _ = record_net(hash="none")
    assert to_text(lean, hashes=False, backward=False) == to_text(t, hashes=False, backward=False)
    assert [line.split()[1] for line in to_text(lean, hashes=False).splitlines()[6:]] == \
        [n for n in t.backward_runs[0].order if "AccumulateGrad" in n or "StraightClamp" in n]
    assert "backward0  StraightClamp0/StraightClampBackward  <- StraightClamp0:out@grad -> linear0:out@grad f32[2,3]" \
        in to_text(lean, hashes=False)


def test_short_hashes_are_md5_prefixes_of_the_real_tensors():
    t, net, x = record_net()
    with torch.no_grad():
        lin = net.fc(x)
        expected = {"linear0:out": lin, "clamp0:out": lin.clamp(-2, 2), "relu0:out": lin.clamp(-2, 2).relu()}
    text = to_text(t)
    for name, value in expected.items():
        digest = hashlib.md5(value.contiguous().view(torch.uint8).numpy()).hexdigest()
        assert t.tensors[name].md5 == digest
        assert f"-> {name} f32[2,3] {digest[:8]}" in text
    grad = hashlib.md5(net.fc.weight.grad.view(torch.uint8).numpy()).hexdigest()
    assert f"fc.weight@grad f32[3,4] {grad[:8]}" in text


def test_text_is_deterministic_and_survives_save_and_load(tmp_trace):
    t1, _, _ = record_net()
    t2, _, _ = record_net()
    assert to_text(t1) == to_text(t2)
    t1.save(tmp_trace)
    assert to_text(tracer.load(tmp_trace)) == to_text(t1)
    text = to_text(t1)
    assert os.getcwd() not in text and os.path.dirname(__file__) not in text


def test_nested_functions_indent_and_backward_phase_calls():
    x = halves(2, 2, seed=3).requires_grad_()
    with tracer.trace() as t:
        y = Outer.apply(x)
        y.sum().backward()
    lines = to_text(t, hashes=False).splitlines()
    outer, double_fwd = f"{__name__}.Outer.apply", f"{__name__}.Double.apply"
    assert lines[:4] == [
        f"Outer0  {outer}  -  (input0) -> Outer0:out f32[2,2]",
        f"  Double0  {double_fwd}  -  (input0) -> Double0:out f32[2,2]",
        "    mul0  Tensor.mul  -  (input0) -> mul0:out f32[2,2]",
        "  add0  Tensor.add  -  (Double0:out) -> add0:out f32[2,2]",
    ]
    # Double applied inside Outer's backward is a call made by the running grad node, and the op
    # inside it a call nested in Double1.
    i = lines.index(f"Double1  {double_fwd}  -  (Outer0:out@grad) -> Double1:out f32[2,2]  "
                    "[in backward of Outer0/OuterBackward]")
    assert lines[i + 1] == "  mul1  Tensor.mul  -  (Outer0:out@grad) -> mul1:out f32[2,2]"
    # What it returns flows alone into input0's accumulator: input0's gradient.
    assert "backward0  Outer0/OuterBackward  <- Outer0:out@grad -> input0@grad f32[2,2]" in lines


def test_failed_trace_ends_with_status_line():
    net, x = Net(), halves(2, 4, seed=2)
    with pytest.raises(ValueError, match="boom"), tracer.trace() as t:
        net(x)
        raise ValueError("boom")
    text = to_text(t, hashes=False)
    assert text.splitlines()[-1] == "status failed: ValueError: boom"
    assert text.splitlines()[0] == "  linear0  F.linear  fc  (input0, fc.weight, fc.bias) -> linear0:out f32[2,3]"


def test_a_trace_with_a_nan_says_where_it_started():
    x = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    with pytest.warns(tracer.NumericsWarning), tracer.check_numerics() as t:
        torch.log(x - 10).sum().backward()
    assert to_text(t).splitlines() == [
        "sub0  Tensor.sub  -  (input0) -> sub0:out f32[3] -",
        "log0  torch.log  -  (sub0:out) -> log0:out f32[3] - nan=3 inf=0",
        "sum0  Tensor.sum  -  (log0:out) -> sum0:out f32[] - nan=1 inf=0",
        "backward0  Tensor.backward  (sum0:out)",
        "backward0  sum0/SumBackward0  <- sum0:out@grad -> log0:out@grad f32[3] -",
        "backward0  log0/LogBackward0  <- log0:out@grad -> sub0:out@grad f32[3] -",
        "backward0  sub0/SubBackward0  <- sub0:out@grad -> input0@grad f32[3] -, -",
        "backward0  input0/AccumulateGrad  <- input0@grad -> -",
        "NaN made by log0 (torch.log) in forward, module <root> — test_text.py:184: torch.log(x - 10).sum().backward()",
        "  then 1 more value with NaN, in <root> (forward)",
    ]
