"""gradtrace beside a user's ``TorchDispatchMode`` (FlopCounterMode, DebugMode, an op counter of
one's own): the mode sees the model's ops and nothing of gradtrace's own reads, and the ops a
built-in grad node's computation sends through the mode in backward are not recorded as calls
(tracer/record/dispatch_modes.py, tracer/record/mode.py)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import tracer
from tests.models import NestedFnModel


class OpCounter(TorchDispatchMode):
    """Counts every aten op that reaches it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _bn_step() -> Callable[[], None]:
    """A BatchNorm MLP and its AdamW step, one step already taken (the optimizer has state)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 8)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    return step


OPTIONS = {
    "md5": {"hash": "md5"},
    "fast": {"hash": "fast"},
    "check_numerics": {"hash": "none", "check_numerics": True},
    "raise_on_nonfinite": {"hash": "none", "raise_on_nonfinite": True},
    "keep_values": {"hash": "md5", "keep_values": True},
    "every node run, optimizer ops": {"hash": "md5", "node_runs": True, "optimizer_ops": True},
}


@pytest.mark.parametrize("where", ["mode inside the trace", "trace inside the mode"])
@pytest.mark.parametrize("options", sorted(OPTIONS))
def test_a_users_dispatch_mode_sees_the_same_ops_as_without_the_trace(options, where):
    """Checksums, stats, NaN checks and kept values read every recorded value with torch ops
    (detach, aminmax, sum, isnan, .item()...): a user's dispatch mode saw them as the model's
    (a traced md5 step showed 110 ops to a counter that counts 29 untraced)."""
    untraced = OpCounter()
    step = _bn_step()
    with untraced:
        step()
    counted = OpCounter()
    step = _bn_step()
    if where == "mode inside the trace":
        with tracer.trace(**OPTIONS[options]) as t, counted:
            step()
    else:
        with counted, tracer.trace(**OPTIONS[options]) as t:
            step()
    assert counted.ops == untraced.ops
    assert t.status == "ok" and len(t.backward_runs) == 1
    if options not in ("check_numerics", "raise_on_nonfinite"):
        assert all(r.md5 or r.fingerprint for r in t.tensors.values() if not r.uninitialized)
    assert all(r.stats is not None for r in t.tensors.values() if not r.uninitialized)


def test_flop_counter_counts_the_same_flops_under_a_trace():
    from torch.utils.flop_counter import FlopCounterMode

    flops = []
    for traced in (False, True):
        step = _bn_step()
        with FlopCounterMode(display=False) as counter:
            if traced:
                with tracer.trace(hash="md5"):
                    step()
            else:
                step()
        flops.append(counter.get_total_flops())
    assert flops[0] == flops[1] > 0


def test_a_built_in_nodes_ops_through_a_dispatch_mode_are_not_calls_but_a_custom_backward_is():
    """Under a dispatch mode the engine's own ops (MmBackward0's mm, AccumulateGrad's add_ and
    detach) reach Python as aten operator calls; they were recorded as calls made in backward.
    They are the node's internals, as a forward call's inner ops are; the calls a custom
    Function's backward makes are user code and stay recorded."""
    def traced(with_mode: bool) -> tracer.Trace:
        torch.manual_seed(0)
        model = NestedFnModel()
        x = torch.randn(4, 6)
        with tracer.trace(hash="md5") as t:
            if with_mode:
                with OpCounter():
                    model(x).sum().backward()
            else:
                model(x).sum().backward()
        return t

    plain, under_mode = traced(False), traced(True)
    assert [c.name for c in under_mode.calls] == [c.name for c in plain.calls]
    assert not any(c.api.startswith("torch.ops.") for c in under_mode.calls)
    in_backward = [(c.name, c.api, c.parent) for c in under_mode.calls if c.phase == "backward"]
    assert in_backward == [(c.name, c.api, c.parent) for c in plain.calls if c.phase == "backward"]
    assert {p for _, _, p in in_backward} >= {"Outer0/OuterBackward", "ScaledTanh0/ScaledTanhBackward"}
    assert {n: r.md5 for n, r in under_mode.tensors.items()} == {n: r.md5 for n, r in plain.tensors.items()}
