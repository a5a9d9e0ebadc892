"""A true trace in real training recipes (issue #16): one test per way the trace used to lie.

Every test asserts exact facts through the public API: node runs counted against autograd's own
count (the profiler's ``autograd::engine::evaluate_function`` events), checksums equal to
``hashlib`` of the same bytes taken in an identical untraced run, names, and verdicts. The CUDA
variants of items 1-4 are in tests/test_cuda.py.
"""

from __future__ import annotations

import copy
import hashlib
import os
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import export
import tracer
from tests.models import MLP, NestedFnModel, SmallCNN, hf_loss, hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _line(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}"))


def _autograd_node_runs(fn: Callable[[], object]) -> int:
    """How many grad nodes autograd itself ran while ``fn`` ran (profiler events, no hooks)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("autograd::engine::evaluate_function"))


def _recorded_node_runs(t: tracer.Trace) -> int:
    return sum(len(r.steps) for r in t.backward_runs)


# ---- 1. a checksum is of the value its record names, whatever writes next -------------------------
def _inplace_chain(x: torch.Tensor, snap: Callable[[str, torch.Tensor], None]) -> None:
    y = x * 1.0
    snap("mul0:out", y)
    y.relu_()
    snap("mul0:out@v1", y)
    z = y + 1
    snap("add0:out", z)
    z.add_(y)  # a residual, in place
    snap("add0:out@v1", z)
    z.masked_fill_(z > 2.5, 0.0)
    snap("add0:out@v2", z)
    F.dropout(z, 0.5, training=True, inplace=True)
    snap("add0:out@v3", z)
    nn.ReLU(inplace=True)(z - 1)  # ReLU(inplace=True) on a fresh output


def checksums_survive_in_place_writes(device: str, numel: int) -> None:
    """Shared by the CPU test here and the CUDA test (256 MiB) in tests/test_cuda.py."""
    torch.manual_seed(1)
    x = torch.randn(numel, device=device)
    expected: dict[str, str] = {}
    torch.manual_seed(2)
    _inplace_chain(x, lambda name, t: expected.__setitem__(name, _md5(t)))
    torch.manual_seed(2)
    with tracer.trace() as t:
        _inplace_chain(x, lambda name, t: None)
    for name, md5 in expected.items():
        assert t[name].md5 == md5, name
    assert t["sub0:out@v1"].producer == "relu_0" or t["sub0:out@v1"].producer.startswith("relu")


def test_checksums_are_of_the_value_before_a_later_in_place_write_cpu():
    checksums_survive_in_place_writes("cpu", 1 << 20)  # 4 MiB: hashed on worker threads from a snapshot


# ---- 2. fused optimizers: the step's outputs are the parameters and state after it ----------------
def _optimizer(kind: str, impl: str, params: object, lr: float = 0.1) -> torch.optim.Optimizer:
    flags = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    if kind == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **flags)  # type: ignore[arg-type]
    return getattr(torch.optim, kind)(params, lr=lr, **flags)  # type: ignore[no-any-return]


def _step(kind: str, impl: str, lr: float = 0.1, optimizer_ops: bool = False) -> tuple[tracer.Trace, nn.Module,
                                                                                          torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP(width=6, depth=2)
    opt = _optimizer(kind, impl, model.parameters())
    x = torch.randn(4, 6)
    model(x).pow(2).mean().backward()
    opt.step()  # state exists before the trace, as in any step after the first
    opt.zero_grad()
    for group in opt.param_groups:
        group["lr"] = lr
    with tracer.trace(optimizer_ops=optimizer_ops) as t:
        model(x).pow(2).mean().backward()
        opt.step()
    return t, model, opt


@pytest.mark.parametrize("impl", ["loop", "foreach", "fused"])
@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
def test_every_optimizer_implementation_records_the_parameters_and_state_after_the_step(kind, impl):
    t, model, opt = _step(kind, impl)
    (call,) = [c for c in t.calls if c.kind == "optimizer"]
    names = [n for n, _ in model.named_parameters()]
    new = {n: f"{n}@v1" for n in names}
    assert all(new[n] in call.outputs for n in names)
    for n, p in model.named_parameters():
        rec = t[new[n]]
        assert (rec.producer, rec.previous, rec.md5) == (call.name, n, _md5(p)), (kind, impl, n)
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.numel():
                out = [o for o in call.outputs if o.split("@")[0] == f"{n}.{key}"]
                assert out and t[out[-1]].md5 == _md5(value), (kind, impl, n, key)


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_the_step_records_the_same_outputs_whatever_the_implementation(kind):
    outputs = {impl: next(c for c in _step(kind, impl)[0].calls if c.kind == "optimizer").outputs
               for impl in ("loop", "foreach", "fused")}
    assert outputs["loop"] == outputs["foreach"] == outputs["fused"]


def test_fused_runs_with_different_learning_rates_diverge_at_the_step():
    a, _, _ = _step("AdamW", "fused", lr=0.1)
    b, _, _ = _step("AdamW", "fused", lr=0.2)
    r = export.diff(a, b)
    assert r.exit_code == 1 and r.forward.origin_a == "AdamW0"
    assert r.forward.reason == "inputs match, arguments differ ('lr=0.1' vs 'lr=0.2'), outputs differ"
    assert {p.name for p in r.differing_params} == {n for n, _ in MLP(width=6, depth=2).named_parameters()}


def test_with_optimizer_ops_the_fused_kernel_writes_what_its_schema_says():
    t, model, _ = _step("AdamW", "fused", optimizer_ops=True)
    (fused,) = [c for c in t.calls if c.api == "torch._fused_adamw_"]
    # Tensor(a!)[] self, grads, exp_avgs, exp_avg_sqs: new versions although no version counter moved
    names = [n for n, _ in model.named_parameters()]
    assert [m for m in fused.mutated if m.split("@")[0] in names][:len(names)] == [f"{n}@v1" for n in names]
    for n, p in model.named_parameters():
        assert t[f"{n}@v1"].md5 == _md5(p)


# ---- 3. every accumulator object observed: gradient accumulation, a discarded forward ----------------
def _accumulate(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for x in batches:
        loss = model(x).pow(2).mean() / len(batches)
        loss.backward()
    opt.step()


def test_gradient_accumulation_records_every_node_run_and_every_micro_batch_gradient():
    def setup() -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = MLP(width=6, depth=3)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.randn(4, 6), torch.randn(4, 6)]

    model, opt, batches = setup()
    expected_runs = _autograd_node_runs(lambda: _accumulate(model, opt, batches))
    # the same step, untraced, micro-batch by micro-batch: the gradient each one brings
    model, opt, batches = setup()
    per_batch = []
    for x in batches:
        m = copy.deepcopy(model)
        (m(x).pow(2).mean() / 2).backward()
        per_batch.append({n: _md5(p.grad) for n, p in m.named_parameters()})
    model, opt, batches = setup()
    with tracer.trace() as t:
        _accumulate(model, opt, batches)
    assert _recorded_node_runs(t) == expected_runs > 0
    for n, _ in model.named_parameters():
        assert t[f"{n}@grad"].md5 == per_batch[0][n]
        assert t[f"{n}@grad#1"].md5 == per_batch[1][n]  # the second micro-batch's own gradient
        acc = t[f"{n}@grad@v1"]  # .grad after the second backward added into it
        assert (acc.producer, acc.previous, acc.role) == (f"{n}/AccumulateGrad", f"{n}@grad", "grad")
        assert f"{n}@grad@v1" in t["SGD0"].inputs
    for n, p in model.named_parameters():
        assert t[f"{n}@v1"].md5 == _md5(p)


def test_diff_compares_the_accumulated_gradient_the_optimizer_read():
    def run(second: float) -> tracer.Trace:
        torch.manual_seed(0)
        model = MLP(width=6, depth=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: parameters stay equal
        batches = [torch.ones(2, 6), torch.full((2, 6), second)]
        with tracer.trace() as t:
            _accumulate(model, opt, batches)
        return t

    r = export.diff(run(1.0), run(2.0))  # only the second micro-batch differs
    grads = {p.name: p.grad for p in r.params}
    assert grads and all(g is not None and g.status == "differ" for n, g in grads.items() if "weight" in n)


def test_a_discarded_forward_does_not_hide_the_real_gradients():
    torch.manual_seed(0)
    model = MLP(width=6, depth=2)
    x = torch.randn(3, 6)
    expected = _autograd_node_runs(lambda: model(x).sum().backward())
    model.zero_grad()
    with tracer.trace() as t:
        model(x)  # discarded: its graph dies, the next forward makes new accumulators
        model(x).sum().backward()
    assert _recorded_node_runs(t) == expected
    for n, p in model.named_parameters():
        assert t[f"{n}@grad"].md5 == _md5(p.grad)


# ---- 4. GradScaler: the unscale is a call; clipping and the optimizer read the unscaled gradients ---------
def _amp_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, x: torch.Tensor,
              snap: Callable[[str, object], None]) -> None:
    scaler.scale(model(x).pow(2).mean()).backward()
    scaler.unscale_(opt)
    snap("unscaled", {n: _md5(p.grad) for n, p in model.named_parameters()})
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    snap("clipped", {n: _md5(p.grad) for n, p in model.named_parameters()})
    scaler.step(opt)
    scaler.update()


def test_grad_scaler_unscale_is_recorded_and_everything_after_reads_the_unscaled_gradients():
    def setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, torch.Tensor]:
        torch.manual_seed(0)
        model = MLP(width=6, depth=2)
        return (model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=1024.0),
                torch.randn(4, 6))

    snaps: dict[str, dict[str, str]] = {}
    _amp_step(*setup(), snaps.__setitem__)  # type: ignore[arg-type]
    model, opt, scaler, x = setup()
    with tracer.trace() as t:
        _amp_step(model, opt, scaler, x, lambda *_: None)
    (unscale,) = [c for c in t.calls if c.api == "torch._amp_foreach_non_finite_check_and_unscale_"]
    names = [n for n, _ in model.named_parameters()]
    assert unscale.outputs[:len(names)] == [f"{n}@grad@v1" for n in names]  # it returns nothing: its writes
    assert unscale.mutated == unscale.outputs
    found_inf = t[unscale.outputs[-1]]
    assert found_inf.numel == 1 and found_inf.previous is not None
    for n in names:
        assert t[f"{n}@grad@v1"].md5 == snaps["unscaled"][n]
    (norm,) = [c for c in t.calls if c.api == "torch._foreach_norm"]
    assert norm.inputs == [f"{n}@grad@v1" for n in names]  # clipping reads the unscaled values
    sgd = t["SGD0"]
    assert [i for i in sgd.inputs if "@grad" in i] == [f"{n}@grad@v2" for n in names]
    for n in names:
        assert t[f"{n}@grad@v2"].md5 == snaps["clipped"][n]


def test_grad_scaler_with_a_fused_optimizer_records_the_unscale_inside_the_step():
    torch.manual_seed(0)
    model = MLP(width=6, depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with tracer.trace() as t:
        scaler.scale(model(torch.randn(4, 6)).pow(2).mean()).backward()
        scaler.step(opt)  # passes its scale to the fused kernel, which unscales in place
        scaler.update()
    step = t["AdamW0"]
    for n, p in model.named_parameters():
        grad_out = [o for o in step.outputs if o.startswith(f"{n}@grad")]
        assert grad_out and t[grad_out[-1]].md5 == _md5(p.grad)  # unscaled by the step
        assert t[f"{n}@v1"].md5 == _md5(p)


# ---- 5. uninitialised memory is never hashed, never compared -------------------------------------------
def test_empty_like_is_uninitialised_and_its_first_write_is_a_version():
    x = torch.randn(5)
    with tracer.trace() as t:
        out = torch.empty_like(x)
        out.copy_(x * 2)
    rec = t["empty_like0:out"]
    assert rec.uninitialized and rec.md5 is None and rec.stats is None
    assert rec.hash_note.startswith("not hashed: uninitialised memory")
    assert t["empty_like0:out@v1"].md5 == _md5(out) and not t["empty_like0:out@v1"].uninitialized


def test_an_op_whose_other_overloads_write_a_list_or_a_generator_does_not_write_its_tensor():
    """``aten::sort`` also names TorchScript builtins that sort a Python list in place
    (``sort.Tensor(Tensor[](a!) self)``, ``sort.int(int[](a!) self)``), and ``manual_seed`` writes
    a Generator: a tensor passed to ``torch.sort`` is only read (found by
    ``pack_padded_sequence(enforce_sorted=False)``, which sorts the lengths). In-place ops and
    the foreach and fused ops, which write a tensor or a list of them, still write."""
    x, y = torch.tensor([4, 6, 2]), torch.randn(5)
    params = [torch.randn(3), torch.randn(3)]
    with tracer.trace() as t:
        torch.sort(x, descending=True)
        y.sort(dim=0)
        torch.topk(y, 2)
        y.add_(1)
        y[0] = 2.0  # (an in-place dunder: no schema of its own)
        torch._foreach_mul_(params, 2.0)
    assert x._version == 0
    assert [c.mutated for c in t.calls] == [[], [], [], ["input1@v1"], ["input1@v2"], ["input2@v1", "input3@v1"]]
    assert t["sort0"].inputs == ["input0"] and t["sort1"].inputs == ["input1"]
    assert t["input1@v2"].md5 == _md5(y) and t["input2@v1"].md5 == _md5(params[0])


def test_detach_in_place_cuts_autograd_without_making_a_version():
    """``detach_``'s schema marks ``self`` written, but its bytes and shape stay: the next reader
    reads the same record."""
    a = torch.randn(3, requires_grad=True)
    with tracer.trace() as t:
        b = a * 2
        b.detach_()
        b + 1
    assert [(c.name, c.inputs, c.outputs, c.mutated) for c in t.calls] == [
        ("mul0", ["input0"], ["mul0:out"], []), ("detach_0", ["mul0:out"], ["mul0:out"], []),
        ("add0", ["mul0:out"], ["add0:out"], [])]


def test_an_out_argument_met_first_is_overwritten_not_hashed_unless_the_call_reads_it():
    """An ``out=`` tensor first seen in the block is written whole and never read: what it held
    (FSDP copies each unsharded parameter out of the all-gather into memory it has just given
    back, whatever bytes the allocator left there) is not hashed, and its first value is the
    next version. A tensor also passed as another argument is read: hashed."""
    a, b = torch.randn(4), torch.randn(4)
    fresh, both = torch.empty(4), torch.randn(4)
    parts = [torch.empty(2), torch.empty(2)]
    with tracer.trace() as t:
        torch.add(a, b, out=fresh)
        torch.add(both, b, out=both)
        torch.split_with_sizes_copy(a, [2, 2], out=parts)
    add0, add1, split = t["add0"], t["add1"], t["split_with_sizes_copy0"]
    first = t[add0.inputs[2]]
    assert first.uninitialized and first.md5 is None and first.stats is None
    assert first.hash_note == ("not hashed: first seen being overwritten by add (its out= argument), which reads "
                               "none of its bytes; its new value is the next version")
    assert add0.outputs == [f"{add0.inputs[2]}@v1"] and t[add0.outputs[0]].md5 == _md5(fresh)
    assert t[add1.inputs[0]].md5 is not None and not t[add1.inputs[0]].uninitialized  # read by the call
    for name, part in zip(split.inputs[1:], parts):
        assert t[name].uninitialized and t[f"{name}@v1"].md5 == _md5(part)


def test_memory_a_storage_is_given_back_is_uninitialised_until_written():
    """FSDP frees an unsharded parameter's storage (``resize_(0)``) after its layer and gives it
    memory back (``resize_(n)``) before the layer's backward: until something writes it, its
    bytes are whatever the allocator left, so a tensor there seen now is not hashed (two runs
    would differ there); once a recorded call has written it, it is hashed again."""
    x = torch.randn(1000)
    with tracer.trace() as t:
        storage = x.untyped_storage()
        storage.resize_(0)
        storage.resize_(4000)
        (x.view(10, 100) * 2).sum()
        x.copy_(torch.ones(1000))
        x * 3
    first = t["input0"]
    assert first.uninitialized and first.md5 is None and first.stats is None
    assert first.hash_note.startswith("not hashed: uninitialised memory (its storage was resized from nothing")
    assert t["view0:out"].md5 is None  # the same bytes
    assert t["copy_0"].outputs == ["input0@v1"] and t["input0@v1"].md5 == _md5(x)
    assert t["mul1"].inputs == ["input0@v1"]
    assert "resize_" not in torch.UntypedStorage.__dict__  # the wrapper is gone with the trace


def test_two_identical_mixtral_runs_are_equal_despite_empty_like():
    def run() -> tracer.Trace:
        torch.manual_seed(0)
        model, x = hf_model("mixtral")
        with tracer.trace() as t:
            hf_loss(model, x).backward()
        return t

    a, b = run(), run()
    uninit = [r for r in a.tensors.values() if r.uninitialized]
    assert uninit, "transformers' MoE path makes torch.empty_like buffers"
    r = export.diff(a, b)
    assert r.exit_code == 0, r.verdict()


# ---- 6. a parameter's gradient keeps its name whoever reads it first ------------------------------------
def test_gradients_read_by_clipping_first_are_named_after_their_parameter():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(3))
            self.b = nn.Parameter(torch.randn(3))

        def forward(self) -> torch.Tensor:
            return (self.a + self.b).sum()  # one gradient tensor for both: the second is a copy

    model = Pair()
    seen: list[str] = []
    with tracer.trace() as t:
        model.a.register_post_accumulate_grad_hook(lambda p: seen.append(str(float(p.grad.sum()))))
        model().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    (norm,) = [c for c in t.calls if c.api == "torch._foreach_norm"]
    assert norm.inputs == ["a@grad", "b@grad"]
    assert t["a@grad"].md5 == t["b@grad"].md5 and not any(n.startswith("input") for n in t.tensors if "grad" in n)
    assert seen


# ---- 7. writes through an alias make new versions of what they alias -------------------------------------
def test_writes_through_data_copy_and_views_make_new_versions():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    ema = copy.deepcopy(model)
    src = torch.randn(4)
    x = torch.randn(2, 4)
    with tracer.trace() as t:
        model(x)
        model.weight.data.mul_(0.5)  # WGAN clipping / manual SGD style
        model(x)
        with torch.no_grad():
            model.bias.copy_(src)
            model.weight.view(-1)[:3].zero_()  # a write into a view
        model(x)
        for pe, p in zip(ema.parameters(), model.parameters()):  # EMA through .data
            pe.data.mul_(0.9).add_(p.data, alpha=0.1)
        ema(x)
    linears = [c for c in t.calls if c.api == "torch.nn.functional.linear"]
    assert [c.inputs[1:] for c in linears[:3]] == [["weight", "bias"], ["weight@v1", "bias"],
                                                   ["weight@v2", "bias@v1"]]
    assert t["weight@v1"].producer == "mul_0" and t["weight@v2"].producer == "zero_0"
    assert t["bias@v1"].producer == "copy_0"
    assert t["weight@v2"].md5 == _md5(model.weight) and t["bias@v1"].md5 == _md5(model.bias)
    ema_in = linears[3].inputs[1:]  # the averaged parameters, as they are when read
    assert t[ema_in[0]].md5 == _md5(ema.weight) and t[ema_in[1]].md5 == _md5(ema.bias)



def test_an_ema_model_updated_through_kept_data_aliases_links_its_parameters_to_the_update():
    """An EMA helper keeps its model's ``.data`` tensors and lerps them after each step (one
    foreach op); the EMA model runs later. Its parameters, first seen at that run, continue the
    versions the update made: ``previous`` names the update's output, the checksum is the same."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    ema = copy.deepcopy(model)
    ema_data = [p.data for p in ema.parameters()]  # kept by the helper, made before the block
    x = torch.randn(2, 4)
    with tracer.trace(hash="md5") as t:
        model(x).sum().backward()
        with torch.no_grad():
            torch._foreach_lerp_(ema_data, [p.data for p in model.parameters()], 0.1)
        ema(x)
    (update,) = [c for c in t.calls if c.api == "torch._foreach_lerp_"]
    assert update.inputs[:2] == ["input1", "input2"] and update.mutated == ["input1@v1", "input2@v1"]
    ema_call = [c for c in t.calls if c.api == "torch.nn.functional.linear"][-1]
    weight, bias = (t[n] for n in ema_call.inputs[1:])
    assert (weight.role, weight.previous) == ("param", "input1@v1")
    assert (bias.role, bias.previous) == ("param", "input2@v1")
    assert weight.md5 == t["input1@v1"].md5 == _md5(ema.weight)
    assert bias.md5 == t["input2@v1"].md5 == _md5(ema.bias)

@pytest.mark.parametrize("api", ["torch.batch_norm", "torch.native_batch_norm", "F.batch_norm"])
def test_batch_norm_called_directly_makes_new_running_stats(api):
    x = torch.randn(8, 3)
    rm, rv = torch.zeros(3), torch.ones(3)
    w, b = torch.ones(3), torch.zeros(3)
    with tracer.trace() as t:
        if api == "torch.batch_norm":
            torch.batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5, False)
        elif api == "torch.native_batch_norm":
            torch.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
        else:
            F.batch_norm(x, rm, rv, w, b, training=True)
        y = rm + rv
    (bn,) = [c for c in t.calls if "batch_norm" in c.api]
    assert len(bn.mutated) == 2
    assert t[bn.mutated[0]].md5 == _md5(rm) and t[bn.mutated[1]].md5 == _md5(rv)
    assert t[t.calls[-1].inputs[0]].md5 == _md5(rm) and y is not None


# ---- 8. an intended -inf never hides the real NaN ------------------------------------------------------
class CausalLM(nn.Module):
    def __init__(self, poison: bool) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)
        self.poison = poison

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = q @ k.transpose(-1, -2)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))  # intended: the causal mask
        p = scores.softmax(-1)
        if self.poison:
            p = torch.log(p - 2)  # the real bug  # nan-line
        return p.sum()


def test_the_causal_mask_inf_is_intended_and_the_real_nan_is_reported():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    with warnings.catch_warnings(record=True), tracer.check_numerics() as t:
        CausalLM(poison=True)(x).backward()
    report = t.anomalies
    assert report.intended_inf >= 1 and report.forward_inf is None
    nan = report.forward_nan
    assert (nan.producer, nan.producer_kind, nan.origin) == ("log0", "torch.log", True)
    assert nan.stack[-1].line == _line("nan-line")
    assert str(report).startswith("NaN made by log0 (torch.log) in forward, module <root> — test_recipes.py:")
    assert "1 value with an intended Inf (-inf masks), not a fault" in str(report)  # counted, never the headline

    with warnings.catch_warnings(record=True), tracer.check_numerics() as clean:
        CausalLM(poison=False)(x).backward()
    assert clean.anomalies.clean and clean.anomalies.intended_inf >= 1


def test_raise_on_nonfinite_passes_an_intended_inf_inside_a_function_and_stops_at_the_nan():
    class MaskedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, poison):
            s = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
            p = s.softmax(-1)
            return torch.sqrt(p - 2) if poison else p  # stop-line

        @staticmethod
        def backward(ctx, g):
            return g, g, None

    q, k = torch.randn(4, 8), torch.randn(4, 8)
    with tracer.trace(raise_on_nonfinite=True) as t:
        MaskedAttention.apply(q, k, False)
    assert t.status == "ok"
    with pytest.raises(tracer.NonFiniteError) as info, tracer.trace(raise_on_nonfinite=True):
        MaskedAttention.apply(q, k, True)
    assert info.value.anomaly.producer == "sqrt0" and info.value.anomaly.stack[-1].line == _line("stop-line")


# ---- 9. NonFiniteError names the user's line ------------------------------------------------------------
class Halve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.log(x - 5)  # inside-function-line

    @staticmethod
    def backward(ctx, g):
        return g


@pytest.mark.parametrize("where", ["op", "function", "backward"])
def test_nonfinite_error_has_the_stack_of_the_op(where):
    x = torch.zeros(3, requires_grad=True)
    with pytest.raises(tracer.NonFiniteError) as info, tracer.trace(raise_on_nonfinite=True):
        if where == "op":
            torch.log(x - 1)  # op-line
        elif where == "function":
            Halve.apply(x)
        else:
            torch.sqrt(x).sum().backward()  # backward-line
    anomaly = info.value.anomaly
    assert anomaly.stack, "the error carries the stack"
    line = {"op": "op-line", "function": "inside-function-line", "backward": "backward-line"}[where]
    if where == "backward":
        assert anomaly.phase == "backward" and anomaly.producer == "sqrt0/SqrtBackward0" and anomaly.kind == "inf"
        assert anomaly.stack[-1].line == _line(line)
    else:
        assert anomaly.stack[-1].line == _line(line)


# ---- 10. a gradient penalty's double-backward nodes belong to the node that made them ----------------------
def test_gradient_penalty_nodes_are_linked_to_their_grad_node_and_line():
    torch.manual_seed(0)
    critic = MLP(width=6, depth=2)
    x = torch.randn(4, 6, requires_grad=True)

    def step() -> None:
        out = critic(x).sum()
        (g,) = torch.autograd.grad(out, x, create_graph=True)  # penalty-line
        (out + (g.norm(2, dim=1) - 1).pow(2).mean()).backward()

    # autograd.grad(out, x) evaluates x's accumulator only to capture the gradient: the profiler
    # counts it, but it never runs (no hook fires, nothing accumulates).
    expected = _autograd_node_runs(step) - 1
    critic.zero_grad()
    x.grad = None
    with tracer.trace() as t:
        step()
    assert _recorded_node_runs(t) == expected
    made = [n for n in t.grad_nodes if n.parent is not None]
    assert made and not any(n.external for n in t.grad_nodes)
    for n in made:
        assert n.call is None and n.name.startswith(n.parent + "/") and n.parent in t
        assert n.stack[-1].line == _line("penalty-line")


# ---- 11. a NaN made in a hand-written attention backward: the line inside backward() -----------------------
class FlashLikeAttention(torch.autograd.Function):
    """Its backward divides by the row sums of the probabilities: fully masked rows give NaN (dQ)."""

    @staticmethod
    def forward(ctx, q, k, v, keep):
        s = (q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf"))
        p = torch.nan_to_num(s.softmax(-1))  # fully masked rows: zeros after nan_to_num
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved_tensors
        dp = g @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True) / p.sum(-1, keepdim=True))  # dq-line
        return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ g, None


def test_nan_in_a_custom_attention_backward_names_the_line_inside_backward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 8, requires_grad=True) for _ in range(3))
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[2] = False  # a fully masked row
    with warnings.catch_warnings(record=True), tracer.check_numerics() as t:
        FlashLikeAttention.apply(q, k, v, keep).sum().backward()
    bwd = t.anomalies.backward_nan
    assert bwd.node == "FlashLikeAttention0/FlashLikeAttentionBackward" and bwd.origin
    assert bwd.stack[-1].function == "FlashLikeAttention.backward" and bwd.stack[-1].line == _line("dq-line")
    assert t[bwd.producer].phase == "backward"
    assert t.anomalies.forward is None  # the mask's -inf was intended, and nan_to_num kept forward finite


# ---- 12. diff: the first reader, what differed, and an exit status that does not depend on the reader -------
def test_one_ulp_in_one_weight_is_found_at_its_first_reader_with_what_differed():
    def run(ulp: bool) -> tracer.Trace:
        torch.manual_seed(0)
        model = MLP(width=6, depth=3)
        with torch.no_grad():
            model.layers[0].bias.zero_()
            if ulp:
                w = model.layers[0].weight
                w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))
        x = torch.zeros(2, 6)
        x[:, 0] = 1.0  # the first output of layers.0 is its weight[0, 0] exactly: the ulp shows
        with tracer.trace() as t:
            model(x).sum().backward()
        return t

    r = export.diff(run(False), run(True))
    assert r.forward.origin_a == "linear0"
    assert r.forward.reason == "first call to read the changed param layers.0.weight: input differs, outputs differ"
    assert r.differing_params[0].name == "layers.0.weight"
    assert "1 parameter differs: layers.0.weight (" in r.verdict()


def test_a_change_rounded_away_by_its_first_reader_is_named_with_that_reader():
    def run(ulp: bool) -> tracer.Trace:
        torch.manual_seed(0)
        model = MLP(width=6, depth=3)
        if ulp:
            with torch.no_grad():
                w = model.layers[0].weight
                w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))
        x = torch.ones(2, 6)
        x[:, 0] = 0.0  # weight[:, 0] meets only zeros: the change cannot reach any output
        with tracer.trace() as t:
            model(x).sum().backward()
        return t

    r = export.diff(run(False), run(True))
    assert r.exit_code == 1 and r.forward.origin is None  # no call's outputs changed
    assert r.verdict().startswith("DIVERGED — 1 parameter differs: layers.0.weight (")
    assert "; first read by linear0, whose outputs matched" in r.verdict()


def test_diff_exit_status_does_not_depend_on_a_closed_pipe(tmp_path):
    def run(out: str, scale: float) -> None:
        torch.manual_seed(0)
        model = MLP(width=6, depth=2)
        with tracer.trace(out=out):
            (model(torch.ones(2, 6)) * scale).sum().backward()

    a, b, c = (str(tmp_path / f"{n}.gtrace") for n in "abc")
    run(a, 1.0)
    run(b, 1.0)
    run(c, 2.0)
    for other, status in ((b, 0), (c, 1)):
        cmd = f'"{sys.executable}" -m tracer diff {a} {other} | head -1; exit ${{PIPESTATUS[0]}}'
        proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": ROOT})
        assert proc.returncode == status, proc.stderr
        assert proc.stdout.startswith("EQUAL" if status == 0 else "DIVERGED")


# ---- identical runs agree; one ulp is found where it is first read, on every model of the tests ------------
def _models() -> dict[str, Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]]:
    def hf(kind: str) -> Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]:
        def make() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
            model, x = hf_model(kind)
            return model, lambda m: hf_loss(m, x)
        return make

    def small(cls: type[nn.Module], shape: tuple[int, ...]) -> Callable[[], tuple[nn.Module, Callable]]:
        def make() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
            model = cls()
            x = torch.randn(*shape)
            return model, lambda m: m(x).pow(2).mean()
        return make

    return {"gpt2": hf("gpt2"), "llama": hf("llama"), "mixtral": hf("mixtral"),
            "cnn": small(SmallCNN, (2, 3, 8, 8)), "nested": small(NestedFnModel, (3, 6))}


@pytest.mark.parametrize("name", list(_models()))
def test_identical_runs_are_equal_and_one_ulp_is_found_at_its_first_reader(name):
    def run(ulp: bool) -> tracer.Trace:
        torch.manual_seed(0)
        model, loss_of = _models()[name]()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        first = next(p for p in model.parameters() if p.dim() >= 2)
        if ulp:
            with torch.no_grad():
                first.view(-1)[0] = torch.nextafter(first.view(-1)[0], torch.tensor(float("inf")))
        with tracer.trace() as t:
            loss_of(model).backward()
            opt.step()
        return t

    a, b = run(False), run(False)
    assert export.diff(a, b).exit_code == 0
    c = run(True)
    r = export.diff(a, c)
    assert r.exit_code == 1
    pname = next(n for n, rec in a.tensors.items() if rec.role == "param" and len(rec.shape) >= 2)
    readers = [call.name for call in a.calls if pname in call.inputs]
    if r.forward.origin is None:  # every reader rounded the ulp away: the verdict names the first
        assert f"; first read by {readers[0]}, whose outputs matched" in r.verdict()
    elif r.forward.origin_a == readers[0]:
        assert r.forward.reason.startswith(f"first call to read the changed param {pname}")
    else:  # an earlier reader's outputs matched (an embedding that never looked up that row)
        assert r.forward.origin_a in readers, (r.forward.origin_a, readers[:3])
        assert f"(read first by {readers[0]}, whose outputs matched)" in r.forward.reason


# ---- the recipes end to end: Hugging Face Trainer and Lightning with their defaults ------------------------
def test_hf_trainer_with_accumulation_clipping_and_its_default_fused_optimizer(tmp_path):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tracer.integrations.hf import TraceCallback

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                             bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 100, (12, 8))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = tf.TrainingArguments(output_dir=os.fspath(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=2,
                                gradient_accumulation_steps=2, max_grad_norm=1.0, report_to=[], save_strategy="no",
                                logging_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
    assert "fused" in str(args.optim.value)  # the Trainer's default optimizer
    counted: dict[str, object] = {}

    class Count(tf.TrainerCallback):  # autograd's own node runs in the traced step (step 1)
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:
                counted["prof"] = profile(activities=[ProfilerActivity.CPU]).__enter__()

        def on_step_end(self, args, state, control, model=None, **kw):
            if "prof" in counted and "runs" not in counted:
                prof = counted["prof"]
                prof.__exit__(None, None, None)  # type: ignore[attr-defined]
                counted["runs"] = sum(1 for e in prof.events()  # type: ignore[attr-defined]
                                      if e.name.startswith("autograd::engine::evaluate_function"))
                counted["params"] = {n: _md5(p) for n, p in model.named_parameters()}

    out = os.fspath(tmp_path / "hf.gtrace")
    trainer = tf.Trainer(model=model, args=args, train_dataset=data,
                         callbacks=[Count(), TraceCallback(steps="1", out=out)])
    trainer.train()
    t = tracer.load(out)
    assert len(t.backward_runs) == 2  # the two micro-batches
    assert _recorded_node_runs(t) == counted["runs"]
    step = next(c for c in t.calls if c.kind == "optimizer")
    assert step.api.endswith("AdamW.step")
    for n, md5 in counted["params"].items():  # type: ignore[union-attr]
        assert t[f"{n}@v1"].md5 == md5, n  # the fused step's new parameters
        assert f"{n}@grad" in t and f"{n}@grad#1" in t  # both micro-batches' gradients


def test_lightning_with_accumulation_and_clipping_records_every_node_run(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from tracer.integrations.lightning import TraceCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP(width=6, depth=2)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    counted: dict[str, object] = {}

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1 and "prof" not in counted:
                counted["prof"] = profile(activities=[ProfilerActivity.CPU]).__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if "prof" in counted and "runs" not in counted and trainer.global_step == 2:
                prof = counted["prof"]
                prof.__exit__(None, None, None)  # type: ignore[attr-defined]
                counted["runs"] = sum(1 for e in prof.events()  # type: ignore[attr-defined]
                                      if e.name.startswith("autograd::engine::evaluate_function"))

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 6))
    out = os.fspath(tmp_path / "pl.gtrace")
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", callbacks=[Count(), TraceCallback(steps="1", out=out)])
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=2))
    t = tracer.load(out)
    assert len(t.backward_runs) == 2
    assert _recorded_node_runs(t) == counted["runs"]
    names = [n for n, r in t.tensors.items() if r.role == "param" and r.previous is None]
    for n in names:
        assert f"{n}@grad" in t and f"{n}@grad#1" in t and f"{n}@grad@v1" in t


def test_an_encoder_in_eval_runs_its_regular_path_and_the_trace_says_so():
    """PyTorch's fused inference path of nn.TransformerEncoder / MultiheadAttention (eval mode,
    gradients off) is skipped under any torch function mode: the traced run computes what the
    regular path computes (the same as under a pass-through TorchFunctionMode), and one note says so.
    In training nothing is said."""
    from torch.overrides import TorchFunctionMode

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with torch.no_grad():
        with PassThrough():
            regular = enc(x, src_key_padding_mask=pad)
        with tracer.trace() as t:
            traced = enc(x, src_key_padding_mask=pad)
    assert torch.equal(traced, regular)
    assert [n for n in t.notes if "fused inference path" in n] == [
        "nn.TransformerEncoder ran in eval mode with gradients off, where PyTorch takes the fused inference path "
        "of nn.MultiheadAttention and the Transformer encoder only when no torch function mode is active: under "
        "the trace they ran their regular path, so their outputs can differ from an untraced run's in the last "
        "bits, and at padded positions of a key padding mask (which the fused path leaves at zero)"]
    enc.train()
    with tracer.trace() as t:
        enc(x, src_key_padding_mask=pad)
    assert not [n for n in t.notes if "fused inference path" in n]
