"""``tracer.watch``: 60-step runs with a data-dependent NaN at step 37 (in a GPT-2 loss, in a custom
attention Function's forward, in its hand-written backward), a loss spike at step 20, the
policies, the honest replay and the snapshot's exactness."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

import tracer
from tests.watch_models import (
    AttentionNaNBackward,
    AttentionNaNForward,
    TinyAttentionLM,
    checksum,
    gpt2_batches,
    gpt2_train_step,
    line_of,
    lm_loss,
    padded_batches,
    tiny_gpt2,
)
from tracer.features.watch import NonFiniteStepError, WatchTripped
from tracer.options import TraceError

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watch_models.py")
STEPS, BAD = 60, 37


pytestmark = pytest.mark.usefixtures("one_thread")


def _lm_step(model, opt):
    def train_step(ids):
        loss = lm_loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


# ---- GPT-2: NaN in the forward at step 37 -------------------------------------------------------------
def test_gpt2_nan_at_step_37_raises_naming_the_op_and_line_and_keeps_the_good_state(tmp_path):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = tmp_path / "incident.gtrace"
    step = tracer.watch(model, opt, out=out)(gpt2_train_step(model, opt))
    reached = []
    with pytest.raises(tracer.NonFiniteError) as info:
        for n, (ids, keep) in enumerate(gpt2_batches(STEPS, BAD)):
            before = checksum(model, opt)
            reached.append(n)
            step(ids, keep)
    assert reached[-1] == BAD and len(reached) == BAD + 1
    err = info.value
    assert isinstance(err, NonFiniteStepError) and isinstance(err, WatchTripped)
    # The first NaN: the division of the loss by the zero token count, at its exact line.
    a = err.anomaly
    assert (a.phase, a.kind, a.producer, a.producer_kind, a.origin) == ("forward", "nan", "div0", "Tensor.div", True)
    assert (a.stack[-1].file, a.stack[-1].line) == (MODELS, line_of("BUG: no guard"))
    assert f'line {line_of("BUG: no guard")}' in str(err) and "NaN made by div0 (Tensor.div) in forward" in str(err)
    # raise puts back the state from before the bad step
    assert checksum(model, opt) == before
    incident = err.incident
    assert incident.step == BAD and incident.path == os.fspath(tmp_path / "incident.step37.gtrace")
    assert incident.reproduced and incident.same_loss_bits and incident.undone == []
    assert math.isnan(incident.original["loss"]) and math.isnan(incident.replay["loss"])
    assert "the loss is NaN" in incident.reason
    t = tracer.load(incident.path)
    assert t.header["step"] == BAD and t.header["check_numerics"] is True
    assert t.meta["watch"]["reproduced"] is True and t.meta["watch"]["step"] == BAD
    assert t.notes[-1].startswith("watch: step 37 tripped (the loss is NaN")
    f = t.anomalies.forward
    assert (f.producer, f.stack[-1].file, f.stack[-1].line) == ("div0", MODELS, line_of("BUG: no guard"))
    assert any(c.module == "transformer.h.0.attn" for c in t.calls)  # the whole step is in the trace
    assert [w.step for w in step.watch.incidents] == [BAD]


def test_gpt2_skip_leaves_parameters_and_optimizer_state_bit_equal_to_before_step_37(tmp_path):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = tracer.watch(model, opt, out=tmp_path / "incident.gtrace", policy="skip")(gpt2_train_step(model, opt))
    losses = []
    for n, (ids, keep) in enumerate(gpt2_batches(STEPS, BAD)):
        if n == BAD:
            before = checksum(model, opt)
        losses.append(step(ids, keep).item())
        if n == BAD:
            after = checksum(model, opt)
    assert before == after
    assert [i.step for i in step.watch.incidents] == [BAD]
    assert [n for n, v in enumerate(losses) if not math.isfinite(v)] == [BAD]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert step.watch.step == STEPS and step.watch.last_checked == STEPS - 1
    assert os.path.exists(tmp_path / "incident.step37.gtrace")


# ---- a custom autograd.Function attention -----------------------------------------------------------
def test_custom_attention_nan_in_forward_names_the_softmax_inside_the_function(tmp_path):
    model = TinyAttentionLM(AttentionNaNForward)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = tracer.watch(model, opt, out=tmp_path / "incident.gtrace")(_lm_step(model, opt))
    reached = []
    with pytest.raises(NonFiniteStepError) as info:
        for n, ids in enumerate(padded_batches(STEPS, BAD)):
            before = checksum(model, opt)
            reached.append(n)
            step(ids)
    assert reached[-1] == BAD and checksum(model, opt) == before
    a = tracer.load(info.value.incident.path).anomalies.forward
    assert (a.producer_kind, a.origin, a.stack[-1].line) == ("torch.softmax", True, line_of("BUG-FORWARD"))


def test_custom_attention_nan_in_backward_with_lag_1_undoes_the_next_step_too(tmp_path):
    """With lag=1 (the GPU default) step 37's flag is read when step 38 ends: skip puts the
    state from before step 37 back, undoing step 38 as well, and says so."""
    model = TinyAttentionLM(AttentionNaNBackward)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = tracer.watch(model, opt, out=tmp_path / "incident.gtrace", policy="skip", lag=1)(_lm_step(model, opt))
    for n, ids in enumerate(padded_batches(STEPS, BAD)):
        if n == BAD:
            before = checksum(model, opt)
        step(ids)
        if n == BAD:
            assert step.watch.incidents == []  # not read yet: no synchronisation at the step's end
        if n == BAD + 1:
            assert checksum(model, opt) == before
    step.watch.close()
    [incident] = step.watch.incidents
    assert (incident.step, incident.undone, incident.reproduced) == (BAD, [BAD + 1], True)
    assert incident.original["loss"] is not None and math.isfinite(incident.original["loss"])
    assert "the gradient norm is NaN" in incident.reason
    t = tracer.load(incident.path)
    # Forward is clean; NaN only reaches the parameters through the optimizer step (not an origin) ...
    assert t.anomalies.forward is None
    f = t.anomalies.optimizer
    assert (f.producer, f.origin, f.tensor, f.phase) == ("Adam0", False, "emb.weight@v1", "optimizer")
    # ... made by the innermost op of the hand-written backward, on its exact line.
    b = t.anomalies.backward
    assert incident.anomaly is not None and incident.anomaly.producer == b.producer
    assert t.anomalies.headline.producer == b.producer  # the story's headline: the origin, earlier in time
    assert (b.kind, b.producer_kind, b.origin) == ("nan", "Tensor.div", True)
    assert b.node is not None and "AttentionNaNBackward" in b.node
    assert (b.stack[-1].file, b.stack[-1].line) == (MODELS, line_of("BUG-BACKWARD"))
    assert step.watch.snapshot_count == 2  # lag + 1 snapshots


# ---- a loss spike ------------------------------------------------------------------------------------
def test_spike_trigger_catches_a_loss_multiplied_by_100_at_step_20(tmp_path):
    model = TinyAttentionLM(AttentionNaNBackward)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    @tracer.watch(model, opt, on="spike", out=tmp_path / "spike.gtrace", policy="skip")
    def train_step(ids, scale):
        loss = lm_loss(model, ids) * scale  # a planted batch weighted 100x
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for n, ids in enumerate(padded_batches(40, bad_step=-1)):
        if n == 20:
            before = checksum(model, opt)
        train_step(ids, 100.0 if n == 20 else 1.0)
        if n == 20:
            assert checksum(model, opt) == before
    [incident] = train_step.watch.incidents
    assert incident.step == 20 and incident.trigger == "spike" and incident.reproduced
    assert "the loss" in incident.reason and "above 10 x its running median" in incident.reason
    assert incident.anomaly is None  # nothing non-finite: a spike
    assert tracer.load(incident.path).meta["watch"]["original"]["loss"] == incident.original["loss"]


def test_spike_parameters_are_checked():
    with pytest.raises(TraceError, match="factor"):
        tracer.Spike(factor=0.5)
    with pytest.raises(TraceError, match="warmup"):
        tracer.Spike(window=5, warmup=10)


# ---- policies, triggers, honesty -----------------------------------------------------------------------
def test_continue_keeps_the_state_the_run_reached_and_a_callable_trigger():
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(0.1)
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []

    @tracer.watch(model, opt, on=lambda loss: loss > 5, out=None, policy="continue")
    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append(model.weight.detach().clone())
        return loss

    train_step(torch.ones(2, 4))
    train_step(torch.full((2, 4), 30.0))  # loss 144: the trigger fires
    [incident] = train_step.watch.incidents
    assert incident.step == 1 and incident.trigger == "callable" and incident.path is None
    assert incident.trace is not None and incident.trace.header["step"] == 1
    # continue: the state is the one the step left (the replay's copy is identical)
    assert torch.equal(model.weight, seen[1]) and torch.equal(seen[1], seen[2])


def test_a_replay_that_does_not_reproduce_says_so_and_raises_watch_tripped(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    @tracer.watch(model, opt, out=tmp_path / "i.gtrace")
    def train_step(x):
        calls.append(1)
        loss = model(x).mean() * (math.nan if len(calls) == 1 else 1.0)  # only the first run misbehaves
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    before = checksum(model, opt)
    with pytest.raises(WatchTripped) as info:
        train_step(torch.ones(2, 4))
    assert not isinstance(info.value, tracer.NonFiniteError)
    incident = info.value.incident
    assert not incident.reproduced and incident.same_loss_bits is False
    assert "did not reproduce" in str(info.value)
    t = tracer.load(incident.path)
    assert t.meta["watch"]["reproduced"] is False and "did NOT reproduce" in t.notes[-1]
    assert t.anomalies.clean and checksum(model, opt) == before


def test_restore_removes_optimizer_state_made_by_the_step_and_restores_accumulated_grads(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    bad = {"on": False}

    def micro_step(x):  # accumulate only: the optimizer does not step
        loss = model(x).pow(2).sum() * (math.inf if bad["on"] else 1.0)
        loss.backward()
        return loss

    watched = tracer.watch(model, opt, out=None, policy="skip")(micro_step)
    watched(torch.ones(1, 3))
    grads = [p.grad.clone() for p in model.parameters()]
    bad["on"] = True
    watched(torch.ones(1, 3))
    assert [torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads)] == [True, True]
    assert watched.watch.incidents[0].reason == "the loss is +Inf, the gradient norm is +Inf"

    # A first step that trips: the Adam state it created is gone again.
    step = tracer.watch(model, opt, out=None, policy="skip")(_lm_like_step(model, opt, bad))
    opt.zero_grad()
    assert not opt.state
    step(torch.ones(1, 3))
    assert not opt.state and all(p.grad is None for p in model.parameters())


def _lm_like_step(model, opt, bad):
    def train_step(x):
        loss = model(x).sum() * (math.inf if bad["on"] else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


def test_rng_state_is_replayed_so_dropout_reproduces(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tracer.watch(model, opt, on=lambda loss: True, out=None, policy="continue")
    def train_step(x):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    train_step(torch.ones(4, 8))
    incident = train_step.watch.incidents[0]
    assert incident.reproduced and incident.same_loss_bits


def test_status_line_through_the_gradtrace_logger():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    lg = logging.getLogger("gradtrace.watch")
    handler, level = Keep(), lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    try:
        step = tracer.watch(model, opt, out=None, status_every=3)(lambda x: model(x).sum())
        for _ in range(4):
            step(torch.ones(1, 4))
        step.watch.close()
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
    lines = [r.getMessage() for r in records]
    assert lines[0].startswith("gradtrace watch <lambda>: trigger nonfinite, policy raise, snapshots on the device")
    assert lines[1].startswith("gradtrace watch <lambda>: 3 steps watched, 1 snapshot of 20 bytes (device), "
                               "last check: step 2, no incident")
    assert lines[2].startswith("gradtrace watch <lambda>: 4 steps watched") and len(lines) == 3
    assert step.watch.closed


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "ignore"}, "policy must be"),
    ({"on": "nan"}, "on must be"),
    ({"snapshots": "disk"}, "snapshots must be"),
    ({"lag": -1}, "lag must be"),
    ({"steps": "3"}, "does not take steps="),
    ({"hash": "sha1"}, "hash must be"),
    ({"colour": True}, "unknown option"),
])
def test_bad_options_are_one_clear_error(kwargs, message):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TraceError, match=message):
        tracer.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_an_inf_written_into_batchnorm_running_stats_trips_the_watch_and_skip_restores_it(caplog) -> None:
    """Loss, gradients and parameters stay finite; BatchNorm's running_var overflows to +Inf
    (inputs of ~1e20: their square does not fit float32). Every later evaluation reads it, so the
    step's end measures the buffers with the parameters, and ``policy="skip"`` puts them back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8) * 1e20

    def step() -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    before = model[1].running_var.clone()
    with caplog.at_level(logging.ERROR, logger="gradtrace.watch"):
        watched = tracer.watch(model, opt, out=None, policy="skip", report=False)(step)
        watched()
        watched.watch.close()
    [incident] = watched.watch.incidents
    assert "the parameter norm (buffers included) at the end of the step is +Inf" in incident.reason
    assert torch.equal(model[1].running_var, before)  # skipped: the buffer as the step found it
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_a_norm_that_overflows_float32_is_said_to_overflow_not_to_hold_an_inf(tmp_path, caplog) -> None:
    """lr=1e38: the weights reach ~5e37, finite; only their float32 norm overflows to +Inf. The
    incident says no value holds an Inf (the replay's trace says every tensor is finite)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e38)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))

    def step() -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with caplog.at_level(logging.ERROR, logger="gradtrace.watch"):
        watched = tracer.watch(model, opt, out=None, policy="skip", report=False)(step)
        watched()
        watched.watch.close()
    [incident] = watched.watch.incidents
    assert incident.anomaly is None and incident.numerics is not None and incident.numerics.clean
    assert incident.original["param_norm"] == math.inf and incident.overflowed_norm()
    assert ("no value of the replayed step holds a NaN or Inf: the norm itself overflowed float32"
            in incident.describe().splitlines()[1])
