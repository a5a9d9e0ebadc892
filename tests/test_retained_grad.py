"""A non-leaf tensor's retained gradient (``Tensor.retain_grad`` in the block) is named after the
tensor (``<t>.grad``, then ``<t>.grad@v<k>``), in lean and full traces alike, with the checksum of
the bytes the engine stored; it was an anonymous ``input<i>`` when code read it."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

import tracer
from tests.models import hf_model
from tracer.model import Trace

LEAN = {"hash": "none"}
MD5 = {"hash": "md5"}
FULL_RUNS = {"hash": "md5", "node_runs": True}


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _call(t: Trace, name: str) -> Any:
    return next(c for c in t.calls if c.name == name)


def _two_backwards(**options: Any) -> tuple[Trace, list[torch.Tensor]]:
    w = torch.randn(3, requires_grad=True)
    seen: list[torch.Tensor] = []
    with tracer.trace(**options) as t:
        y = w.sin()
        y.retain_grad()
        y.register_hook(lambda g: g * 10)
        (y * 2).sum().backward(retain_graph=True)
        assert y.grad is not None
        seen.append(y.grad.clone())
        a = y.grad * 3
        (y * 5).sum().backward()  # adds into y.grad: a new tensor, the sum
        seen.append(y.grad.clone())
        b = y.grad + 1
    del a, b
    return t, seen


@pytest.mark.parametrize("options", [LEAN, MD5, FULL_RUNS], ids=["lean", "md5", "md5-node-runs"])
def test_retained_grad_is_named_after_its_tensor_in_every_run(options: dict[str, Any]) -> None:
    t, seen = _two_backwards(**options)
    # The code that reads y.grad reads a named gradient, not an input from outside.
    assert _call(t, "mul2").inputs == ["sin0:out.grad"]
    assert _call(t, "add0").inputs == ["sin0:out.grad@v1"]
    first, second = t.tensors["sin0:out.grad"], t.tensors["sin0:out.grad@v1"]
    assert (first.role, first.producer, first.previous) == ("grad", "backward0", None)
    assert (second.role, second.producer, second.previous) == ("grad", "backward1", "sin0:out.grad")
    assert not [n for n in t.tensors if n.startswith("input") and n != "input0" and "@grad" not in n]
    if options["hash"] == "md5":
        # The stored copy is of the gradient after y's hook (10 x 2), then the sum of both runs.
        assert first.md5 == _md5(seen[0]) == _md5(torch.full((3,), 20.0))
        assert second.md5 == _md5(seen[1]) == _md5(torch.full((3,), 70.0))


def test_lean_and_full_traces_give_the_retained_grad_the_same_names() -> None:
    lean, _ = _two_backwards(**LEAN)
    full, _ = _two_backwards(**FULL_RUNS)
    names = [n for n in lean.tensors if ".grad" in n]
    assert names == ["sin0:out.grad", "sin0:out.grad@v1"]
    assert names == [n for n in full.tensors if ".grad" in n]
    assert [c.inputs for c in lean.calls] == [c.inputs for c in full.calls]


def test_retained_grad_changed_in_place_gets_the_next_version() -> None:
    w = torch.randn(4, requires_grad=True)
    with tracer.trace(hash="md5") as t:
        y = w * 3
        y.retain_grad()
        y.sum().backward(retain_graph=True)
        assert y.grad is not None
        y.grad.mul_(0.5)  # the user scales the stored gradient
        z = y.grad.sum()
        (y * 2).sum().backward()  # adds into the scaled .grad: the next value follows the scaled one
    scaled = _call(t, "mul_0")
    assert scaled.inputs == ["mul0:out.grad"] and scaled.mutated == ["mul0:out.grad@v1"]
    assert _call(t, "sum1").inputs == ["mul0:out.grad@v1"]
    assert t.tensors["mul0:out.grad@v1"].md5 == _md5(torch.full((4,), 0.5))
    summed = t.tensors["mul0:out.grad@v2"]
    assert (summed.previous, summed.producer) == ("mul0:out.grad@v1", "backward1")
    assert summed.md5 == _md5(torch.full((4,), 2.5))
    del z


def test_leaf_retain_grad_keeps_the_accumulator_name_and_a_dead_tensor_is_forgotten() -> None:
    w = torch.randn(3, requires_grad=True)
    with tracer.trace(hash="none") as t:
        w.retain_grad()  # a leaf: a no-op in torch, its .grad is the accumulator's
        h = w.exp()
        h.retain_grad()
        del h  # gone before any backward: nothing to name
        (w * 2).sum().backward()
        g = w.grad * 1
    assert _call(t, "mul1").inputs == ["input0@grad"]
    assert not [n for n in t.tensors if n.endswith(".grad")]
    del g


def test_retained_hidden_state_of_a_transformers_model() -> None:
    """The usual debugging move: keep the gradient of a hidden state and look at its norm."""
    torch.manual_seed(0)
    model, x = hf_model("gpt2")
    with tracer.trace(hash="md5") as t:
        out = model(input_ids=x, labels=x, output_hidden_states=True)
        hidden = out.hidden_states[1]  # after the first block
        hidden.retain_grad()
        out.loss.backward()
        assert hidden.grad is not None
        norm = hidden.grad.norm()
    norm_call = t.calls[-1]
    assert norm_call.api == "Tensor.norm"
    (grad_name,) = norm_call.inputs
    # Named after the hidden state: a recorded output of the first block holding its bytes.
    assert grad_name.endswith(".grad")
    base = t.tensors[grad_name.removesuffix(".grad")]
    assert base.md5 == _md5(hidden) and base.shape == tuple(hidden.shape)
    assert next(c for c in t.calls if c.name == base.producer).module == "transformer.h.0"
    rec = t.tensors[grad_name]
    assert rec.role == "grad" and rec.producer == "backward0"
    assert rec.md5 == _md5(hidden.grad)
    del norm
