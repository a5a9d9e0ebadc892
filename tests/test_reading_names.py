"""A gradient the engine summed (tied weights, a tensor used twice) lists the edges it is the sum
of, in ``show`` too, instead of "made outside the traced block"."""

from __future__ import annotations

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
    assert summed_from(t, "input0@grad") == [GradientEdge("add0/AddBackward0", "add0:out@grad"),
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
