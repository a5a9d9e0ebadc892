"""A ``torch.compile``d plain function (not a module) called inside a traced block is one opaque call
(kind ``compiled``) with its inputs and outputs linked and its stack at the user's line; the
compiled code runs as it does outside a trace: no graph break and no recompilation caused by
gradtrace, whether it was compiled before the block, inside it, or is called again after it."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import tracer
from export.diff import diff
from tests.conftest import requires_cuda
from tracer.model import Call, Trace

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402  (tests: Dynamo's own counters)

NOTE = "torch.compile regions are recorded as one opaque call each; the calls inside them were not seen"


def five_ops(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2 + x.cos()).relu().sum()


def failing(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > 4:
        raise ValueError("too long")
    return x * 2


def call(t: Trace, name: str) -> Call:
    found = t.get(name)
    assert isinstance(found, Call), name
    return found


def line_of(t: Trace, name: str) -> int:
    return t.stack_of(call(t, name).stack_id)[-1].line


def this_line() -> int:
    return sys._getframe(1).f_lineno


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("compiled_before", [True, False])
def test_compiled_function_is_one_call_without_graph_breaks(backend: str, compiled_before: bool) -> None:
    compiled = torch.compile(five_ops, backend=backend)
    x = torch.randn(8, requires_grad=True)
    if compiled_before:
        compiled(x)
    with tracer.trace() as t:
        line = this_line() + 1
        y = compiled(x)
        z = y * 3
        z.backward()
        again = compiled(x)
    compiled(x)  # after the block: the same compiled code
    assert torch.equal(y, five_ops(x)) and torch.equal(again, y)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert [(c.name, c.kind, c.api) for c in t.calls] == [
        ("compiled0", "compiled", "torch.compile"), ("mul0", "op", "Tensor.mul"),
        ("compiled1", "compiled", "torch.compile")]
    first = call(t, "compiled0")
    assert first.inputs == ["input0"] and first.outputs == ["compiled0:out"]
    assert call(t, "mul0").inputs == ["compiled0:out"]
    assert t.tensors["compiled0:out"].producer == "compiled0"
    assert line_of(t, "compiled0") == line
    assert line_of(t, "compiled1") == line + 3
    assert NOTE in t.notes
    # its backward is the compiled call's: every grad node it made points back at it
    made = [n for n in t.grad_nodes if n.call == "compiled0"]
    assert made and all(n.name.startswith("compiled0/") for n in made)
    assert x.grad is not None and torch.equal(x.grad, torch.autograd.grad(five_ops(x) * 3, x)[0])


def test_recording_goes_on_after_a_compiled_call_raises() -> None:
    compiled = torch.compile(failing, backend="eager")
    x = torch.randn(8)
    with tracer.trace() as t:
        with pytest.raises(ValueError, match="too long"):
            compiled(x)
        after = x.exp()
    assert torch.equal(after, x.exp())
    assert [(c.name, c.kind) for c in t.calls] == [("compiled0", "compiled"), ("exp0", "op")]
    assert call(t, "compiled0").error == "ValueError: too long"
    assert call(t, "exp0").inputs == ["input0"]


def test_compiled_call_inside_an_except_block_is_not_taken_for_a_failure() -> None:
    compiled = torch.compile(five_ops, backend="eager")
    x = torch.randn(8)
    with tracer.trace() as t:
        try:
            raise KeyError("handled by the user")
        except KeyError:
            y = compiled(x)
    assert call(t, "compiled0").error is None
    assert call(t, "compiled0").outputs == ["compiled0:out"] and torch.equal(y, five_ops(x))


def test_nested_compiled_function_is_one_call() -> None:
    inner = torch.compile(five_ops, backend="eager")

    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x) + x.sum()

    compiled = torch.compile(outer, backend="eager")
    x = torch.randn(8)
    with tracer.trace() as t:
        compiled(x)
    assert [(c.name, c.kind) for c in t.calls] == [("compiled0", "compiled")]
    assert dict(counters["graph_break"]) == {}


@pytest.mark.filterwarnings("error")
def test_compiled_module_compiled_before_the_block_does_not_recompile() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, 4)
    compiled(x)
    with tracer.trace() as t:
        out = compiled(x)
        out.sum().backward()
    compiled(x)
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {}
    assert [c.kind for c in t.calls] == ["compiled", "op"]
    assert t.calls[0].outputs == [t.calls[1].inputs[0]]


def test_other_threads_compiled_calls_are_left_alone() -> None:
    compiled = torch.compile(five_ops, backend="eager")
    x = torch.randn(8)
    compiled(x)
    results: list[torch.Tensor] = []
    with tracer.trace() as t:
        worker = threading.Thread(target=lambda: results.append(compiled(x)))
        worker.start()
        worker.join()
        compiled(x)
    assert torch.equal(results[0], five_ops(x))
    assert [c.name for c in t.calls] == ["compiled0"]


def test_nothing_stays_installed_after_the_block() -> None:
    from torch._dynamo.eval_frame import _TorchDynamoContext

    compiled = torch.compile(five_ops, backend="eager")
    x = torch.randn(8)
    with pytest.raises(RuntimeError, match="boom"), tracer.trace():
        compiled(x)
        raise RuntimeError("boom")
    assert "enter_exit_hooks" not in vars(_TorchDynamoContext)
    assert sys.getprofile() is None
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None:
        assert all(monitoring.get_tool(i) != "gradtrace" for i in range(6))
    assert torch._C._len_torch_function_stack() == 0
    with tracer.trace() as plain:
        five_ops(x)
    assert [c.kind for c in plain.calls] == ["op"] * 6 and NOTE not in plain.notes


@requires_cuda
@pytest.mark.cuda
def test_inductor_on_cuda_is_one_call_without_recompiling() -> None:
    compiled = torch.compile(five_ops)  # the default backend: Inductor, Triton kernels
    x = torch.randn(1024, device="cuda", requires_grad=True)
    compiled(x)
    with tracer.trace(hash="fast") as t:
        y = compiled(x)
        y.backward()
    compiled(x)
    assert counters["stats"]["unique_graphs"] == 1 and dict(counters["graph_break"]) == {}
    assert [c.kind for c in t.calls] == ["compiled"]
    out = t.tensors[t.calls[0].outputs[0]]
    assert out.fingerprint is not None and out.device.startswith("cuda")
    assert torch.allclose(y, five_ops(x))


def test_a_compiled_models_parameters_have_the_models_own_names() -> None:
    """torch.compile's wrapper and the model it compiles are one model: its parameters and modules
    are named as an eager run names them (``0.weight``, not ``_orig_mod.0.weight``), so a
    compiled run and an eager one compare parameter by parameter."""

    def step(compile_it: bool) -> tracer.Trace:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        run = torch.compile(model, backend="aot_eager") if compile_it else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4)
        with tracer.trace(hash="md5") as t:
            run(x).sum().backward()
            opt.step()
        return t

    compiled, eager = step(True), step(False)
    params = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [n for n, r in compiled.tensors.items() if r.role == "param" and r.previous is None] == params
    assert compiled.modules == eager.modules == {"": "Sequential", "0": "Linear", "1": "ReLU", "2": "Linear"}
    r = diff(eager, compiled)
    assert sorted(p.name for p in r.params) == sorted(params)
    assert all(p.only_in is None for p in r.params)
