"""The Python code a backward runs is recorded: tensor hooks, hooks on leaves, module backward
hooks, post-accumulate-grad hooks, the forward that non-reentrant checkpointing recomputes, and
custom backward code (once each); gradtrace's own hooks record nothing."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as checkpoint

import tracer
from tests.models import accumulated_scaled_step
from tracer.model import Call, Trace

LEAN = {"hash": "none"}
FULL = {"hash": "none", "node_runs": True}


def _line(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}"))


def _backward_calls(t: Trace) -> list[Call]:
    return [c for c in t.calls if c.phase == "backward"]


def _last_line(t: Trace, call: Call) -> int:
    return call.stack[-1].line


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _hooked_step(**options: Any) -> tuple[Trace, torch.Tensor, torch.Tensor]:
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    with tracer.trace(**options) as t:
        h = (x * w).sin()
        h.register_hook(lambda g: g * 0.5)  # tensor hook
        w.register_hook(lambda g: g.clamp(-0.1, 0.1))  # leaf hook
        h.sum().backward()  # backward call
    return t, x, w


@pytest.mark.parametrize("options", [LEAN, FULL], ids=["lean", "node_runs"])
def test_tensor_and_leaf_hook_ops_are_backward_calls_at_the_hooks_lines(options: dict[str, Any]) -> None:
    t, _, w = _hooked_step(**options)
    calls = _backward_calls(t)
    assert [(c.name, c.api) for c in calls] == [("mul1", "Tensor.mul"), ("clamp0", "Tensor.clamp")]
    assert _last_line(t, calls[0]) == _line("tensor hook")
    assert _last_line(t, calls[1]) == _line("leaf hook")
    # Inside backward(): the stack runs through the line that called it.
    assert _line("backward call") in [f.line for f in calls[0].stack]
    # A tensor hook's gradient is named as the node it arrives at names it, also in a lean trace
    # (where no hook on the node before it saw it pass): sin's output gradient. A leaf's own hook
    # reads the gradient MulBackward made for w, named by its edge: w's gradient, input1@grad,
    # is what the hook returns, the value w.grad gets (docs/trace-format.md).
    assert calls[0].inputs == ["sin0:out@grad"] and calls[1].inputs == ["mul0/MulBackward0:grad1"]
    # Each belongs to the node whose hook it is: beside sin0 in the report, in w's accumulator.
    assert [c.parent for c in calls] == ["sin0/SinBackward0", "input1/AccumulateGrad"]
    assert t.tensors["sin0:out@grad"].role == "grad"
    # What the leaf's accumulator received is the clamped gradient, w.grad itself, as w@grad.
    acc = next(s for s in t.backward_runs[0].steps if s.node == "input1/AccumulateGrad")
    assert calls[1].outputs == ["clamp0:out"] and acc.grads_in == ["input1@grad"]
    assert t.tensors["input1@grad"].producer == "clamp0" and t.tensors["input1@grad"].role == "grad"
    assert float(w.grad.abs().max()) == pytest.approx(0.1)  # type: ignore[union-attr]


def test_with_every_run_the_hooks_inputs_and_outputs_link_into_the_nodes() -> None:
    t, _, _ = _hooked_step(**FULL)
    mul, clamp = _backward_calls(t)
    steps = {s.node: s for s in t.backward_runs[0].steps}
    # The tensor hook gets the gradient SumBackward passed on, and SinBackward gets its result.
    assert mul.inputs == steps["sum0/SumBackward0"].grads_out == ["sin0:out@grad"]
    assert steps["sin0/SinBackward0"].grads_in == mul.outputs == ["mul1:out"]
    # The leaf hook gets MulBackward's gradient for w, and the accumulator its result, as w's
    # gradient (the value of clamp0:out, made by clamp0).
    assert clamp.inputs == [steps["mul0/MulBackward0"].grads_out[1]] == ["mul0/MulBackward0:grad1"]
    assert clamp.outputs == ["clamp0:out"] and steps["input1/AccumulateGrad"].grads_in == ["input1@grad"]
    assert t.tensors["input1@grad"].producer == "clamp0"


def test_a_second_backward_names_the_hooks_gradient_for_its_run() -> None:
    x = torch.randn(3, requires_grad=True)
    with tracer.trace(hash="none") as t:
        y = x.exp()
        y.register_hook(lambda g: g * 2)
        z = y.sum()
        z.backward(retain_graph=True)
        z.backward()
    assert [c.inputs for c in _backward_calls(t)] == [["exp0:out@grad"], ["exp0:out@grad#1"]]


def test_a_tensor_the_hook_closes_over_keeps_its_own_name() -> None:
    """Only a tensor of the shape one of the node's slots takes is taken for its gradient."""
    x = torch.randn(3, requires_grad=True)
    scale = torch.full((1,), 0.5)  # made before the block, first seen by the hook
    with tracer.trace(hash="none") as t:
        y = x.exp()
        y.register_hook(lambda g: g * scale)
        y.sum().backward()
    (mul,) = _backward_calls(t)
    assert mul.inputs == ["exp0:out@grad", "input1"] and t.tensors["input1"].role == "input"


def test_hook_values_are_hashed_like_any_call() -> None:
    seen: dict[str, torch.Tensor] = {}
    x = torch.randn(4, requires_grad=True)
    with tracer.trace(hash="md5") as t:
        y = x.exp()
        y.register_hook(lambda g: seen.setdefault("out", g * 3))
        y.sum().backward()
    (mul,) = _backward_calls(t)
    assert t.tensors[mul.outputs[0]].md5 == _md5(seen["out"])


def test_module_backward_hook_ops_are_recorded() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    norms: list[float] = []

    def hook(module: nn.Module, grad_in: tuple[Any, ...], grad_out: tuple[Any, ...]) -> None:
        norms.append(float(grad_out[0].norm()))  # module hook

    model[1].register_full_backward_hook(hook)
    with tracer.trace(hash="none") as t:
        model(torch.randn(5, 4)).square().mean().backward()
    norm = [c for c in _backward_calls(t) if c.api.endswith("norm")]
    assert len(norm) == 1 and len(norms) == 1
    assert _last_line(t, norm[0]) == _line("module hook")


def test_post_accumulate_grad_hook_ops_are_recorded_and_make_new_versions() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)

    def halve(p: torch.Tensor) -> None:
        p.grad.mul_(0.5)  # type: ignore[union-attr]  # post hook

    for p in lin.parameters():
        p.register_post_accumulate_grad_hook(halve)
    with tracer.trace(hash="md5") as t:
        lin(torch.randn(4, 3)).sum().backward()
    scaled = [c for c in _backward_calls(t) if c.api == "Tensor.mul_"]
    assert len(scaled) == 2 and {_last_line(t, c) for c in scaled} == {_line("post hook")}
    assert sorted(c.inputs[0] for c in scaled) == ["bias@grad", "weight@grad"]
    assert sorted(c.outputs[0] for c in scaled) == ["bias@grad@v1", "weight@grad@v1"]
    assert t.tensors["weight@grad@v1"].md5 == _md5(lin.weight.grad)  # type: ignore[arg-type]



@pytest.mark.parametrize("options", [LEAN, {"hash": "md5"}], ids=["lean", "md5"])
def test_a_post_accumulate_grad_hook_reading_an_accumulated_grad_names_the_accumulator_as_its_maker(
        options: dict[str, Any]) -> None:
    """The second backward adds into the ``.grad`` the hook halved: the hook reads the sum before
    the accumulator's own hook has named it; the sum is still the accumulator's."""
    torch.manual_seed(0)
    lin, x = nn.Linear(3, 2), torch.randn(4, 3)

    def halve(p: torch.Tensor) -> None:
        p.grad.mul_(0.5)  # type: ignore[union-attr]

    lin.bias.register_post_accumulate_grad_hook(halve)
    with tracer.trace(**options) as t:
        lin(x).sum().backward()
        lin(x).pow(2).sum().backward()  # accumulates into the halved .grad
    summed = t.tensors["bias@grad@v2"]
    assert (summed.producer, summed.previous) == ("bias/AccumulateGrad", "bias@grad@v1")
    assert [c.inputs for c in _backward_calls(t) if c.api == "Tensor.mul_"] == [["bias@grad"], ["bias@grad@v2"]]
    assert t.tensors["weight@grad@v1"].producer == "weight/AccumulateGrad"  # (no hook: the same story)
    assert not any(r.producer is None and r.previous is not None for r in t.tensors.values())
    if options.get("hash") == "md5":
        assert t.tensors["bias@grad@v3"].md5 == _md5(lin.bias.grad)  # type: ignore[arg-type]

@pytest.mark.parametrize("options", [LEAN, FULL], ids=["lean", "node_runs"])
def test_non_reentrant_checkpoint_recomputation_is_recorded_in_backward(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    x = torch.randn(3, 4, requires_grad=True)
    with tracer.trace(**options) as t:
        y = checkpoint.checkpoint(block, x, use_reentrant=False).sum()
        y.backward()
    # The block's own calls (checkpoint's bookkeeping around them differs by machine: on a host
    # with CUDA it makes empty tensors for the random states first).
    forward = [c.api for c in t.calls if c.phase == "forward" and c.module]
    again = [c.api for c in _backward_calls(t) if c.module]
    assert forward[:3] == ["torch.nn.functional.linear", "torch.nn.functional.gelu", "torch.nn.functional.linear"]
    assert again[:2] == ["torch.nn.functional.linear", "torch.nn.functional.gelu"]  # recomputed
    # Every parameter still gets its gradient, linked to its accumulator.
    for p in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert f"{p}@grad" in t.tensors


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            inner = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(inner.sin().sum(), inner)  # nested grad
        return g * 2 + dx * 0


def test_custom_backward_ops_are_recorded_once_also_around_a_nested_grad() -> None:
    x = torch.randn(3, requires_grad=True)
    with tracer.trace(hash="none") as t:
        _Double.apply(x).sum().backward()
    apis = [c.api for c in _backward_calls(t)]
    # sin, sum, the nested grad's own cos/mul (its backward), then g * 2, dx * 0, the add: each once.
    assert apis.count("Tensor.sin") == 1 and apis.count("Tensor.sum") == 1
    assert apis.count("Tensor.mul") == 2 and apis.count("Tensor.add") == 1
    assert [r.api for r in t.backward_runs] == ["Tensor.backward", "torch.autograd.grad"]
    names = [c.name for c in t.calls]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("options", [{"hash": "md5"}, {"hash": "none", "stats": True}, LEAN], ids=["md5", "stats", "lean"])
def test_gradtraces_own_hooks_record_nothing(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    opt = torch.optim.AdamW(model.parameters())
    with tracer.trace(**options) as t:
        model(torch.randn(2, 3, 6, 6)).square().mean().backward()
        opt.step()
    assert _backward_calls(t) == []


def test_after_the_block_hooks_run_untraced_and_the_engine_entry_is_restored() -> None:
    entry = torch.autograd._engine_run_backward if hasattr(torch.autograd, "_engine_run_backward") else None
    x = torch.randn(3, requires_grad=True)
    with tracer.trace(hash="none") as t:
        (x * 2).sum().backward()
    n = len(t.calls)
    y = x * 3
    y.register_hook(lambda g: g + 1)
    y.sum().backward()
    assert len(t.calls) == n
    if entry is not None:
        assert torch.autograd._engine_run_backward is entry


def test_a_hook_that_raises_leaves_a_readable_trace() -> None:
    x = torch.randn(3, requires_grad=True)

    def bad(g: torch.Tensor) -> torch.Tensor:
        g.mul(2)
        raise ValueError("hook failed")  # raising hook

    with pytest.raises(ValueError, match="hook failed"), tracer.trace(hash="none") as t:
        y = x.exp()
        y.register_hook(bad)
        y.sum().backward()
    (mul,) = _backward_calls(t)
    assert mul.api == "Tensor.mul" and _last_line(t, mul) == _line("raising hook") - 1
    assert t.backward_runs[0].status == "failed"
    # A hook was registered: even this lean trace recorded every node's run of this backward,
    # so the note names the node whose hook raised, and the line.
    note = t.backward_runs[0].error
    assert "failed in grad node exp0/ExpBackward0" in note
    assert f'raised in Python code the backward ran, File "{__file__}", line {_line("raising hook")}' in note


def test_a_lean_trace_that_cannot_name_the_node_says_where_python_code_raised() -> None:
    """A hook on the grad node itself (``grad_fn.register_hook``: no torch function the trace
    sees) in a lean trace: the note does not blame an unknown built-in node, it gives the line."""
    x = torch.randn(3, requires_grad=True)

    def bad(grad_inputs: Any, grad_outputs: Any) -> None:
        raise ValueError("node hook failed")  # raising node hook

    with pytest.raises(ValueError, match="node hook failed"), tracer.trace(hash="none") as t:
        y = x.exp()
        y.grad_fn.register_hook(bad)
        y.sum().backward()
    note = t.backward_runs[0].error
    assert f'failed in Python code it ran (a hook, a custom backward), raised at File "{__file__}", ' \
           f'line {_line("raising node hook")}, in ' in note
    assert "built-in grad node" not in note


def test_with_every_run_a_raising_hooks_note_names_its_node_and_its_line() -> None:
    x = torch.randn(3, requires_grad=True)

    def bad(g: torch.Tensor) -> torch.Tensor:
        raise ValueError("hook failed")  # raising hook, every run

    with pytest.raises(ValueError, match="hook failed") as info, tracer.trace(**FULL):
        y = x.exp()
        y.register_hook(bad)
        y.sum().backward()
    note = "\n".join(info.value.__notes__)
    assert "failed in grad node exp0/ExpBackward0" in note
    assert f'raised in Python code the backward ran, File "{__file__}", line {_line("raising hook, every run")}' in note
    assert torch.autograd._engine_run_backward.__module__ == "torch.autograd.graph"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("options", [LEAN, FULL, {"hash": "md5"}], ids=["lean", "node_runs", "md5"])
def test_on_cuda_hook_and_custom_backward_ops_are_recorded_from_the_engine_threads(options: dict[str, Any]) -> None:
    """CUDA nodes run on the engine's device threads: the recorder's mode reaches them with the
    torch-function state the engine hands over. Each op once, at its own line."""
    x = torch.randn(64, device="cuda", requires_grad=True)
    w = torch.randn(64, device="cuda", requires_grad=True)
    with tracer.trace(**options) as t:
        h = _Double.apply(x * w).sin()
        h.register_hook(lambda g: g * 0.5)  # cuda tensor hook
        w.register_hook(lambda g: g.clamp(-0.1, 0.1))  # cuda leaf hook
        h.sum().backward()
    torch.cuda.synchronize()
    apis = [c.api for c in _backward_calls(t)]
    assert apis.count("Tensor.clamp") == 1 and apis.count("Tensor.sin") == 1  # leaf hook; _Double's backward
    by_api = {c.api: c for c in _backward_calls(t)}
    assert _last_line(t, by_api["Tensor.clamp"]) == _line("cuda leaf hook")
    assert any(_last_line(t, c) == _line("cuda tensor hook") for c in _backward_calls(t) if c.api == "Tensor.mul")
    assert [r.api for r in t.backward_runs] == ["Tensor.backward", "torch.autograd.grad"]


def test_check_numerics_names_a_hooks_op_as_the_origin_of_a_backward_nan() -> None:
    x = torch.randn(3, requires_grad=True)
    with tracer.check_numerics() as t:
        y = x.exp()
        y.register_hook(lambda g: g * float("nan"))  # NaN hook
        y.sum().backward()
    nan = t.anomalies.backward_nan
    assert nan is not None and nan.origin
    assert nan.producer == "mul0" and nan.node == "exp0/ExpBackward0"
    assert nan.stack[-1].line == _line("NaN hook")


@pytest.mark.parametrize("options", [LEAN, {"hash": "md5"}], ids=["lean", "md5"])
def test_a_recipe_with_a_pruning_hook_records_it_for_every_micro_batch(options: dict[str, Any]) -> None:
    """A mask hook registered on a weight before the trace (pruning), two accumulated
    micro-batches, GradScaler, clipping and a fused AdamW: the hook's op is a backward call of
    the weight's accumulator in each micro-batch, reading that run's gradient, and the step
    comes out as without the trace."""
    def run(traced: bool) -> tuple[nn.Module, Trace | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 1))
        mask = (torch.arange(30).reshape(5, 6) % 3 != 0).float()
        model[0].weight.register_hook(lambda g: g * mask)  # pruning mask
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        batches = [torch.randn(4, 6) for _ in range(2)]
        with tracer.trace(**options) if traced else contextlib.nullcontext() as t:
            accumulated_scaled_step(model, opt, scaler, batches)
        return model, t

    plain, _ = run(False)
    model, t = run(True)
    assert t is not None
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    masked = [c for c in _backward_calls(t) if _last_line(t, c) == _line("pruning mask")]
    assert [c.parent for c in masked] == ["0.weight/AccumulateGrad"] * 2
    # The mask reads the gradient TBackward made for the weight; what it returns is the weight's
    # gradient of that micro-batch, and .grad@v1 their sum, what the optimizer reads.
    assert [c.inputs[0] for c in masked] == ["linear0/TBackward0:grad0", "linear2/TBackward0:grad0#1"]
    acc = [s for r in t.backward_runs for s in r.steps if s.node == "0.weight/AccumulateGrad"]
    assert [s.grads_in for s in acc] == [["0.weight@grad"], ["0.weight@grad#1"]]
    assert [t.tensors[s.grads_in[0]].producer for s in acc] == [c.name for c in masked]
    if options.get("hash") == "md5":
        assert [t.tensors[s.grads_in[0]].md5 for s in acc] == [t.tensors[c.outputs[0]].md5 for c in masked]
    assert t.tensors["0.weight@grad@v1"].previous == "0.weight@grad"
    assert masked[0].inputs[1] == masked[1].inputs[1]  # the same mask, its own tensor
    assert t.tensors[masked[0].inputs[1]].role == "input"


def test_a_backward_under_forward_mode_ad_records_no_torch_reference_ops() -> None:
    # Inside a dual level the engine runs torch's Python references (torch._refs.mul calling
    # prims.mul) on meta tensors for the tangents: torch's own work, not calls of the program.
    import torch.autograd.forward_ad as fwAD

    x, v, w = torch.randn(4), torch.randn(4), torch.randn(4, requires_grad=True)
    expected = torch.cos(x * w.detach()) * x
    with tracer.trace(hash="md5") as t, fwAD.dual_level():
        y = (fwAD.make_dual(x, v) * w).sin().sum()
        primal, _ = fwAD.unpack_dual(y)
        primal.backward()
    assert [c.name for c in t.calls] == ["_make_dual0", "mul0", "sin0", "sum0", "_unpack_dual0"]
    assert not [c.api for c in t.calls if "prims" in c.api]
    assert torch.allclose(w.grad, expected)
    assert t["input2@grad"].md5 == _md5(w.grad)  # (w is the block's third input)
