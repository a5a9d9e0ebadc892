"""Recipes whose work happens inside the backward, in hooks, and is read again by the code after
it: the optimizer stepped in each parameter's post-accumulate-grad hook (PyTorch's "optimizer
step in backward" tutorial), per-sample gradients clipped from what full backward hooks kept
(Opacus-style DP-SGD by hand), and a Hessian-vector product (``autograd.functional.hvp``: two
``create_graph`` runs through the same nodes). Each ends as its untraced twin to the bit, its
last records hold ``hashlib``'s checksum of the end values, its trace saves and loads back, and
the graph and text reports draw it."""

from __future__ import annotations

import collections
import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import export
import tracer
from tests.models import traced_twin


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _last(t: tracer.Trace, base: str) -> tracer.TensorRecord | None:
    found = [r for n, r in t.tensors.items() if n == base or n.startswith(base + "@v")]
    return max(found, key=lambda r: r.seq, default=None)


def optimizer_in_backward() -> tuple[nn.Module, Callable[[], None]]:
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opts = {p: torch.optim.Adam([p], lr=1e-2) for p in model.parameters()}

    def step_now(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    x = torch.randn(5, 8)

    def run() -> None:
        for _ in range(2):
            model(x).pow(2).mean().backward()

    return model, run


def per_sample_clipping() -> tuple[nn.Module, Callable[[], None]]:
    lin = nn.Linear(6, 3)
    model = nn.Sequential(lin)
    kept: dict[str, torch.Tensor] = {}
    lin.register_forward_hook(lambda m, i, o: kept.__setitem__("a", i[0].detach()))
    lin.register_full_backward_hook(lambda m, gi, go: kept.__setitem__("g", go[0].detach()))
    x = torch.randn(5, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run() -> None:
        for _ in range(2):
            model(x).pow(2).sum().backward()
            per_sample = torch.einsum("bi,bj->bij", kept["g"], kept["a"])  # per-sample-line
            scale = per_sample.flatten(1).norm(dim=1).clamp(min=1.0)
            lin.weight.grad = (per_sample / scale[:, None, None]).sum(0)
            lin.bias.grad = (kept["g"] / scale[:, None]).sum(0)
            opt.step()
            opt.zero_grad()

    return model, run


def hessian_vector() -> tuple[nn.Module, Callable[[], None]]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    names = [n for n, _ in model.named_parameters()]

    def run() -> None:
        params = tuple(model.parameters())

        def f(*p: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(model, dict(zip(names, p)), (x,)).sum()

        _, hv = torch.autograd.functional.hvp(f, params, tuple(torch.ones_like(p) for p in params))
        with torch.no_grad():
            for p, v in zip(params, hv):
                p.sub_(0.01 * v)
        model(x).sum().backward()

    return model, run


RECIPES = {f.__name__: f for f in (optimizer_in_backward, per_sample_clipping, hessian_vector)}


def _traced(recipe: str, hash_kind: str = "md5") -> tuple[nn.Module, tracer.Trace]:
    plain, model, t = traced_twin(RECIPES[recipe], hash=hash_kind)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    return model, t


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_recipe_ends_as_untraced_and_its_trace_loads_and_draws(recipe: str, tmp_path: Path) -> None:
    model, t = _traced(recipe)
    assert t.status == "ok" and not t.notes
    for name, p in model.named_parameters():
        last = _last(t, name)
        assert last is not None and last.md5 == _md5(p), name
    node_names = [n.name for n in t.grad_nodes]
    assert len(node_names) == len(set(node_names))
    path = tmp_path / "t.gtrace"
    t.save(path)
    back = tracer.load(path)
    assert [c.name for c in back.calls] == [c.name for c in t.calls]
    export.render(back, tmp_path / "t.dot")
    assert "digraph" in (tmp_path / "t.dot").read_text()
    assert export.to_text(back)


def test_parameters_stepped_inside_the_backward_are_what_the_next_forward_reads() -> None:
    _, t = _traced("optimizer_in_backward")
    steps = [c for c in t.calls if c.kind == "optimizer"]
    assert len(steps) == 8 and all(c.phase == "backward" for c in steps)  # 4 parameters x 2 passes
    first_pass = steps[:4]
    stepped = {n for c in first_pass for n in c.mutated}
    second_linear = [c for c in t.calls if c.api == "torch.nn.functional.linear"][2]
    assert second_linear.inputs[1] in stepped and second_linear.inputs[1].startswith("0.weight@v")


def test_a_gradient_a_backward_hook_kept_is_drawn_from_the_backward_call_into_the_forward_one(
        tmp_path: Path) -> None:
    _, t = _traced("per_sample_clipping", "none")
    kept = next(c for c in t.calls if c.phase == "backward" and c.api == "Tensor.detach")
    einsum = next(c for c in t.calls if c.api == "torch.functional.einsum")
    assert kept.outputs[0] in einsum.inputs
    export.render(t, tmp_path / "t.dot")
    dot = (tmp_path / "t.dot").read_text()
    ids = {label: nid for nid, label in re.findall(r'^\s*(c\d+) \[.*label="([\w.]+)\\n', dot, re.M)}
    assert re.search(rf"\b{ids[kept.name]} -> {ids[einsum.name]}\b", dot), (kept.name, einsum.name)


def test_nodes_two_create_graph_runs_make_under_one_node_are_numbered_on() -> None:
    _, t = _traced("hessian_vector", "none")
    counts = collections.Counter(n.name for n in t.grad_nodes)
    assert max(counts.values()) == 1
    adopted = {n.name: n.parent for n in t.grad_nodes if n.call is None and n.parent is not None}
    twice = [n for n in adopted if n.endswith("#1")]
    assert twice, sorted(adopted)
    for name in twice:
        first = name[:-2]
        assert adopted[first] == adopted[name]
