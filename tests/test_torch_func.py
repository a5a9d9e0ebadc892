"""``torch.func`` transforms inside a traced block: the user's code behaves exactly as without
gradtrace (same results, no error) under every hash option and ``check_numerics``, and tensors
of the transforms are hashed through what they wrap."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacrev, jvp, vmap

import tracer


def reference_md5(t: torch.Tensor) -> str:
    x = t.detach().contiguous().reshape(-1)
    return hashlib.md5(x.view(torch.uint8).numpy().tobytes()).hexdigest()


def _loss(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * x + x.exp() * 0.5).sum()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 7)
        self.fc2 = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _per_sample_grads(net: Net, params: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    def loss_of(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (xi.unsqueeze(0),)).square().sum()
    return vmap(grad(loss_of), in_dims=(None, 0))(params, x)


def _cases() -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    big = torch.randn(300, 300)  # > the inline size: hashed by worker threads or staged
    net = Net()
    params = {k: v.detach() for k, v in net.named_parameters()}
    return {
        "grad": lambda: grad(_loss)(x),
        "grad_large": lambda: grad(_loss)(big),
        "vmap": lambda: vmap(lambda r: r.cos() * 3 + r.sum())(x),
        "jacrev": lambda: jacrev(lambda r: r.sin() * r)(x[0]),
        "jvp": lambda: jvp(lambda r: r.exp() * r, (x,), (torch.ones_like(x),)),
        "hessian": lambda: hessian(_loss)(x[0]),
        "functional_call": lambda: functional_call(net, params, (x,)),
        "grad_of_functional_call": lambda: grad(lambda p: functional_call(net, p, (x,)).sum())(params),
        "per_sample_grads": lambda: _per_sample_grads(net, params, x),
        "jacrev_of_jacrev": lambda: jacrev(jacrev(lambda r: (r ** 3).sum()))(x[0]),
        "vmap_in_place": lambda: vmap(lambda r: r.clone().mul_(2).add_(1))(x),
    }


CASES = _cases()
OPTIONS = ["none", "fast", "md5", "check_numerics"]


def _block(option: str) -> Any:
    return tracer.check_numerics() if option == "check_numerics" else tracer.trace(hash=option)  # type: ignore[arg-type]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_transform_gives_the_same_result_traced(case: str, option: str, tmp_path: Any) -> None:
    fn = CASES[case]
    expected = fn()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracer.NumericsWarning)  # nothing non-finite here
        with _block(option) as t:
            got = fn()
    assert _same(got, expected)
    assert t.status == "ok"
    assert t.calls and all(c.error is None for c in t.calls)
    if option in ("md5", "fast"):
        # Every tensor is hashed (through what it wraps) or says why not: no exception text.
        for rec in t.tensors.values():
            checksum = rec.md5 if option == "md5" else rec.fingerprint
            assert checksum is not None or (rec.hash_note or "").startswith("not hashed: "), rec
            assert "Cannot access" not in (rec.hash_note or "") and "vmap: It looks like" not in (rec.hash_note or "")
    t.save(tmp_path / "f.gtrace")
    assert len(tracer.load(tmp_path / "f.gtrace").calls) == len(t.calls)


def test_grad_hashes_the_values_the_transform_wraps() -> None:
    x = torch.randn(300, 300)
    with tracer.trace(hash="md5") as t:
        g = grad(_loss)(x)
    assert t["input0"].md5 == reference_md5(x)
    assert t["input0"].hash_note is None
    sin = next(c for c in t.calls if c.api.endswith("sin"))
    assert t[sin.outputs[0]].md5 == reference_md5(x.sin())
    assert t["sin0:out"].stats is not None and t["sin0:out"].stats.max == pytest.approx(float(x.sin().max()))
    (out,) = [n for n, r in t.tensors.items() if r.producer and r.producer.startswith("grad")]
    assert t[out].md5 == reference_md5(g)


@pytest.mark.parametrize("algorithm", ["md5", "fast"])
def test_vmap_hashes_the_whole_batch_and_says_so(algorithm: str) -> None:
    x = torch.randn(4, 300)
    with tracer.trace(hash=algorithm) as t:  # type: ignore[arg-type]
        y = vmap(lambda r: r * 2)(x)
    rec = t["input0"]
    assert rec.shape == (300,)  # the per-example shape the user's function sees
    assert rec.hash_note == ("vmap: checksum and stats of every batch entry together "
                             "(the batched 4x300 tensor, batch dim 0)")
    assert rec.stats is not None and rec.stats.max == pytest.approx(float(x.max()))
    if algorithm == "md5":
        assert rec.md5 == reference_md5(x)
        assert t["mul0:out"].md5 == reference_md5(y)
    else:
        with tracer.trace(hash="fast") as plain:
            torch.mul(x, 2)
        assert rec.fingerprint == plain["input0"].fingerprint


def test_check_numerics_finds_a_nan_made_under_vmap() -> None:
    x = torch.tensor([[1.0, -1.0], [4.0, 9.0]])
    expected = vmap(torch.sqrt)(x)
    with pytest.warns(tracer.NumericsWarning), tracer.check_numerics() as t:
        got = vmap(torch.sqrt)(x)
    assert torch.equal(got.isnan(), expected.isnan())
    assert t.anomalies.forward is not None and t.anomalies.forward.tensor == "sqrt0:out"
    with pytest.raises(tracer.NonFiniteError, match=r"^NaN made by sqrt0 \(torch.sqrt\)"), tracer.check_numerics(raise_on_nonfinite=True):
        vmap(torch.sqrt)(x)


def test_a_wrapper_that_outlives_its_transform_is_recorded() -> None:
    kept: list[torch.Tensor] = []

    def f(r: torch.Tensor) -> torch.Tensor:
        kept.append(r * 3)  # a GradTrackingTensor escaping grad()
        return r.sum()

    x = torch.randn(5)
    grad(f)(x)
    with tracer.trace(hash="md5") as t:
        out = kept[0] + 1
    rec = t["input0"]
    assert rec.md5 == reference_md5(x * 3)
    assert torch.equal(out, x * 3 + 1)


def test_values_keep_their_lineage_through_vmap() -> None:
    """What enters vmap is the value the block made (the per-entry view of ``linear0:out``), what
    leaves is the value made inside (``mul0:out``), and the grad nodes made inside belong to the
    calls that made them: one graph, not two cut apart by 'input<k>' and 'external/' nodes."""
    torch.manual_seed(0)
    fc, head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 1)
    x = torch.randn(5, 6)
    with tracer.trace(hash="md5") as t:
        h = fc(x)
        h = vmap(lambda r: torch.tanh(r) * 2)(h)
        head(h).sum().backward()
    reads = {c.name: c.inputs[0] for c in t.calls}
    assert reads == {"linear0": "input0", "tanh0": "linear0:out", "mul0": "tanh0:out", "linear1": "mul0:out",
                     "sum0": "linear1:out"}
    nodes = [n.name for n in t.grad_nodes]
    assert "tanh0/TanhBackward0" in nodes and "mul0/MulBackward0" in nodes
    assert not [n for n in nodes if n.startswith("external/")]
    assert t.tensors["mul0:out"].md5 == reference_md5(h)  # (the batch vmap handed back)


def test_what_torch_func_grad_returns_is_the_gradient_it_computed() -> None:
    """``grad()``'s result, read by the next call, is its run's output ``grad0:out0``, with its
    checksum (before, a new 'input<k>' of the same bytes)."""
    torch.manual_seed(0)
    m, x = torch.nn.Linear(3, 2), torch.randn(3)
    params = {k: v.detach() for k, v in m.named_parameters()}
    with tracer.trace(hash="md5") as t:
        g = grad(lambda p: functional_call(m, p, (x,)).sum())(params)
        g["weight"] * 2
    (mul,) = [c for c in t.calls if c.api == "Tensor.mul"]
    assert mul.inputs == ["grad0:out0"] and t.backward_runs[0].outputs == ["grad0:out0", "grad0:out1"]
    assert t.tensors["grad0:out0"].md5 == reference_md5(g["weight"])
