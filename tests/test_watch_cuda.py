"""``tracer.watch`` on a GPU: device and pinned-host snapshots, the lazily read flag (lag 1 by
default there), no synchronisation in a watched step, and a skip that restores the exact state."""

from __future__ import annotations

import hashlib

import pytest
import torch

import tracer
from tests.watch_models import gpt2_batches, gpt2_train_step, line_of, tiny_gpt2

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
N, BAD = 16, 9


def _checksum(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.md5()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for key, value in sorted(opt.state.get(p, {}).items()):
            h.update(key.encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("snapshots", ["device", "host"])
def test_cuda_watch_skip_restores_the_state_before_the_bad_step(tmp_path, snapshots):
    torch.manual_seed(0)
    model = tiny_gpt2().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = tracer.watch(model, opt, out=tmp_path / "incident.gtrace", policy="skip",
                        snapshots=snapshots)(gpt2_train_step(model, opt))
    for n, (ids, keep) in enumerate(gpt2_batches(N, BAD)):
        if n == BAD:
            before = _checksum(model, opt)
        ids, keep = ids.cuda(), keep.cuda()
        if n == BAD - 1:  # a watched step of a warm loop: no host synchronisation
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(ids, keep)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            continue
        step(ids, keep)
        if n == BAD + 1:
            assert _checksum(model, opt) == before  # step 9 and the step after it undone
    assert step.watch.lag == 1  # the GPU default: a step's flag is read when the next one ends
    step.watch.close()
    [incident] = step.watch.incidents
    assert (incident.step, incident.undone, incident.reproduced) == (BAD, [BAD + 1], True)
    a = tracer.load(incident.path).anomalies.forward
    assert (a.producer_kind, a.origin, a.stack[-1].line) == ("Tensor.div", True, line_of("BUG: no guard"))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cuda_watch_raise_names_the_op_and_line():
    torch.manual_seed(0)
    model = tiny_gpt2().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = tracer.watch(model, opt, out=None, lag=0)(gpt2_train_step(model, opt))
    with pytest.raises(tracer.NonFiniteError) as info:
        for ids, keep in gpt2_batches(N, BAD):
            step(ids.cuda(), keep.cuda())
    a = info.value.anomaly
    assert (a.producer_kind, a.stack[-1].line) == ("Tensor.div", line_of("BUG: no guard"))
