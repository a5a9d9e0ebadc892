"""Parameters replaced by new Parameter objects after the trace named their model (a model built
on the meta device and materialised with ``to_empty``, ``module.weight = nn.Parameter(...)``)
are new versions of their module path, not ``input<k>``; and a model copied inside the block
(``copy.deepcopy``, as ``quantize_dynamic`` does) does not break the search for a parameter's
model, which meets the copy's modules half-built."""

from __future__ import annotations

import contextlib
import copy
import hashlib
from pathlib import Path

import torch
import torch.nn as nn

import tracer


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.inner = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 1))


def test_a_meta_model_materialised_in_the_block_keeps_its_paths() -> None:
    torch.manual_seed(0)
    holder = Holder()
    with tracer.trace(hash="md5") as t:
        holder.inner.to_empty(device="cpu")  # new Parameter objects in place of the meta ones
        for mod in holder.inner.modules():
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
        opt = torch.optim.AdamW(holder.inner.parameters(), lr=1e-2)
        holder.inner(torch.randn(3, 4)).sum().backward()
        opt.step()
    init = next(c for c in t.calls if c.api.endswith("kaiming_uniform_"))
    assert init.inputs == ["inner.0.weight@v1"]
    rec = t.tensors["inner.0.weight@v1"]
    assert (rec.role, rec.previous, rec.device) == ("param", "inner.0.weight", "cpu")
    assert t.tensors["inner.0.weight"].device == "meta"
    assert not [n for n in t.tensors if n.startswith("input")]
    for name, p in holder.inner.named_parameters(prefix="inner"):
        last = max((r for n, r in t.tensors.items() if n == name or n.startswith(name + "@v")), key=lambda r: r.seq)
        assert last.md5 == _md5(p), name


def test_a_parameter_replaced_between_two_forwards_is_its_paths_next_version() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    x = torch.randn(2, 3)
    with tracer.trace(hash="md5") as t:
        model(x).sum().backward()
        model[0].weight = nn.Parameter(torch.zeros(3, 3))  # met first inside the next forward
        model(x).sum().backward()
    first, _, second, _ = [c for c in t.calls if c.api == "torch.nn.functional.linear"]
    assert first.inputs[1] == "0.weight" and second.inputs[1] == "0.weight@v1"
    rec = t.tensors["0.weight@v1"]
    assert (rec.role, rec.previous, rec.md5) == ("param", "0.weight", _md5(torch.zeros(3, 3)))
    accumulators = [n.name for n in t.grad_nodes if n.kind == "AccumulateGrad" and n.param == "0.weight"]
    assert accumulators == ["0.weight/AccumulateGrad", "0.weight/AccumulateGrad#1"]  # old and new Parameter
    assert t.tensors["0.weight@grad#1"].md5 == _md5(model[0].weight.grad)



def test_a_parameter_whose_detached_alias_the_module_held_is_not_a_new_version() -> None:
    """``functional_call(m, {k: v.detach()})`` with the dict taken before the block: the module
    holds the aliases while it runs, so they take the paths; the parameters, met at the
    optimizer step, show the very same bytes and version, not a value nobody wrote."""
    torch.manual_seed(0)
    m, x = nn.Linear(3, 2), torch.randn(3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    params = {k: v.detach() for k, v in m.named_parameters()}
    with tracer.trace(hash="md5") as t:
        torch.func.functional_call(m, params, (x,)).sum()  # (the aliases need no grad)
        opt.step()  # the aliases have no .grad: it changes nothing
    step = next(c for c in t.calls if c.kind == "optimizer")
    assert step.inputs == ["weight", "bias"]
    assert not [n for n in t.tensors if n.startswith(("weight@v", "bias@v"))]
    assert t.tensors["weight"].md5 == _md5(m.weight) and t.tensors["weight"].role == "param"

def test_its_trace_loads_back(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 1))
    with tracer.trace(hash="none") as t:
        model(torch.randn(2, 3)).sum().backward()
        model[0].weight = nn.Parameter(torch.ones(1, 3))
        model(torch.randn(2, 3)).sum().backward()
    t.save(tmp_path / "t.gtrace")
    assert [n.name for n in tracer.load(tmp_path / "t.gtrace").grad_nodes] == [n.name for n in t.grad_nodes]


def test_a_model_copied_inside_the_block_leaves_the_program_running() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with tracer.trace(hash="none") as t:
        model(x).sum().backward()
        opt.step()
        frozen = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model).eval(), {nn.Linear}, dtype=torch.qint8)
        with torch.no_grad():
            out = frozen(x)
    assert out.shape == (4, 2) and t.status == "ok"
    assert {"0.weight", "0.weight@v1", "2.bias@v1"} <= set(t.tensors)


def test_lazy_modules_materialised_in_the_block() -> None:
    # A lazy module's first forward gives its UninitializedParameter real bytes (``.data =``);
    # reading that parameter's address raised into the program before the first forward ran.
    def train(traced: bool) -> tuple[nn.Module, tracer.Trace | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.LazyLinear(6), nn.LazyBatchNorm1d(), nn.ReLU(), nn.LazyLinear(1))
        x = torch.randn(4, 5)
        with tracer.trace(hash="md5") if traced else contextlib.nullcontext() as t:
            opt = None
            for _ in range(2):
                loss = model(x).sum()
                if opt is None:  # (parameters exist once the first forward made them)
                    opt = torch.optim.Adam(model.parameters(), lr=0.1)
                loss.backward()
                opt.step()
                opt.zero_grad()
        return model, t

    plain, _ = train(traced=False)
    model, t = train(traced=True)
    assert t is not None
    materialise = [c for c in t.calls if c.api == "Tensor.data="]
    assert [c.inputs[0] for c in materialise][:2] == ["0.weight", "0.bias"]
    assert [c.mutated for c in materialise][:2] == [["0.weight@v1"], ["0.bias@v1"]]
    for (name, p), (_, q) in zip([*model.named_parameters(), *model.named_buffers()],
                                 [*plain.named_parameters(), *plain.named_buffers()]):
        assert torch.equal(p, q), name
        last = max((r for n, r in t.tensors.items() if n.split("@v")[0] == name), key=lambda r: r.seq)
        assert last.md5 == _md5(p), name
