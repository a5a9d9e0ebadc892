"""A fault of gradtrace's own code while it records (tracer.record.failsafe) stops the recording
and leaves the user's program running to the same result: the trace keeps what it recorded
before, says where gradtrace failed, and still saves and loads. Errors gradtrace raises on
purpose (``raise_on_nonfinite``) and everything under ``GRADTRACE_STRICT=1`` pass on. Faults are
injected with monkeypatch at the recorder's three kinds of entry: a torch call, a module call,
a grad node's hook."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import tracer
from tracer.record import autograd, modules, naming


class Fault(Exception):
    pass


X = torch.ones(3, 4)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(model: nn.Module) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(X).pow(2).sum().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def lenient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADTRACE_STRICT", raising=False)


def _fail_on(api: str, real):  # type: ignore[no-untyped-def]
    def short_args(args, kwargs):  # type: ignore[no-untyped-def]
        if any(isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[0] == 3 and a.shape[1] == 8 for a in args):
            raise Fault(f"injected at {api}")
        return real(args, kwargs)
    return short_args


def _check(t: tracer.Trace, tmp_path: Path) -> tracer.Trace:
    assert t.notes and t.notes[0].startswith("recording stopped: gradtrace failed while recording (Fault: injected")
    assert "tracer/" in t.notes[0] and "please report it" in t.notes[0]
    t.save(tmp_path / "t.gtrace")
    return tracer.load(tmp_path / "t.gtrace")


@pytest.mark.usefixtures("lenient")
def test_a_fault_recording_a_call_leaves_the_step_and_keeps_the_calls_before(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    want = _step(_model())
    monkeypatch.setattr(naming, "short_args", _fail_on("relu", naming.short_args))
    model = _model()
    with pytest.warns(RuntimeWarning, match="gradtrace failed while recording"), tracer.trace(hash="md5") as t:
        got = _step(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    back = _check(t, tmp_path)
    assert [c.name for c in back.calls] == ["linear0"]  # relu0 failed half-way: taken back
    assert not [n for n in back.tensors if n.startswith("relu")]


@pytest.mark.usefixtures("lenient")
def test_a_fault_naming_a_module_leaves_the_forward(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    want = _step(_model())

    def broken(*_: object) -> None:
        raise Fault("injected in a module hook")

    monkeypatch.setattr(modules, "caller", broken)
    model = _model()
    with pytest.warns(RuntimeWarning), tracer.trace(hash="none") as t:
        got = _step(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _check(t, tmp_path).calls == []


@pytest.mark.usefixtures("lenient")
def test_a_fault_in_a_grad_nodes_hook_leaves_the_backward(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    want = _step(_model())

    def broken(*_: object) -> None:
        raise Fault("injected in a node hook")

    monkeypatch.setattr(autograd.Graph, "node_end", broken)
    model = _model()
    with pytest.warns(RuntimeWarning), tracer.trace(hash="md5") as t:
        got = _step(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    back = _check(t, tmp_path)
    assert [c.name for c in back.calls][:3] == ["linear0", "relu0", "linear1"]
    assert back.backward_runs and not [c for c in back.calls if c.kind == "optimizer"]


def test_strict_mode_passes_the_fault_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADTRACE_STRICT", "1")
    monkeypatch.setattr(naming, "short_args", _fail_on("relu", naming.short_args))
    with pytest.raises(Fault), tracer.trace(hash="none"):
        _step(_model())


@pytest.mark.usefixtures("lenient")
def test_an_error_raised_on_purpose_still_reaches_the_program() -> None:
    x = torch.tensor([-1.0, 4.0], requires_grad=True)
    with pytest.raises(tracer.NonFiniteError, match="sqrt0"), tracer.check_numerics(raise_on_nonfinite=True) as t:
        torch.sqrt(x).sum()
    assert [c.name for c in t.calls] == ["sqrt0"] and not any("gradtrace failed" in n for n in t.notes)


def _fail_after(monkeypatch: pytest.MonkeyPatch, owner: type, attr: str, after: int) -> None:
    """Make ``owner.attr`` raise from its ``after+1``-th call on."""
    real = getattr(owner, attr)
    count = [0]

    def broken(*args: object, **kwargs: object) -> object:
        count[0] += 1
        if count[0] > after:
            raise Fault(f"injected in {attr}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, broken)


def _accumulating_step() -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        model(X).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.usefixtures("lenient")
@pytest.mark.parametrize(("where", "after"), [
    ("optimizer.OptimizerSteps.close", 0), ("autograd.Graph._accumulator", 2),
    ("tensor_names.TensorNames.new_tensor", 20), ("autograd.Graph._collect_nodes", 3),
    ("autograd.Graph._start_step", 1), ("autograd.Graph._grad_names", 5),
    ("leaf_grads.LeafGrads.name_accumulated", 2), ("tensor_names.TensorNames.write_through_aliases", 0)])
def test_a_fault_anywhere_in_the_recorder_leaves_the_result_and_a_loadable_trace(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str, after: int) -> None:
    # ``where``: <module of tracer.record>.<class>.<method>, the recorder's part and its method.
    module, cls, attr = where.split(".")
    want = _accumulating_step()
    _fail_after(monkeypatch, getattr(importlib.import_module(f"tracer.record.{module}"), cls), attr, after)
    with pytest.warns(RuntimeWarning, match="gradtrace failed while recording"), tracer.trace(hash="md5") as t:
        got = _accumulating_step()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert f"injected in {attr}" in t.notes[0]
    _check(t, tmp_path)


@pytest.mark.usefixtures("lenient")
@pytest.mark.parametrize("where", ["same_view", "describe"])
def test_a_fault_before_a_call_is_recorded_leaves_the_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           where: str) -> None:
    # Two checks that run in the mode's handler before record_call's own guard: whether a
    # ``.data =`` changes anything (a lazy module's first forward made it raise), and the
    # description of a torch function met for the first time.
    from tracer.record import capture

    def materialise_and_step() -> list[torch.Tensor]:
        model = _model()
        for p in model.parameters():
            p.data = p.data.clone()
        return _step(model)

    want = materialise_and_step()
    if where == "same_view":
        _fail_after(monkeypatch, capture, "same_view", 0)  # type: ignore[arg-type]
    else:
        # Descriptions are kept for the process: this trace meets its functions first.
        monkeypatch.setattr(naming, "_DESCRIBED", {})
        _fail_after(monkeypatch, naming.ApiNames, "describe", 0)
    with pytest.warns(RuntimeWarning, match="gradtrace failed while recording"), tracer.trace(hash="md5") as t:
        got = materialise_and_step()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert f"injected in {where}" in t.notes[0]
    _check(t, tmp_path)
