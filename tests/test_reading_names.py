"""A gradient the engine summed (tied weights, a tensor used twice) lists the edges it is the sum
of, in ``show`` too, instead of "made outside the traced block"."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from rich.console import Console

import tracer
from export.summary import render_record
from tracer.model.gradients import GradientEdge, summed_from


def test_a_gradient_summed_from_two_edges_lists_them() -> None:
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    with tracer.trace() as t:
        (lin(x) + x).sum().backward()
    # x feeds linear0 and add0: its gradient is the engine's sum of both edges
    assert summed_from(t, "input0@grad") == [GradientEdge("add0/AddBackward0", "add0/AddBackward0:grad1"),
                                             GradientEdge("linear0/AddmmBackward0", "linear0/AddmmBackward0:grad1")]
    assert summed_from(t, "bias@grad") == []  # one edge: returned by linear0/AddmmBackward0 itself
    assert summed_from(t, "no such tensor") == []


def test_tied_weight_gradient_lists_the_edges_it_sums() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 50, (2, 8))
    with tracer.trace() as t:
        model(ids, labels=ids).loss.backward()
    name = "transformer.wte.weight@grad"
    edges = summed_from(t, name)
    assert [e.node.split("/")[1] for e in edges] == ["TBackward0", "EmbeddingBackward0"]
    assert all(t.tensors[e.name].producer == e.node for e in edges)
    # one name for the parameter's gradient: no second tensor holds the same bytes
    same = [n for n, r in t.tensors.items() if r.md5 == t.tensors[name].md5]
    assert same == [name]
    out = io.StringIO()
    render_record(t, name, Console(file=out, width=200))
    text = out.getvalue()
    assert f"sum of 2 gradients: {edges[0].name}, {edges[1].name}" in text
    assert "made outside the traced block" not in text


def md5_of(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().numpy().tobytes()).hexdigest()


def test_a_gradient_passed_on_unchanged_is_named_by_each_edge() -> None:
    """``AddBackward0`` hands the gradient it received to both inputs: on each edge it is that
    edge's gradient, never the node's own input name again (a node feeding itself)."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with tracer.trace() as t:
        h = lin(x)
        y = h.relu() + h.sigmoid()
        y.sum().backward()
    add = next(s for s in t.backward_runs[0].steps if s.node == "add0/AddBackward0")
    assert add.grads_in == ["add0:out@grad"]
    assert add.grads_out == ["relu0:out@grad", "sigmoid0:out@grad"]
    assert not set(add.grads_in) & set(add.grads_out)
    # each receiver gets the name of its edge
    received = {s.node: s.grads_in for s in t.backward_runs[0].steps}
    assert received["relu0/ReluBackward0"] == ["relu0:out@grad"]
    assert received["sigmoid0/SigmoidBackward0"] == ["sigmoid0:out@grad"]
    # one value, three names: the same checksum, that of the bytes (all ones: d(sum)/dy)
    ones = torch.ones(2, 4)
    for name in ("add0:out@grad", "relu0:out@grad", "sigmoid0:out@grad"):
        assert t.tensors[name].md5 == md5_of(ones)
    assert t.tensors["relu0:out@grad"].producer == "add0/AddBackward0"
    out = io.StringIO()
    render_record(t, "backward0", Console(file=out, width=200))
    assert "add0/AddBackward0" in out.getvalue()


def test_a_passed_on_gradient_summed_in_place_by_the_engine_is_named_by_its_slot() -> None:
    """``h`` feeds ``relu`` and the add: its slot sums two edges. The engine may add the second
    into the first (the very tensor passed on by the add) in place; what ``h``'s node receives is
    then the sum, ``linear0:out@grad``, with the sum's checksum."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with tracer.trace() as t:
        h = lin(x)
        y = h + h.relu()
        y.sum().backward()
    steps = {s.node: s for s in t.backward_runs[0].steps}
    assert steps["add0/AddBackward0"].grads_out == ["add0/AddBackward0:grad0", "relu0:out@grad"]
    assert steps["linear0/AddmmBackward0"].grads_in == ["linear0:out@grad"]
    expected = 1 + (lin(x) > 0).float()  # d(h + relu(h))/dh
    assert t.tensors["linear0:out@grad"].md5 == md5_of(expected)
    assert t.tensors["add0/AddBackward0:grad0"].md5 == md5_of(torch.ones(2, 4))
