"""Parameters met before any module of their model has run in the block (weight clipping before
the forward, an initialisation or a write under ``no_grad`` first, a block that starts with
``optimizer.step()``) are named by their model, not ``input<k>`` (tracer/record/owners.py)."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn as nn

import tracer
from tracer.record import owners


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_parameters_written_before_the_forward_are_named_by_their_model():
    torch.manual_seed(0)
    critic = Critic()
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with tracer.trace(hash="md5") as t:
        with torch.no_grad():
            critic.a.weight[0] = 0.0  # written before the model runs
            critic.a.bias.zero_()
            for p in critic.parameters():
                p.clamp_(-0.1, 0.1)  # weight clipping (WGAN)
        critic(x).mean().backward()
        opt.step()
    assert [c.inputs[0] for c in t.calls[:3]] == ["a.weight", "a.bias", "a.weight@v1"]
    assert not [n for n in t.tensors if n.startswith("input") and n != "input0"]  # x alone
    assert t["linear0"].inputs == ["input0", "a.weight@v2", "a.bias@v2"]
    step = next(c for c in t.calls if c.kind == "optimizer")
    assert step.inputs == ["a.weight@v2", "a.weight@grad", "a.bias@v2", "a.bias@grad",
                           "b.weight@v1", "b.weight@grad", "b.bias@v1", "b.bias@grad"]
    assert t.tensors["a.weight@v3"].md5 == _md5(critic.a.weight)
    assert t.tensors["b.bias@grad"].md5 == _md5(critic.b.bias.grad)  # type: ignore[arg-type]
    assert t.modules == {"": "Critic", "a": "Linear", "b": "Linear"}


def test_a_block_that_starts_with_the_optimizer_step_names_its_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    model(x).sum().backward()  # gradients from before the block
    with tracer.trace(hash="md5") as t:
        opt.step()
        opt.zero_grad()
        model(x).sum().backward()
    step = next(c for c in t.calls if c.kind == "optimizer")
    assert step.inputs[:2] == ["0.weight", "0.weight@grad"]  # a .grad first met by the optimizer
    assert step.outputs[0] == "0.weight@v1"
    assert t["linear0"].inputs[1:] == ["0.weight@v1", "0.bias@v1"]
    assert "2.weight@grad" in t.tensors and not any(n.startswith("input1") for n in t.tensors)


def test_the_outermost_module_names_them_and_one_search_serves_later_traces(monkeypatch: pytest.MonkeyPatch):
    """The model is the module the user calls: a wrapper around the network (as DDP wraps it)
    names the parameters with its path. A loop that traces every step searches once."""
    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    torch.manual_seed(0)
    net = Wrapper(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1)))
    searches: list[int] = []
    search = owners._search_all
    monkeypatch.setattr(owners, "_search_all", lambda: searches.append(1) or search())
    x = torch.randn(2, 3)
    for _ in range(3):
        with tracer.trace(hash="none") as t:
            with torch.no_grad():
                net.module[0].weight.mul_(0.9)
            net(x).sum().backward()
        assert t["mul_0"].inputs == ["module.0.weight"] and t["linear0"].inputs[1] == "module.0.weight@v1"
    assert len(searches) == 1


def test_a_parameter_of_no_module_stays_an_input():
    w = nn.Parameter(torch.randn(3))
    with tracer.trace(hash="none") as t:
        with torch.no_grad():
            w.add_(1.0)
        (w * 2).sum().backward()
    assert t["add_0"].inputs == ["input0"] and "input0@grad" in t.tensors


def test_a_model_built_inside_the_block_keeps_its_module_paths():
    """A module's __init__ initialises its parameters before it is attached to its model: no
    root is looked for then (the half-built Linear would have become a root of its own, and its
    path, "Linear#1", would have stuck for the whole trace)."""
    with tracer.trace(hash="none") as t:
        torch.manual_seed(0)
        critic = Critic()
        critic(torch.randn(2, 4)).sum().backward()
    assert t.modules == {"": "Critic", "a": "Linear", "b": "Linear"}
    assert [c.module for c in t.calls if c.api == "torch.nn.functional.linear"] == ["a", "b"]


def test_standalone_parameters_are_searched_for_once(monkeypatch: pytest.MonkeyPatch):
    """A functional model of parameters no module holds: the first search finds that none does,
    and later traces do not search again."""
    searches: list[int] = []
    search = owners._search_all
    monkeypatch.setattr(owners, "_search_all", lambda: searches.append(1) or search())
    ws = [nn.Parameter(torch.randn(3, 3)) for _ in range(3)]
    x = torch.randn(2, 3)
    for _ in range(2):
        with tracer.trace(hash="none") as t:
            with torch.no_grad():
                for w in ws:
                    w.mul_(0.9)
            h = x
            for w in ws:
                h = torch.tanh(h @ w)
            h.sum().backward()
        assert [c.inputs[0] for c in t.calls[:3]] == ["input0", "input1", "input2"]
    assert len(searches) == 1
