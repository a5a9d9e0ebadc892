"""optimizer.step() recorded as one call (the default), or op by op (``optimizer_ops=True``)."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn as nn

import tracer


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step_line() -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.strip() == "opt.step()  # the step's line")


def test_first_step_is_one_call_that_names_the_state_after_the_parameters() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    x = torch.randn(3, 4)
    with tracer.trace() as t:
        model(x).pow(2).mean().backward()
        opt.step()  # the step's line
    names = [n for n, _ in model.named_parameters()]
    steps = [c for c in t.calls if c.kind == "optimizer"]
    assert [(c.name, c.api) for c in steps] == [("AdamW0", "torch.optim.adamw.AdamW.step")]
    call = steps[0]
    assert not any(c.api.startswith("torch._foreach") for c in t.calls)  # the ops inside are not calls
    assert call.stack[-1].line == _step_line() and call.phase == "optimizer"
    # Inputs: each parameter and the gradient on it (no state exists before the first step).
    assert call.inputs == [x for n in names for x in (n, f"{n}@grad")]
    # Outputs: the new value of every parameter, then the state the step made, by parameter.
    state = [f"{n}.{k}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")]
    assert call.outputs == [f"{n}@v1" for n in names] + state
    assert call.mutated == [f"{n}@v1" for n in names]
    for n, p in model.named_parameters():
        rec = t[f"{n}@v1"]
        assert (rec.role, rec.producer, rec.previous, rec.md5) == ("param", "AdamW0", n, _md5(p))
        for key, value in opt.state[p].items():
            srec = t[f"{n}.{key}"]
            assert (srec.role, srec.producer, srec.md5) == ("state", "AdamW0", _md5(value))


def test_later_steps_read_the_state_and_write_new_versions_of_it() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    model(x).pow(2).mean().backward()
    opt.step()  # state exists before the trace
    opt.zero_grad()
    with tracer.trace() as t:
        model(x).pow(2).mean().backward()
        opt.step()
    call = t["AdamW0"]
    n = "0.weight"
    assert [i for i in call.inputs if i.startswith((n + ".", n + "@grad"))] == \
        [f"{n}@grad", f"{n}.step", f"{n}.exp_avg", f"{n}.exp_avg_sq"]
    assert {f"{n}@v1", f"{n}.step@v1", f"{n}.exp_avg@v1", f"{n}.exp_avg_sq@v1"} <= set(call.outputs)
    assert t[f"{n}.exp_avg@v1"].md5 == _md5(opt.state[model[0].weight]["exp_avg"])


def _trained_once(model: nn.Module, x: torch.Tensor) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    model(x).pow(2).mean().backward()
    opt.step()  # state exists before the trace
    opt.zero_grad()
    return opt


@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_without_checksums_a_step_goes_from_parameters_and_gradients_to_new_parameters(first: bool) -> None:
    """``hash="none"`` (``optimizer_state`` unset): the step's state is not among its inputs and
    outputs, and is no record of its own; code that reads the state afterwards still meets it by
    its name (role state, no producer), its value as read."""
    model = _model()
    x = torch.randn(3, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True) if first else _trained_once(model, x)
    with tracer.trace(hash="none") as t:
        model(x).pow(2).mean().backward()
        opt.step()
        norm = opt.state[model[0].weight]["exp_avg"].norm()
    assert t.header["optimizer_state"] is False
    names = [n for n, _ in model.named_parameters()]
    call = t["AdamW0"]
    assert call.inputs == [x for n in names for x in (n, f"{n}@grad")]
    assert call.outputs == call.mutated == [f"{n}@v1" for n in names]
    assert [r.name for r in t.tensors.values() if r.role == "state"] == ["0.weight.exp_avg"]
    read = t["0.weight.exp_avg"]
    assert (read.producer, read.shape) == (None, (8, 4))
    assert t.calls[-1].inputs == ["0.weight.exp_avg"] and t[t.calls[-1].outputs[0]].shape == norm.shape


def test_without_the_state_a_fused_step_under_gradscaler_still_writes_what_it_writes() -> None:
    """Fused AdamW stepped by a GradScaler unscales the gradients in place without a version
    bump: the step's outputs are the same with the state left out (lean) as with it (md5), less
    the state itself: every parameter's new version and every gradient's."""
    def traced(**options: object) -> tracer.Trace:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        with tracer.trace(**options) as t:  # type: ignore[arg-type]
            scaler.scale(model(torch.ones(3, 4)).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
        return t

    lean, full = traced(hash="none"), traced()
    names = [n for n, _ in _model().named_parameters()]
    lean_step = next(c for c in lean.calls if c.kind == "optimizer")
    full_step = next(c for c in full.calls if c.kind == "optimizer")
    assert sorted(lean_step.outputs) == sorted(o for o in full_step.outputs if full[o].role != "state")
    # The scaler's inf check (an in-place unscale by 1.0) made each gradient's @v1; the fused step,
    # handed the scale, unscaled it in place: @v2.
    assert {f"{n}@v1" for n in names} | {f"{n}@grad@v2" for n in names} == set(lean_step.outputs)
    assert lean_step.inputs == [x for n in names for x in (n, f"{n}@grad@v1")]


def test_optimizer_state_true_records_the_state_in_a_trace_without_checksums() -> None:
    model = _model()
    x = torch.randn(3, 4)
    opt = _trained_once(model, x)
    with tracer.trace(hash="none", optimizer_state=True) as t:
        model(x).pow(2).mean().backward()
        opt.step()
    assert t.header["optimizer_state"] is True
    call = t["AdamW0"]
    n = "0.weight"
    assert [i for i in call.inputs if i.startswith((n + ".", n + "@grad"))] == \
        [f"{n}@grad", f"{n}.step", f"{n}.exp_avg", f"{n}.exp_avg_sq"]
    assert {f"{n}@v1", f"{n}.step@v1", f"{n}.exp_avg@v1", f"{n}.exp_avg_sq@v1"} <= set(call.outputs)
    assert t[f"{n}.exp_avg@v1"].previous == f"{n}.exp_avg" and t[f"{n}.exp_avg@v1"].md5 is None


@pytest.mark.parametrize(("options", "expected"), [
    ({}, True), ({"hash": "fast"}, True), ({"hash": "none", "stats": True}, True),
    ({"hash": "none", "check_numerics": True}, False), ({"hash": "none", "raise_on_nonfinite": True}, False),
    ({"hash": "none", "check_numerics": True, "stats": True}, True), ({"check_numerics": True}, True),
    ({"hash": "none", "memory": True}, True),
    ({"hash": "none", "keep_values": True}, True), ({"hash": "none"}, False),
    ({"hash": "md5", "optimizer_state": False}, False),
])
def test_the_state_is_recorded_when_something_reads_it(options: dict[str, object], expected: bool) -> None:
    model = _model()
    x = torch.randn(3, 4)
    opt = _trained_once(model, x)
    with tracer.trace(**options) as t:  # type: ignore[arg-type]
        model(x).pow(2).mean().backward()
        opt.step()
    assert t.header["optimizer_state"] is expected
    assert ("0.weight.exp_avg@v1" in t["AdamW0"].outputs) is expected


def test_optimizer_state_must_be_a_bool_or_none() -> None:
    with pytest.raises(tracer.TraceError, match="optimizer_state"):
        tracer.trace(optimizer_state="yes")  # type: ignore[arg-type]


def test_optimizer_ops_records_every_op_inside_the_step() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    with tracer.trace(optimizer_ops=True) as t:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
    assert t.header["optimizer_ops"] is True
    assert not [c for c in t.calls if c.kind == "optimizer"]
    foreach = [c for c in t.calls if c.api.startswith("torch._foreach")]
    assert len(foreach) >= 5 and all(c.stack[-1].code == "opt.step()" for c in foreach)
    assert t["0.weight@v2"].producer.startswith("_foreach_")  # weight decay, then the update


class _Exploding(torch.optim.SGD):
    """Changes the first parameter, then fails."""

    def step(self, closure=None):  # type: ignore[override]
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(1.0)
        raise RuntimeError("boom in the optimizer")


def test_a_step_that_raises_is_recorded_with_its_error_and_recording_goes_on() -> None:
    model = _model()
    opt = _Exploding(model.parameters(), lr=0.1)
    with tracer.trace() as t:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        after = torch.ones(2) * 3  # recorded again: the step is over
    call = t["_Exploding0"]
    assert call.kind == "optimizer" and "raised" in (call.error or "")
    assert call.outputs == ["0.weight@v1"]  # what it changed before failing
    assert after is not None and t.calls[-1].name == "mul0" and t.calls[-1].inputs == ["ones0:out"]


class _DeepExploding(torch.optim.SGD):
    """Changes parameters from helpers at two depths (ops from many frames), then fails."""

    def _inner(self, p: torch.Tensor) -> None:
        p.add_(1.0)

    def _outer(self, p: torch.Tensor) -> None:
        p.mul_(0.5)
        self._inner(p)

    def step(self, closure=None):  # type: ignore[override]
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                self._outer(p)
                self._inner(p)
        raise RuntimeError("boom after many ops")


def _deep(n: int) -> torch.Tensor:
    """An op called from n frames below the caller (as deep as the failed step's were)."""
    return torch.ones(2) * 3 if n == 0 else _deep(n - 1)


def test_the_ops_after_a_step_that_raised_are_recorded_from_any_depth() -> None:
    """Once the step's frame is gone, an op is recorded whatever its depth: the cheap look at the
    depth where the step's ops were found never takes another frame for the step's."""
    model = _model()
    opt = _DeepExploding(model.parameters(), lr=0.1)
    with tracer.trace() as t:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        outs = [_deep(n) for n in range(6)]
    call = t["_DeepExploding0"]
    assert "raised" in (call.error or "")
    assert sorted(call.outputs) == ["0.bias@v1", "0.weight@v1", "2.bias@v1", "2.weight@v1"]
    assert len(outs) == 6 and [c.name for c in t.calls[-12:]] == [n for k in range(6) for n in (f"ones{k}", f"mul{k}")]


def test_a_step_that_raises_out_of_the_block_is_still_recorded() -> None:
    model = _model()
    opt = _Exploding(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="boom"), tracer.trace() as t:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
    assert t.status == "failed" and "raised" in (t["_Exploding0"].error or "")


def test_a_closure_keeps_its_forward_and_backward_visible() -> None:
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x = torch.randn(3, 4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with tracer.trace() as t:
        opt.step(closure)
    assert not [c for c in t.calls if c.kind == "optimizer"]
    assert len(t.backward_runs) >= 2 and "linear0" in t  # the closure's passes are recorded


def test_two_optimizers_make_two_calls_each_with_its_own_parameters() -> None:
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.1)
    with tracer.trace() as t:
        disc(gen(torch.randn(2, 4))).sum().backward()
        opt_d.step()
        opt_g.step()
    steps = [c for c in t.calls if c.kind == "optimizer"]
    assert [c.name for c in steps] == ["Adam0", "SGD0"]
    assert steps[0].mutated == ["disc.weight@v1", "disc.bias@v1"]  # disc: the second root module, by its name
    assert steps[1].mutated == ["weight@v1", "bias@v1"]  # gen: the first root module


def test_a_step_inside_backward_is_a_backward_call_of_its_accumulator() -> None:
    # The "optimizer step in backward" pattern: one optimizer per parameter, stepped by a
    # post-accumulate-grad hook as soon as that parameter's gradient is ready.
    model = _model()
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_now(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step_now) for p in model.parameters()]
    try:
        with tracer.trace() as t:
            model(torch.randn(3, 4)).pow(2).mean().backward()
    finally:
        for h in handles:
            h.remove()
    steps = [c for c in t.calls if c.kind == "optimizer"]
    assert len(steps) == 4 and all(c.phase == "backward" for c in steps)
    by_param = {c.mutated[0]: c for c in steps}
    assert set(by_param) == {f"{n}@v1" for n, _ in model.named_parameters()}
    assert by_param["0.weight@v1"].parent == "0.weight/AccumulateGrad"
