"""``node_runs``: a trace without checksums or stats hooks only the grad nodes whose runs it needs
(accumulators, custom Functions); the graph, names, links and stacks are the same as with every
node hooked, and a backward that needs the runs (a listener, ``create_graph``) hooks the rest."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import tracer
from tests.models import accumulated_scaled_step
from tracer.model import Trace
from tracer.options import TraceError
from tracer.record.listeners import Listener
from tracer.record.recorder import active_recorder


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def _step(model: nn.Module, x: torch.Tensor, **options: Any) -> Trace:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(**options) as t:
        loss = _Scale.apply(model(x)).square().mean()
        loss.backward()
        opt.step()
    return t


def _graph(t: Trace) -> list[tuple[Any, ...]]:
    return [(n.name, n.kind, n.call, n.param, n.next, n.stack)
            for n in t.grad_nodes]


def _lean_and_full(run: Callable[..., Trace]) -> tuple[Trace, Trace]:
    """``run`` with ``hash="none"`` (lean) and with every node's run, from one line (the stacks
    end at the caller's line); the same grad nodes, edges, calls, links and stacks in both."""
    lean, full = (run(**options) for options in ({"hash": "none"}, {"hash": "none", "node_runs": True}))
    assert _graph(lean) == _graph(full)
    assert [(c.name, c.api, c.inputs, c.outputs, c.grad_nodes, c.stack) for c in lean.calls] == \
        [(c.name, c.api, c.inputs, c.outputs, c.grad_nodes, c.stack) for c in full.calls]
    return lean, full


def test_a_trace_without_checksums_hooks_only_the_nodes_it_needs() -> None:
    x = torch.randn(2, 3, 6, 6)
    # The same graph, calls and links, stacks included.
    lean, full = _lean_and_full(lambda **options: _step(_cnn(), x, **options))
    kinds = {n.name: n.kind for n in lean.grad_nodes}
    ran = lean.backward_runs[0].order
    # Runs: the accumulators and the custom Function's node, in the engine's order (as in full).
    assert ran == [n for n in full.backward_runs[0].order if kinds[n] in ("AccumulateGrad", "_ScaleBackward")]
    assert sum(kinds[n] == "AccumulateGrad" for n in ran) == 6 and any(kinds[n] == "_ScaleBackward" for n in ran)
    assert len(full.backward_runs[0].order) > len(ran) + 5
    # Every parameter's gradient is named, linked to its accumulator and into the step.
    step = next(c for c in lean.calls if c.kind == "optimizer")
    for p in ("0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "4.bias"):
        assert f"{p}@grad" in lean.tensors and f"{p}@grad" in step.inputs
        assert lean.tensors[f"{p}@grad"].role == "grad"
    assert lean.header["node_runs"] is False and full.header["node_runs"] is True


def test_checksums_and_stats_hook_every_node() -> None:
    x = torch.randn(2, 3, 6, 6)
    for options in ({"hash": "md5"}, {"hash": "none", "stats": True}, {"hash": "fast"}):
        t = _step(_cnn(), x, **options)
        assert t.header["node_runs"] is True
        assert len(t.backward_runs[0].order) == sum(1 for n in t.grad_nodes if n.kind != "AccumulateGrad") + 6
    with tracer.check_numerics() as t:
        _cnn()(x).sum().backward()
    assert any(t[n].kind == "ConvolutionBackward0" for n in t.backward_runs[0].order)  # type: ignore[union-attr]


class _NodeCounter(Listener):
    def __init__(self) -> None:
        self.ended: list[str] = []

    def on_node_end(self, trace: Trace, node: str, step: Any, grads: tuple[Any, ...]) -> None:
        self.ended.append(node)


def test_a_listener_attached_before_the_backward_gets_every_node() -> None:
    """A listener that needs node runs (here attached after the forward, as a log scope around
    the backward is) finds them: the backward hooks the nodes left waiting."""
    model = _cnn()
    with tracer.trace(hash="none") as t:
        loss = model(torch.randn(2, 3, 6, 6)).sum()
        counter = _NodeCounter()
        rec = active_recorder()
        assert rec is not None
        rec.listeners.append(counter)
        loss.backward()
    assert counter.ended == t.backward_runs[0].order
    assert {t[n].kind for n in counter.ended} >= {"AddmmBackward0", "ConvolutionBackward0", "AccumulateGrad"}  # type: ignore[union-attr]


def test_a_log_scope_logs_the_backward_of_a_lean_trace(capfd: pytest.CaptureFixture[str]) -> None:
    model = _cnn()
    with tracer.trace(hash="none") as t, tracer.log_scope(level="DEBUG"):
        model(torch.randn(2, 3, 6, 6)).sum().backward()
    conv = next(n.name for n in t.grad_nodes if n.kind == "ConvolutionBackward0")
    assert conv in t.backward_runs[0].order
    logged = capfd.readouterr().err
    assert re.search(rf"bwd<\s+{re.escape(conv)}\s.*produced -, 0\.weight@grad", logged)


def test_create_graph_hooks_the_nodes_and_adopts_what_the_backward_makes() -> None:
    """A gradient penalty: the nodes the first backward makes belong to the node that made them,
    with or without checksums."""
    def penalty(**options: Any) -> Trace:
        torch.manual_seed(0)
        lin = nn.Linear(3, 1)
        x = torch.randn(4, 3, requires_grad=True)
        with tracer.trace(**options) as t:
            (g,) = torch.autograd.grad(torch.tanh(lin(x)).sum(), x, create_graph=True)
            g.square().sum().backward()
        return t

    lean, full = penalty(hash="none"), penalty(hash="none", node_runs=True)
    adopted = [(n.name, n.kind, n.parent) for n in lean.grad_nodes if n.parent is not None]
    assert adopted and adopted == [(n.name, n.kind, n.parent) for n in full.grad_nodes if n.parent is not None]
    assert not any(n.external for n in lean.grad_nodes)
    assert lean.backward_runs[0].order == full.backward_runs[0].order


def test_gradient_accumulation_names_each_runs_gradient_alike() -> None:
    def accumulate(**options: Any) -> Trace:
        model = _cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tracer.trace(**options) as t:
            for k in range(2):
                model(torch.full((2, 3, 6, 6), float(k))).sum().backward()
            opt.step()
        return t

    lean, full = accumulate(hash="none"), accumulate(hash="none", node_runs=True)
    grads = sorted(n for n, r in full.tensors.items() if r.role == "grad" and n.startswith("0.weight@grad"))
    assert grads == ["0.weight@grad", "0.weight@grad#1", "0.weight@grad@v1"]
    assert all(g in lean.tensors for g in grads)
    step = next(c for c in lean.calls if c.kind == "optimizer")
    assert "0.weight@grad@v1" in step.inputs


def _inplace_error(session: Any) -> tuple[RuntimeError, Trace]:
    model = nn.Linear(3, 3)
    with pytest.raises(RuntimeError) as info, session as t:
        y = torch.sigmoid(model(torch.randn(2, 3)))
        y.mul_(2)  # sigmoid's backward needs its output unchanged
        y.sum().backward()
    return info.value, t


def test_a_failing_built_in_node_is_named_where_runs_are_recorded() -> None:
    exc, t = _inplace_error(tracer.explain_errors())
    note = "\n".join(getattr(exc, "__notes__", []))
    assert "failed in grad node sigmoid0/SigmoidBackward0 [SigmoidBackward0]" in note
    assert t.header["node_runs"] is True and t.backward_runs[0].order == ["sum0/SumBackward0", "mul_0/MulBackward0"]


def test_a_failing_built_in_node_in_a_lean_trace_says_it_is_not_known() -> None:
    exc, t = _inplace_error(tracer.trace(hash="none"))
    note = "\n".join(getattr(exc, "__notes__", []))
    assert "failed in a built-in grad node; which one is not known" in note
    assert "failed in grad node" not in note
    assert "tracer.explain_errors()" in note and "modified by an inplace operation" in note
    assert t.backward_runs[0].status == "failed"


def test_a_custom_function_that_fails_is_named_in_a_lean_trace() -> None:
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad backward")

    with pytest.raises(ValueError) as info, tracer.trace(hash="none"):
        Bad.apply(torch.randn(3, requires_grad=True)).sum().backward()
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "failed in grad node Bad0/BadBackward [BadBackward]." in note
    assert "SumBackward0" not in note  # (its run, not recorded, must not be taken for unfinished)


def test_node_runs_must_be_a_bool_or_none() -> None:
    with pytest.raises(TraceError, match="node_runs"):
        tracer.trace(node_runs="yes")  # type: ignore[arg-type]


def test_a_saved_lean_trace_keeps_its_header_and_show_says_the_run_was_not_recorded(tmp_path: Any) -> None:
    from rich.console import Console

    from export.summary import render_record
    from tracer.model.fileformat import load

    t = _step(_cnn(), torch.randn(2, 3, 6, 6), hash="none")
    path = tmp_path / "lean.gtrace"
    t.save(str(path))
    back = load(path)
    assert back.header["node_runs"] is False
    assert back.backward_runs[0].order == t.backward_runs[0].order

    def shown(name: str) -> str:
        console = Console(record=True, width=200)
        render_record(back, name, console)
        return console.export_text()

    assert "- (runs of built-in nodes not recorded: node_runs)" in shown("linear0/AddmmBackward0")
    assert "backward0 step" in shown("4.weight/AccumulateGrad")


def test_what_needs_every_run_turns_it_on() -> None:
    """Kept values (a gradient's among them), memory records and log levels need every node's
    run; the step bounds count runs and ask for none."""
    from tracer.features.bounds import Bounds

    x = torch.randn(2, 3, 6, 6)
    assert _step(_cnn(), x, hash="none", keep_values=["*@grad"]).header["node_runs"] is True
    with tracer.trace(hash="none", memory=True) as t:
        _cnn()(x).sum().backward()
    assert any(t[n].kind == "ConvolutionBackward0" for n in t.backward_runs[0].order)  # type: ignore[union-attr]
    with tracer.trace(hash="none", listeners=[Bounds(max_bytes=10**9)]) as t:
        _cnn()(x).sum().backward()
    assert all(t[n].kind == "AccumulateGrad" for n in t.backward_runs[0].order)  # type: ignore[union-attr]
    assert _step(_cnn(), x, hash="md5", node_runs=False).header["node_runs"] is False


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_transformer_step_records_the_same_graph_lean_or_not(kind: str) -> None:
    """A Hugging Face model from a config, AdamW with its default (foreach) step: every call,
    grad node, edge, stack and parameter gradient alike; only built-in nodes' runs and the
    intermediate gradients they pass are left out."""
    pytest.importorskip("transformers")
    from tests.models import hf_loss, hf_model

    def run(**options: Any) -> Trace:
        torch.manual_seed(0)
        model, x = hf_model(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with tracer.trace(**options) as t:
            hf_loss(model, x).backward()
            opt.step()
        return t

    lean, full = _lean_and_full(run)
    lean_grads = {n for n, r in lean.tensors.items() if r.role == "grad"}
    full_grads = {n for n, r in full.tensors.items() if r.role == "grad"}
    params = {f"{p}@grad" for p, r in full.tensors.items() if r.role == "param" and r.previous is None}
    assert params and params <= lean_grads <= full_grads
    assert lean_grads == params  # nothing else: the intermediate gradients are left out
    kinds = {n.name: n.kind for n in lean.grad_nodes}
    assert {kinds[n] for n in lean.backward_runs[0].order} == {"AccumulateGrad"}
    assert lean.backward_runs[0].order == [n for n in full.backward_runs[0].order if kinds[n] == "AccumulateGrad"]


@pytest.mark.parametrize("options", [{"hash": "none"}, {"hash": "md5"}], ids=["lean", "md5"])
def test_traced_steps_leave_no_hook_on_accumulators(node_hook_calls: list[str], options: dict[str, Any]) -> None:
    """A training loop keeps the last loss (and its graph's accumulators) alive until the next
    forward, so the parameters' accumulator objects live on from step to step: each trace takes
    its hooks off them when it ends. Before, every traced step added a pair that every later
    backward called (60 traced steps: 480 hook calls a step instead of 8)."""
    calls = node_hook_calls
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for _ in range(12):
        calls.clear()
        with tracer.trace(**options):
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(4, 8)).sum()  # the last step's loss lives until here
            loss.backward()
            opt.step()
        per_step.append(len(calls))
    # 4 accumulators: a pre-hook and a hook each where checksums are read (the pre-hook reads a
    # waiting .grad before the accumulator adds into it), the hook alone in a lean trace.
    assert per_step == [4 if options["hash"] == "none" else 8] * 12
    calls.clear()
    model(torch.randn(4, 8)).sum().backward()  # untraced: none of gradtrace's hooks is left
    assert calls == [] and loss is not None


def test_a_recipe_records_the_same_calls_and_gradients_lean_or_not() -> None:
    """Two accumulated micro-batches, GradScaler, clipping and a fused AdamW: every call (the
    scaler's unscale and the clipping included), grad node and stack alike, and every gradient a
    call reads (each parameter's, accumulated) named alike."""
    def recipe(**options: Any) -> Trace:
        model = _cnn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        torch.manual_seed(1)
        batches = [torch.randn(2, 3, 6, 6) for _ in range(2)]
        with tracer.trace(**options) as t:
            opt.zero_grad(set_to_none=True)
            accumulated_scaled_step(model, opt, scaler, batches)
        return t

    lean, full = _lean_and_full(recipe)
    read = {i for c in full.calls for i in c.inputs if "@grad" in i}
    assert "0.weight@grad@v1" in read and read <= set(lean.tensors)
    assert len(lean.backward_runs) == 2


def _hooked_on_the_node(**options: Any) -> Trace:
    x = torch.randn(3, requires_grad=True)
    with tracer.trace(**options) as t:
        y = (x * 2).exp()
        y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0] * 3,))  # gradtrace cannot see this
        y.sum().backward()
    return t


def test_a_hook_on_a_grad_node_itself_is_noted_where_node_runs_are_off() -> None:
    """A hook registered with ``grad_fn.register_hook`` reads the node's gradients; in a trace that
    does not record that node's run their names are not known: the tensor stays an input and
    a note names the node and says how to have it named."""
    lean = _hooked_on_the_node(hash="none")
    (mul,) = [c for c in lean.calls if c.phase == "backward"]
    assert mul.inputs == ["input1"] and mul.parent == "exp0/ExpBackward0"
    assert [n for n in lean.notes if "exp0/ExpBackward0" in n] == [
        "a hook of grad node exp0/ExpBackward0 read input1, a tensor without a name: if it is one of the node's "
        "gradients (a hook registered on the node itself, grad_fn.register_hook, which gradtrace cannot see), its "
        "name is not known because the node's run was not recorded; trace(node_runs=True) names every node's "
        "gradients"]
    full = _hooked_on_the_node(hash="none", node_runs=True)
    (mul,) = [c for c in full.calls if c.phase == "backward"]
    assert mul.inputs == ["mul0:out@grad"] and not full.notes


def test_a_tensor_hook_gets_no_such_note() -> None:
    """Tensor hooks are seen (Tensor.register_hook): the backward records the runs they need."""
    x = torch.randn(3, requires_grad=True)
    with tracer.trace(hash="none") as t:
        y = (x * 2).exp()
        y.register_hook(lambda g: g * 3)
        y.sum().backward()
    (mul,) = [c for c in t.calls if c.phase == "backward"]
    assert mul.inputs == ["exp0:out@grad"] and not t.notes
