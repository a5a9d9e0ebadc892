"""``torch.utils.swap_tensors`` in and after a traced block (tracer/record/swaps.py).

swap_tensors refuses a tensor that has a weak reference; the recorder keeps weak references to
what it names. Inside a block it steps aside for the swap and names what moved; after a block
no weak reference of gradtrace is left on the user's tensors (the owner search's cache kept
them for good, so ``Module.to`` with swapping on failed even after the trace had ended)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils

import tracer


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture
def swapping() -> Iterator[None]:
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def _latest(t: tracer.Trace, base: str) -> Any:
    return max((r for n, r in t.tensors.items() if n == base or n.startswith(base + "@v")), key=lambda r: r.seq)


@pytest.mark.usefixtures("swapping")
def test_a_model_converted_by_swapping_inside_the_block() -> None:
    def train(traced: bool) -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
        x = torch.randn(5, 4)
        with tracer.trace(hash="md5") if traced else contextlib.nullcontext() as t:
            model(x).sum().backward()
            model.to(torch.float64)  # swaps every parameter and its .grad with a converted copy
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(x.double()).sum().backward()
            opt.step()
        return model, t

    plain, _ = train(traced=False)
    model, t = train(traced=True)
    assert torch.utils.swap_tensors.__module__ == "torch.utils"  # the wrapper is gone
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad), name
        converted = t.tensors[f"{name}@v1"]
        assert (converted.dtype, converted.role, converted.previous) == ("float64", "param", name)
        to_call = next(c for c in t.calls if c.api == "Tensor.to" and c.inputs == [name])
        # (its producer: the Parameter that Module._apply wraps around to()'s output is a new
        # object no call returned, so the swapped-in value has no name to follow)
        assert converted.md5 == t.tensors[to_call.outputs[0]].md5
        assert _latest(t, name).md5 == _md5(p)
        assert t.tensors[f"{name}@grad@v1"].previous == f"{name}@grad"
        assert _latest(t, f"{name}@grad").md5 == _md5(p.grad)


def test_tensors_swapped_by_hand_inside_the_block() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    wa, wb = _md5(a.weight), _md5(b.weight)
    with tracer.trace(hash="md5") as t:
        a(torch.ones(1, 2))
        b(torch.ones(1, 2))  # (a second root module: its names are prefixed)
        torch.utils.swap_tensors(a.weight, b.weight)
        a(torch.ones(1, 2))
    assert (_md5(a.weight), _md5(b.weight)) == (wb, wa)
    assert (t.tensors["weight@v1"].md5, t.tensors["weight@v1"].previous) == (wb, "weight")
    assert t.calls[-1].inputs[1] == "weight@v1"
    b_weight = next(n for n in t.tensors if n.endswith("weight@v1") and n != "weight@v1")
    assert t.tensors[b_weight].md5 == wa


@pytest.mark.usefixtures("swapping")
@pytest.mark.parametrize("options", [dict(hash="md5"), dict(hash="none"), dict(hash="fast", check_numerics=True),
                                     dict(hash="md5", memory=True, node_runs=True, optimizer_state=True),
                                     dict(hash="md5", keep_values=True)])
def test_no_weak_reference_outlives_the_trace(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(x).sum().backward()
    opt.step()
    with tracer.trace(**options) as t:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # parameters met before their model ran
        opt.step()
        opt.zero_grad()
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    gc.collect()
    assert t.tensors  # (the trace is kept, as users keep it)
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()),
               *(v for s in opt.state.values() for v in s.values())]
    assert [tuple(v.shape) for v in tensors if weakref.getweakrefs(v)] == []
    model.to(torch.float64)  # swaps every parameter
    assert next(model.parameters()).dtype == torch.float64


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("swapping")
@pytest.mark.parametrize("hash_kind", ["md5", "fast"])
def test_a_model_moved_to_the_gpu_by_swapping_inside_the_block(hash_kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    x = torch.randn(5, 4)
    with tracer.trace(hash=hash_kind) as t:  # type: ignore[arg-type]
        model(x).sum().backward()
        model.cuda()
        opt = torch.optim.AdamW(model.parameters())
        model(x.cuda()).sum().backward()
        opt.step()
    for name, p in model.named_parameters():
        moved = t.tensors[f"{name}@v1"]
        assert (moved.device, moved.previous) == ("cuda:0", name)
        if hash_kind == "md5":
            assert _latest(t, name).md5 == _md5(p.cpu())
            assert _latest(t, f"{name}@grad").md5 == _md5(p.grad.cpu())
        else:
            assert moved.fingerprint == t.tensors[name].fingerprint  # the same bytes, moved
