"""Gradients the program assigns (``p.grad = torch.stack(worker_grads).mean(0)``, as parameter
server and hand-made all-reduce loops do) are named ``<param>@grad`` as every other ``.grad``:
by whoever reads them first (clipping, the optimizer), with the assigned value's checksum."""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

import tracer


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def test_assigned_gradients_are_the_parameters_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    workers = [[torch.randn(1, 4), torch.randn(1)] for _ in range(3)]
    seen: list[str] = []
    with tracer.trace(hash="md5") as t:
        for step in range(2):
            for p, grads in zip(model.parameters(), zip(*workers)):
                p.grad = torch.stack(grads).mean(0) * (step + 1)
            seen.append(_md5(model.weight.grad))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
    steps = [c for c in t.calls if c.kind == "optimizer"]
    clips = [c for c in t.calls if c.api == "torch._foreach_norm"]
    # Step 0: the model is not named yet when clipping reads the gradients (its first use is the
    # optimizer's): clipping reads mul0:out, which it scales in place, and the optimizer reads
    # that value as weight@grad.
    assert steps[0].inputs == ["weight", "weight@grad", "bias", "bias@grad"]
    clipped = t.tensors[clips[0].inputs[0]].name + "@v1"
    assert t.tensors["weight@grad"].md5 == t.tensors[clipped].md5
    # Step 1: clipping reads the assigned value as weight@grad@v1, scales it in place (@v2), and
    # the optimizer reads that.
    assert clips[1].inputs == ["weight@grad@v1", "bias@grad@v1"]
    assert t.tensors["weight@grad@v1"].md5 == seen[1]
    assert t.tensors["weight@grad@v1"].producer == "mul2"  # (step 0 made mul0, mul1)
    assert steps[1].inputs == ["weight@v1", "weight@grad@v2", "bias@v1", "bias@grad@v2"]
    assert t.tensors["weight@grad@v2"].md5 == _md5(model.weight.grad)


def test_a_gradient_clamped_in_place_keeps_its_role() -> None:
    # clip_grad_value_ clamps each .grad in place (_foreach_clamp_min_/_max_): the new versions
    # are the parameters' gradients still, not the clamp's outputs.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(hash="md5") as t:
        model(torch.randn(2, 4)).sum().backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        opt.step()
    written = {n: r for n, r in t.tensors.items() if n.startswith(("weight@grad@v", "bias@grad@v"))}
    assert sorted(written) == ["bias@grad@v1", "bias@grad@v2", "weight@grad@v1", "weight@grad@v2"]
    assert {r.role for r in written.values()} == {"grad"}
    assert written["weight@grad@v2"].producer.startswith("_foreach_clamp_max_")
    assert written["weight@grad@v2"].md5 == _md5(model.weight.grad)
    assert t.calls[-1].inputs == ["weight", "weight@grad@v2", "bias", "bias@grad@v2"]
