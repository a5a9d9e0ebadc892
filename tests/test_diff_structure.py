"""``gradtrace diff`` tells a change of structure as one, never as nondeterminism or a value.

- A grad node whose forward call did not align (another batch size) or that makes a gradient
  on one side only (a frozen bias) is no "nondeterministic backward?": the note says what differs.
- Parameters only one trace has, or of another shape under one name (an extra layer), are named
  as such, not counted among those that differ; where an inserted call ran before the first
  aligned difference, the verdict leads with it, and a random op after an extra random op says
  that op drew first.
- Batch norm in ``train()`` against ``eval()`` aligns (its running stats updated in place are no
  key of the call) and differs by its arguments; the step counter only ``train()`` reads is
  named as only in A.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer
from export.diff import diff

torch.set_num_threads(1)


def _step(bs: int = 8, freeze: bool = False) -> tracer.Trace:
    """One SGD step of ``Linear(10, 16), ReLU, Linear(16, 4)`` on the first ``bs`` of 16 rows;
    ``freeze``: the first layer's bias needs no gradient."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 10), torch.randint(0, 4, (16,))
    m = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    if freeze:
        m[0].bias.requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    with tracer.trace() as t:
        opt.zero_grad()
        F.cross_entropy(m(x[:bs]), y[:bs]).backward()
        opt.step()
    return t


def _built(extra: bool) -> tracer.Trace:
    """The model built inside the traced step (same seed); ``extra``: one more ``Linear(16, 16),
    ReLU`` before the head."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
    with tracer.trace() as t:
        layers: list[nn.Module] = [nn.Linear(10, 16), nn.ReLU()]
        layers += [nn.Linear(16, 16), nn.ReLU()] if extra else []
        m = nn.Sequential(*layers, nn.Linear(16, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return t


def _batch_norm(train: bool) -> tracer.Trace:
    torch.manual_seed(0)
    x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
    m = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    m.train(train)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with tracer.trace() as t:
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return t


# ---- 1. no nondeterminism guessed for a change of structure ---------------------------------------
def test_another_batch_size_is_no_nondeterministic_backward() -> None:
    r = diff(_step(8), _step(16))
    o = r.backward.origin
    assert o is not None and (o.a, o.rule) == ("cross_entropy0/NllLossBackward0", "forward-call-unaligned")
    assert r.backward.reason == ("gradients in match, outputs differ (shape [8, 4] vs [16, 4]); its forward call did "
                                 "not align: cross_entropy0 is only in A's forward, cross_entropy0 only in B's")
    assert "nondeterministic" not in r.verdict()


def test_a_frozen_bias_is_a_missing_gradient_not_nondeterminism() -> None:
    r = diff(_step(), _step(freeze=True))
    o = r.backward.origin
    assert o is not None and (o.a, o.rule) == ("linear0/AddmmBackward0", "missing-gradient")
    assert r.backward.reason == "gradients in match, but B makes no gradient for 0.bias (A does)"
    # no number measures a gradient one side lacks: not "only the checksums differ"
    assert (o.missing, o.describe(), o.checksum_only) == ("B makes no gradient for 0.bias (A does)",
                                                          "B makes no gradient for 0.bias (A does)", False)
    assert r.to_json()["backward"]["origin"]["missing"] == "B makes no gradient for 0.bias (A does)"
    assert "nondeterministic" not in r.verdict()


# ---- 2. an extra layer: structure named as structure, and first -----------------------------------
def test_an_extra_layer_leads_with_the_inserted_calls_and_names_its_parameters_apart() -> None:
    r = diff(_built(False), _built(True))
    assert r.verdict() == (
        "DIVERGED — forward: 8 inserted in B, 2 removed from A; first inserted: empty2 (torch.empty in <root>), "
        "before the first aligned difference at kaiming_uniform_1 (B: kaiming_uniform_2) "
        "(torch.nn.init.kaiming_uniform_ in <root>): random op with equal inputs: the RNG state differs, advanced "
        "by kaiming_uniform_1, uniform_1 (only in B), which drew from it before; 2 later records contaminated | "
        "backward: first at cross_entropy0/LogSoftmaxBackward0 (LogSoftmaxBackward0 in <root>): forward values "
        "saved by cross_entropy0 differ (its input linear1:out differs); 5 later records contaminated | "
        "2 parameters differ (gradient, value after the step); 2 parameters of another shape: 2.weight "
        "([4, 16] vs [16, 16]), 2.bias ([4] vs [16]); 2 parameters only in B: 4.weight, 4.bias")
    assert not r.parted_earlier


# ---- 3. batch norm in train() against eval() --------------------------------------------------------
def test_batch_norm_in_train_and_eval_aligns_and_differs_by_its_arguments() -> None:
    r = diff(_batch_norm(True), _batch_norm(False))
    assert [(x.a, x.b, x.status) for x in r.forward.rows if x.status in ("removed", "inserted")] == \
        [("add_0", None, "removed")]  # num_batches_tracked += 1, only in train()
    o = r.forward.origin
    assert o is not None and (o.a, o.b, o.rule) == ("batch_norm0", "batch_norm0", "arguments-differ")
    assert r.forward.reason == "inputs match, arguments differ ('training=True' vs 'training=False'), outputs differ"
    verdict = r.verdict()
    assert verdict.startswith("DIVERGED — forward: 1 removed from A; first removed: add_0 (Tensor.add_ in 1), before "
                              "the first aligned difference at batch_norm0 (torch.nn.functional.batch_norm in 1): "
                              "inputs match, arguments differ")
    # the counter only train() reads: named as only in A, never "differs"
    assert verdict.endswith("| 6 parameters and 2 buffers differ (gradient, value after the step); "
                            "1 buffer only in A: 1.num_batches_tracked")
    assert "num_batches_tracked; first read by" not in verdict
