"""``.data``, read and assigned, inside a traced block.

``t.data`` is a new tensor object on ``t``'s bytes with a version counter of its own, and
``t.data = v`` swaps ``t``'s bytes while its version counter stays: no version tells either.
The trace names ``t.data`` as ``t`` (a write through it is a new version of ``t``) and records
``t.data = v`` as a call (``Tensor.data=``) that makes a new version of ``t``."""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import tracer


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def _call(t: tracer.Trace, name: str) -> tracer.Call:
    return next(c for c in t.calls if c.name == name)


def test_a_write_through_a_parameters_data_before_its_model_runs_is_a_version_of_the_parameter() -> None:
    m, x = _mlp(), torch.randn(3, 4)
    with tracer.trace(hash="md5") as t:
        for p in m.parameters():
            p.data.clamp_(-0.1, 0.1)  # weight clipping (WGAN) before the forward
        m(x).sum().backward()
    clamp = _call(t, "clamp_0")
    assert (clamp.inputs, clamp.outputs) == (["0.weight"], ["0.weight@v1"])
    assert t.tensors["0.weight@v1"].role == "param"
    assert _call(t, "linear0").inputs == ["input0", "0.weight@v1", "0.bias@v1"]
    assert t.tensors["0.weight@v1"].md5 == _md5(m[0].weight)
    assert not any(n.startswith("input") and n != "input0" for n in t.tensors)


def test_a_write_through_an_outputs_data_is_a_version_of_that_output() -> None:
    m, x = _mlp(), torch.randn(3, 4)
    with tracer.trace(hash="md5") as t:
        y = m(x)
        y.data.mul_(2)
        z = y * 3
    assert _call(t, "mul_0").outputs == ["linear1:out@v1"]
    assert _call(t, "mul0").inputs == ["linear1:out@v1"]
    assert t.tensors["linear1:out@v1"].md5 == _md5(y)
    assert t.tensors["mul0:out"].md5 == _md5(z)


def test_data_of_a_tensor_the_trace_does_not_know_records_nothing() -> None:
    a = torch.randn(3)
    with tracer.trace(hash="md5") as t:
        b = a.data
    assert b.data_ptr() == a.data_ptr()
    assert t.tensors == {} and t.calls == []


def test_vector_to_parameters_is_recorded_as_assignments_the_next_forward_reads() -> None:
    m, x = _mlp(), torch.randn(3, 4)
    with tracer.trace(hash="md5") as t:
        m(x).sum().backward()
        v = parameters_to_vector(m.parameters()).detach() - 0.1 * parameters_to_vector([p.grad for p in m.parameters()])
        vector_to_parameters(v, m.parameters())
        m(x).sum().backward()
    sets = [c for c in t.calls if c.api == "Tensor.data="]
    assert [c.name for c in sets] == ["set_data0", "set_data1", "set_data2", "set_data3"]
    assert [c.inputs for c in sets] == [["0.weight", "view_as0:out"], ["0.bias", "view_as1:out"],
                                        ["2.weight", "view_as2:out"], ["2.bias", "view_as3:out"]]
    assert [c.outputs for c in sets] == [["0.weight@v1"], ["0.bias@v1"], ["2.weight@v1"], ["2.bias@v1"]]
    assert _call(t, "linear2").inputs == ["input0", "0.weight@v1", "0.bias@v1"]
    for k, (name, p) in enumerate(m.named_parameters()):
        assert t.tensors[f"{name}@v1"].md5 == _md5(p) == t.tensors[f"view_as{k}:out"].md5


def test_a_dtype_change_inside_the_block_makes_new_versions_of_parameters_and_gradients() -> None:
    m, x = _mlp(), torch.randn(3, 4)
    with tracer.trace(hash="md5") as t:
        m(x).sum().backward()
        m.double()  # Module._apply: p.data = p.double(); p.grad.data = p.grad.double()
        m(x.double()).sum().backward()
    for name, p in m.named_parameters():
        assert p.dtype == torch.float64 and p.grad is not None
        param = t.tensors[f"{name}@v1"]
        assert (param.dtype, param.previous, param.md5) == ("float64", name, _md5(p))
        assert param.producer is not None and _call(t, param.producer).api == "Tensor.data="
        grads = [r for n, r in t.tensors.items() if n.startswith(f"{name}@grad")]
        last = max(grads, key=lambda r: r.seq)
        assert last.dtype == "float64" and last.md5 == _md5(p.grad)
    assert _call(t, "linear2").inputs[1:] == ["0.weight@v1", "0.bias@v1"]


def test_moving_a_model_to_where_it_is_records_nothing() -> None:
    m, x = _mlp(), torch.randn(3, 4)
    with tracer.trace(hash="md5") as t:
        m.to("cpu")
        m.float()
        m(x).sum().backward()
    assert not any(c.api == "Tensor.data=" for c in t.calls)
    assert _call(t, "linear0").inputs == ["input0", "0.weight", "0.bias"]


def test_a_write_through_the_data_of_a_parameter_no_module_holds() -> None:
    w = torch.nn.Parameter(torch.randn(3))
    with tracer.trace(hash="md5") as t:
        w.data.mul_(2)
        y = w * 3
    write, use = _call(t, "mul_0"), _call(t, "mul0")
    assert write.outputs == [f"{write.inputs[0]}@v1"] and use.inputs == write.outputs
    assert t.tensors[write.outputs[0]].md5 == _md5(w) and t.tensors["mul0:out"].md5 == _md5(y)


def test_reading_data_for_its_dtype_looks_for_no_model(monkeypatch) -> None:
    from tracer.record import owners

    searches: list[int] = []
    search = owners._search_all
    monkeypatch.setattr(owners, "_search_all", lambda: searches.append(1) or search())
    m, x = _mlp(), torch.randn(3, 4)
    with tracer.trace(hash="md5") as t:
        dtypes = {p.data.dtype for p in m.parameters()}
        m(x).sum().backward()
    assert dtypes == {torch.float32} and searches == []
    assert _call(t, "linear0").inputs == ["input0", "0.weight", "0.bias"]


def test_an_averaged_model_written_through_detached_aliases_keeps_its_names_on_the_new_values() -> None:
    """AveragedModel copies into ``p.detach()`` on its first update and lerps lists of detached
    parameters after: each write is a new version of the averaged parameter itself
    (``swa.module.0.weight@v1``, ``@v2``), whose checksum is its bytes'; before, the parameter
    took the alias's name and its own name stayed on the value before the write."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    swa = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(hash="md5") as t:
        for _ in range(2):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
            swa.update_parameters(model)
    for name, p in swa.module.named_parameters(prefix="swa.module"):
        assert t.tensors[f"{name}@v2"].md5 == _md5(p), name  # copied, then averaged
        assert f"{name}@v3" not in t.tensors
        assert t.tensors[f"{name}@v1"].previous == name
