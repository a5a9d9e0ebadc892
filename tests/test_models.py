"""Recording on real models, cross-checked against PyTorch's own autograd graph."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

import tracer
from tests.models import MLP, NestedFnModel, SmallCNN, hf_loss, hf_model


def _walk(root) -> list:
    """Every node reachable from ``root`` (PyTorch's view, independent of the tracer)."""
    seen, order, todo = set(), [], [root]
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        order.append(n)
        todo.extend(nx for nx, _ in n.next_functions)
    return order


def _fire(fired: list[str], kind: str, grads) -> None:
    fired.append(kind)


def _trace_step(model, make_loss, optimizer=True):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
    fired: list[str] = []
    with tracer.trace() as t:
        loss = make_loss()
        nodes = _walk(loss.grad_fn)
        # Independent observation of the backward order, by PyTorch's own node hooks.
        for n in nodes:
            kind = type(n).__name__
            n.register_prehook(functools.partial(_fire, fired, kind))
        loss.backward()
        if opt is not None:
            opt.step()
    return t, nodes, fired


def _check_graph(t: tracer.Trace, nodes: list, fired: list[str]) -> None:
    recorded = [n for n in t.grad_nodes if not n.external]
    # Every node PyTorch reaches from the loss is recorded (same classes, same counts) ...
    assert Counter(type(n).__name__ for n in nodes) == Counter(n.kind for n in recorded)
    assert not [n for n in t.grad_nodes if n.external], "no node may come from outside the block"
    calls = {c.name: c for c in t.calls}
    for n in recorded:
        # ... and linked: to the call that made it, or to the parameter it accumulates into.
        if n.kind == "AccumulateGrad":
            assert n.param is not None and n.param in t.tensors
            assert n.name == f"{n.param}/AccumulateGrad"
        else:
            assert n.call in calls, n
            assert n.name in calls[n.call].grad_nodes
            assert n.name.startswith(f"{n.call}/{n.kind}")
            assert n.stack == calls[n.call].stack
        for nxt in n.next:
            assert nxt is None or nxt in t, (n.name, nxt)
    # Every call whose (new) output requires grad created at least one node.
    for c in t.calls:
        if c.phase != "forward" or c.kind == "compiled":
            continue
        # (parameters updated in place by the optimizer stay leaves: they have no node)
        new_outputs = [o for o in c.outputs if t.tensors[o].producer == c.name and t.tensors[o].role == "output"]
        if any(t.tensors[o].requires_grad for o in new_outputs):
            assert c.grad_nodes, f"{c.name} ({c.api}) outputs a tensor requiring grad but has no grad node"
    # The backward order is the order PyTorch's own hooks fired.
    (run,) = t.backward_runs
    kinds = {n.name: n.kind for n in t.grad_nodes}
    assert [kinds[n] for n in run.order] == fired
    assert len(run.order) == len(nodes)
    # Parameter gradients land on the parameter's name and are hashed.
    for n in recorded:
        if n.kind == "AccumulateGrad" and t.tensors[n.param].role == "param":
            assert f"{n.param}@grad" in t.tensors
            assert t.tensors[f"{n.param}@grad"].md5


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_transformers_models_every_node_recorded_and_linked(kind):
    model, x = hf_model(kind)
    t, nodes, fired = _trace_step(model, lambda: hf_loss(model, x))
    _check_graph(t, nodes, fired)
    # Module paths are the model's own.
    modules = {c.module for c in t.calls}
    prefix = "transformer.h.0" if kind == "gpt2" else "model.layers.0"
    assert any(m.startswith(prefix) for m in modules), sorted(modules)[:20]
    assert t.backward_runs[0].stack[-1].code == "loss.backward()"


def test_gpt2_linear_names_module_paths_and_param_grads():
    model, x = hf_model("gpt2")
    t, _, _ = _trace_step(model, lambda: hf_loss(model, x))
    # GPT-2 uses Conv1D (addmm) for its projections; the call is linked to the module path.
    c_attn = [c for c in t.calls if c.module == "transformer.h.0.attn.c_attn"]
    (mm,) = [c for c in c_attn if c.api == "torch.addmm"]
    assert mm.inputs[0] == "transformer.h.0.attn.c_attn.bias"
    assert mm.inputs[2] == "transformer.h.0.attn.c_attn.weight"
    assert mm.grad_nodes == [f"{mm.name}/AddmmBackward0"]
    assert "transformer.h.0.attn.c_attn.weight@grad" in t.tensors
    # Tied embeddings: one parameter, one name, one accumulator.
    assert sum(1 for n in t.grad_nodes if n.param == "transformer.wte.weight") == 1


def test_mixtral_router_and_experts_recorded():
    model, x = hf_model("mixtral")
    t, _, _ = _trace_step(model, lambda: hf_loss(model, x))
    apis = Counter(c.api for c in t.calls)
    assert apis["torch.topk"] >= 2  # one router top-k per layer
    assert any(".experts" in c.module for c in t.calls)


def test_cnn_with_batchnorm():
    model = SmallCNN()
    x = torch.randn(2, 3, 8, 8)
    t, nodes, fired = _trace_step(model, lambda: torch.nn.functional.cross_entropy(model(x), torch.tensor([1, 2])))
    _check_graph(t, nodes, fired)
    bn = [c for c in t.calls if c.module == "bn1"]
    # BatchNorm counts batches in place, then normalises.
    assert [c.api for c in bn] == ["Tensor.add_", "torch.nn.functional.batch_norm"]
    assert bn[0].mutated == ["bn1.num_batches_tracked@v1"]
    bn = bn[1:]
    # Running statistics are buffers updated in place: new versions under the buffer's name.
    assert "bn1.running_mean@v1" in t.tensors
    assert t.tensors["bn1.running_mean@v1"].producer == bn[0].name
    assert t["conv2d0"].module == "conv1" and t["conv2d1"].module == "conv2"


def test_nested_custom_functions():
    model = NestedFnModel()
    x = torch.randn(4, 6)
    t, nodes, fired = _trace_step(model, lambda: model(x).pow(2).sum())
    _check_graph(t, nodes, fired)
    fn_calls = [c for c in t.calls if c.kind == "function"]
    by_name = {c.name: c for c in fn_calls}
    # Forward nesting: Scale inside ScaledTanh, ScaledTanh inside Outer.
    assert by_name["ScaledTanh0"].parent is None
    assert by_name["Scale0"].parent == "ScaledTanh0"
    assert by_name["Outer0"].parent is None
    assert by_name["ScaledTanh1"].parent == "Outer0"
    assert by_name["Scale1"].parent == "ScaledTanh1"
    # The Function's own grad node is linked to its call.
    assert by_name["ScaledTanh0"].grad_nodes == ["ScaledTanh0/ScaledTanhBackward"]
    assert by_name["Outer0"].grad_nodes == ["Outer0/OuterBackward"]
    # ops inside a Function's forward are recorded as children of it
    tanh0 = t["tanh0"]
    assert tanh0.parent == "ScaledTanh0" and tanh0.grad_nodes == []
    # Backward nesting: ScaledTanh's backward applies Scale; recorded as a backward-phase call
    # whose parent is the grad node that ran it.
    bwd = [c for c in fn_calls if c.phase == "backward"]
    assert bwd and all(c.api.endswith("Scale.apply") for c in bwd)
    assert bwd[0].parent == "ScaledTanh0/ScaledTanhBackward"


def test_custom_op_from_torch_library():
    lib_name = "gradtrace_test"

    @torch.library.custom_op(f"{lib_name}::cube", mutates_args=())
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x * x * x

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def bwd(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g

    cube.register_autograd(bwd, setup_context=setup)
    x = torch.randn(5, requires_grad=True)
    with tracer.trace() as t:
        y = cube(x)
        y.sum().backward()
    (call,) = [c for c in t.calls if c.kind == "custom_op"]
    assert call.api == f"torch.ops.{lib_name}.cube.default"
    assert call.outputs == [f"{call.name}:out"]
    assert call.grad_nodes, "the custom op's autograd node is linked to it"
    assert call.grad_nodes[0] in t.backward_runs[0].order
    assert torch.allclose(x.grad, 3 * x.detach() ** 2)


def test_changed_weight_changes_exactly_downstream_checksums():
    def run(bump: bool) -> tracer.Trace:
        torch.manual_seed(0)
        model = MLP(width=8, depth=3)
        if bump:
            with torch.no_grad():
                model.layers[1].weight[0, 0] += 0.5
        x = torch.randn(4, 8)
        with tracer.trace() as t:
            model(x).sum().backward()
        return t

    a, b = run(False), run(True)
    assert [c.name for c in a.calls] == [c.name for c in b.calls]
    # Forward tensors downstream of layers.1.weight, from the trace's own data flow.
    downstream = {"layers.1.weight"}
    for c in a.calls:
        if set(c.inputs) & downstream:
            downstream.update(c.outputs)
    forward = [n for n, r in a.tensors.items() if r.role in ("output", "param", "input")]
    differing = {n for n in forward if a.tensors[n].md5 != b.tensors[n].md5}
    assert differing == downstream
    assert "linear0:out" not in differing and "linear1:out" in differing


def test_two_seeded_runs_identical_names_and_checksums():
    def run() -> tracer.Trace:
        torch.manual_seed(1)
        model, x = hf_model("gpt2")
        opt = torch.optim.AdamW(model.parameters())
        with tracer.trace() as t:
            hf_loss(model, x).backward()
            opt.step()
        return t

    a, b = run(), run()
    assert [c.name for c in a.calls] == [c.name for c in b.calls]
    assert [n.name for n in a.grad_nodes] == [n.name for n in b.grad_nodes]
    assert [(r.name, r.md5) for r in a.tensors_in_order()] == [(r.name, r.md5) for r in b.tensors_in_order()]
    assert a.backward_runs[0].order == b.backward_runs[0].order
    assert all(r.md5 for r in a.tensors.values())
