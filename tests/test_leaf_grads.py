"""A leaf's ``.grad`` in a trace that reads no values: its accumulator has one hook, not two (the
pre-hook's part, what ``.grad`` was before, is read when the backward starts). Every recipe here
records what the pre-hook path records (the reference: a trace made with every accumulator given
both hooks), and the names it gives are checked one by one."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

import tracer
from tracer.model import Trace
from tracer.record.autograd import Graph


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def _x() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _view(t: Trace) -> tuple[Any, ...]:
    """What a trace says about values, backward runs and calls (sequence numbers aside)."""
    tensors = {n: (r.role, r.producer, r.version, r.previous, tuple(r.shape)) for n, r in t.tensors.items()}
    runs = [[(s.node, tuple(s.grads_in), tuple(s.grads_out)) for s in r.steps] for r in t.backward_runs]
    calls = [(c.name, tuple(c.inputs), tuple(c.outputs)) for c in t.calls]
    return tensors, runs, calls


@pytest.fixture
def both_hooks(monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """A context in which accumulators get a pre-hook and a hook, as where values are read."""
    import contextlib

    @contextlib.contextmanager
    def forced() -> Iterator[None]:
        with monkeypatch.context() as m:
            m.setattr(Graph, "_acc_hook_alone", lambda self: False)
            yield
    return forced


def _grad_from_before(model: nn.Module) -> None:
    model(_x()).sum().backward()  # untraced: every parameter has a .grad the trace has no name for


def _plain(model: nn.Sequential) -> None:
    model(_x()).sum().backward()
    model[0].weight.grad.mul(2)


def _accumulated(model: nn.Sequential) -> None:
    for _ in range(2):
        model(_x()).sum().backward()
    model[0].weight.grad.mul(2)


def _penalty(model: nn.Sequential) -> None:
    model(_x()).sum().backward()
    g = torch.autograd.grad(model(_x()).sum(), model[0].weight, create_graph=True)[0]
    with warnings.catch_warnings():  # (torch warns, once, of the reference cycle .grad makes)
        warnings.simplefilter("ignore", UserWarning)
        (g.pow(2).sum() + model(_x()).sum()).backward(create_graph=True)  # out of place into .grad


def _late_hook(model: nn.Sequential) -> None:
    loss = model(_x()).sum()
    seen: list[torch.Tensor] = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad * 2))
    loss.backward()


def _unseen_start(model: nn.Sequential) -> None:
    loss = model(_x()).sum()
    with torch._C.DisableTorchFunction():  # the trace does not see this backward start
        loss.backward()
    model[0].weight.grad.mul(2)


def _sparse_before(model: nn.Sequential) -> None:
    model(_x()).sum().backward()  # a dense gradient into a sparse .grad: added out of place


RECIPES: dict[str, tuple[Callable[[nn.Sequential], None], Callable[[nn.Sequential], None] | None]] = {
    "plain": (_plain, None),
    "grad before the block": (_plain, _grad_from_before),
    "accumulated": (_accumulated, None),
    "accumulated into a grad from before": (_accumulated, _grad_from_before),
    "create_graph": (_penalty, None),
    "create_graph into a grad from before": (_penalty, _grad_from_before),
    "post-accumulate hook after the forward": (_late_hook, None),
    "backward started unseen": (_unseen_start, None),
    "backward started unseen, grad from before": (_unseen_start, _grad_from_before),
}


def _traced(recipe: Callable[[nn.Sequential], None], before: Callable[[nn.Sequential], None] | None) -> Trace:
    model = _model()
    if before is not None:
        before(model)
    with tracer.trace(hash="none") as t:
        recipe(model)
    return t


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_lean_trace_names_every_grad_as_with_both_hooks(name: str, both_hooks: Callable[[], Any]) -> None:
    recipe, before = RECIPES[name]
    alone = _traced(recipe, before)
    with both_hooks():
        reference = _traced(recipe, before)
    assert _view(alone) == _view(reference)
    assert any(r.steps for r in alone.backward_runs)


def test_a_grad_from_before_the_block_is_v0_and_the_run_adds_a_version() -> None:
    t = _traced(_plain, _grad_from_before)
    for p in ("0.weight", "0.bias", "2.weight", "2.bias"):
        v0, v1 = t.tensors[f"{p}@grad@v0"], t.tensors[f"{p}@grad@v1"]
        assert (v0.role, v0.producer, v0.version, v0.previous) == ("grad", None, 0, None)
        assert (v1.producer, v1.version, v1.previous) == (f"{p}/AccumulateGrad", 1, f"{p}@grad@v0")
    mul = next(c for c in t.calls if c.api == "Tensor.mul")
    assert mul.inputs == ["0.weight@grad@v1"]


def test_a_grad_from_before_is_named_only_where_its_accumulator_runs() -> None:
    model, other = _model(), nn.Linear(4, 1)
    (model(_x()).sum() + other(_x()).sum()).backward()  # both have a .grad from before
    with tracer.trace(hash="none") as t:
        other(_x()).sum()  # its accumulators known to the trace, never run
        model(_x()).sum().backward()
    assert sorted(n for n in t.tensors if n.endswith("@grad@v0")) == [
        f"model.{p}@grad@v0" for p in ("0.bias", "0.weight", "2.bias", "2.weight")]
    assert {"weight", "bias"} <= set(t.tensors)  # other's parameters, their .grad unnamed


def test_a_dense_gradient_into_a_sparse_grad_from_before(both_hooks: Callable[[], Any]) -> None:
    """Added out of place: the old .grad is gone when the accumulator's hook runs; its record
    (``@grad@v0``) is made from the new .grad's metadata with the version it had."""
    def before(model: nn.Sequential) -> None:
        model[0].weight.grad = torch.zeros(4, 4).to_sparse()

    alone = _traced(_sparse_before, before)
    with both_hooks():
        reference = _traced(_sparse_before, before)
    names = {n: (r.version, r.previous, r.producer) for n, r in alone.tensors.items() if n.startswith("0.weight@")}
    assert names == {"0.weight@grad": (0, None, None), "0.weight@grad@v0": (0, None, None),
                     "0.weight@grad@v1": (0, "0.weight@grad@v0", "0.weight/AccumulateGrad")}
    ref = {n: (r.version, r.previous, r.producer) for n, r in reference.tensors.items() if n.startswith("0.weight@")}
    assert names == ref


def test_a_post_accumulate_hook_added_after_the_forward_gets_the_pre_hook(node_hook_calls: list[str]) -> None:
    """Its calls read the .grad the accumulator made, by that name; the pre-hook added at the
    backward's start is taken off with the rest at the trace's end."""
    calls = node_hook_calls
    model = _model()
    with tracer.trace(hash="none") as t:
        _late_hook(model)
    assert sorted(calls) == sorted(["0.weight/AccumulateGrad"] * 2 + [
        "0.bias/AccumulateGrad", "2.weight/AccumulateGrad", "2.bias/AccumulateGrad"])
    mul = next(c for c in t.calls if c.api == "Tensor.mul")
    assert mul.inputs == ["0.weight@grad"] and mul.phase == "backward"
    calls.clear()
    model(_x()).sum().backward()
    assert calls == []


def _llama_accumulated_into_grads_from_before(**options: Any) -> Trace:
    from tests.models import hf_loss, hf_model

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, x = hf_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hf_loss(model, x).backward()
    opt.step()  # no zero_grad: every .grad comes from before the block
    with tracer.trace(**options) as t:
        for _ in range(2):
            hf_loss(model, x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return t


def _reentrant_checkpoint(**options: Any) -> Trace:
    """The checkpointed segment's backward is a backward run of its own, inside the outer one,
    into the same parameters' accumulators (the model is used outside the segment too)."""
    from torch.utils.checkpoint import checkpoint

    model = _model()
    x = _x().requires_grad_()
    with tracer.trace(**options) as t:
        (checkpoint(model, x, use_reentrant=True).sum() + model(x).sum()).backward()
        model[0].weight.grad.mul(2)
    return t


@pytest.mark.parametrize("recipe", [_llama_accumulated_into_grads_from_before, _reentrant_checkpoint],
                         ids=["llama accumulated into grads from before", "reentrant checkpoint"])
def test_real_recipes_name_every_grad_as_with_both_hooks(recipe: Callable[..., Trace],
                                                         both_hooks: Callable[[], Any]) -> None:
    alone = recipe(hash="none")
    with both_hooks():
        reference = recipe(hash="none")
    assert _view(alone) == _view(reference)
    # ... and as a trace with checksums (both hooks, every node's run) names them, less the
    # optimizer's state, which a trace without checksums leaves out of the step.
    md5 = recipe(hash="md5", optimizer_state=False)
    assert _view(alone)[2] == _view(md5)[2]
    grads = {n for n, r in alone.tensors.items() if r.role == "grad"}
    assert grads <= {n for n, r in md5.tensors.items() if r.role == "grad"}
    # Each parameter's .grad from before the block is @grad@v0 (none in the checkpoint recipe).
    params = {n for n, r in alone.tensors.items() if r.role == "param" and r.previous is None}
    before = {n.removesuffix("@grad@v0") for n in grads if n.endswith("@grad@v0")}
    assert before == (params if recipe is _llama_accumulated_into_grads_from_before else set())
