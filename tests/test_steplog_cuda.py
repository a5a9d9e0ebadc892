"""The step log and the determinism check on a GPU: no synchronisation in a logged step, the
device's fingerprints and norms equal to the reference ones, and ``check_determinism`` naming
``index_add_`` of repeated indices (in a forward, and inside a custom Function's backward) with
its line, or the step deterministic once deterministic algorithms are on."""

from __future__ import annotations

import os

import pytest
import torch

import tracer
from tests.determinism_models import custom_backward_step, forward_step, line_of, rows_model
from tests.watch_models import gpt2_batches, gpt2_train_step, tiny_gpt2
from tracer.features.steplog.digests import Digester
from tracer.model.steplog import read_steplog
from tracer.record.checksums.fingerprint import fingerprint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "determinism_models.py")


def test_cuda_step_log_does_not_synchronise_and_logs_the_device_values(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt2().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = gpt2_train_step(model, opt)
    seen: dict[str, list[str]] = {}

    def keep_grads(optimizer, args, kwargs):  # the gradients the optimizer reads at step 5, as a reference
        if len(seen) == 0 and log.steps == 6:
            seen["grads"] = [fingerprint(p.grad) for p in model.parameters()]

    log = tracer.step_log(tmp_path / "run.gtsteps", model=model, optimizer=opt)
    handle = opt.register_step_pre_hook(keep_grads)
    batches = list(gpt2_batches(12, bad_step=-1))
    for n, (ids, keep) in enumerate(batches):
        ids, keep = ids.cuda(), keep.cuda()
        if n == 8:  # a warm step: the log queues its work and reads nothing back
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(ids, keep)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            continue
        step(ids, keep)
    handle.remove()
    log.close()
    got = read_steplog(tmp_path / "run.gtsteps")
    assert [s.step for s in got.steps] == list(range(12)) and got.ended
    names = [p.name for p in got.layouts[0].params]
    by_name = dict(model.named_parameters())
    final = got.finals[0]
    assert final.params == [fingerprint(by_name[n]) for n in names]
    want = [float(torch.linalg.vector_norm(by_name[n].detach().float())) for n in names]
    assert final.param_norms == pytest.approx(want, rel=1e-5)
    # the step-5 record's gradients are those the optimizer read (hook order: the log's first)
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    assert got.steps[5].grads == [seen["grads"][order[n]] for n in names]


def test_cuda_a_planned_reading_follows_moved_gradients_without_a_sync():
    """The parameters and gradients read through one plan (as the log reads them at every step):
    the reference fingerprints and norms, the general path's too; gradients moved elsewhere are
    followed (their addresses copied to the device) with no synchronisation, a bfloat16 copy of
    the model takes a new plan."""
    torch.manual_seed(0)
    model = tiny_gpt2().cuda()
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    planned, general = Digester(), Digester()

    def expect(tensors):
        fps, norms = planned.read(tensors, plan="step").result()
        assert fps == [fingerprint(t) for t in tensors] == general.read(tensors).result()[0]
        want = [float(torch.linalg.vector_norm(t.detach().double())) for t in tensors]
        assert norms == pytest.approx(want, rel=1e-5)

    expect([*params, *(p.grad for p in params)])
    expect([*params, *(p.grad for p in params)])
    old = [p.grad for p in params]  # kept alive: the new gradients lie elsewhere
    for p in params:
        p.grad = p.grad * 2
    tensors = [*params, *(p.grad for p in params)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        reading = planned.read(tensors, plan="step")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert reading.result()[0] == [fingerprint(t) for t in tensors]
    assert len(old) == len(params)
    half = [p.detach().bfloat16() for p in params]
    expect([*half, *params])


@pytest.mark.parametrize("make_step, marker, op", [
    (forward_step, "ND-CUDA-FORWARD", "index_add"),
    (custom_backward_step, "ND-CUDA-BACKWARD", "index_add_"),
])
def test_cuda_check_determinism_names_index_add_and_its_line(make_step, marker, op):
    model, opt, index, scale = rows_model("cuda", rows=4, width=256, n=200_000)
    step = make_step(model, opt, index, scale)
    report = tracer.check_determinism(step, model=model, optimizer=opt, repeats=3)
    assert not report.deterministic, report.describe()
    first = report.first
    assert first is not None and first.what.endswith(op)
    assert (first.line.file, first.line.line) == (MODELS, line_of(marker))
    assert first.cause is not None and "atomic" in first.cause
    assert "use_deterministic_algorithms(True)" in (first.fix or "")


@pytest.mark.parametrize("make_step", [forward_step, custom_backward_step])
def test_cuda_check_determinism_with_deterministic_algorithms_is_deterministic(make_step):
    model, opt, index, scale = rows_model("cuda", rows=4, width=256, n=200_000)
    step = make_step(model, opt, index, scale)
    torch.use_deterministic_algorithms(True)
    try:
        report = tracer.check_determinism(step, model=model, optimizer=opt, repeats=3)
    finally:
        torch.use_deterministic_algorithms(False)
    assert report.deterministic, report.describe()
    assert report.compared > 5
