"""A ``torch.compile``d plain function (not a module) called inside a traced block: compiled once,
no graph break caused by gradtrace, the user's result unchanged, and the trace says that compiled
code ran unseen."""

from __future__ import annotations

import pytest
import torch

import tracer

dynamo = pytest.importorskip("torch._dynamo")


def five_ops(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2 + x.cos()).relu().sum()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_function_has_no_graph_break_and_compiles_once(backend: str) -> None:
    from torch._dynamo.utils import counters  # (tests: Dynamo's own counters)

    dynamo.reset()
    counters.clear()
    compiled = torch.compile(five_ops, backend=backend)
    x = torch.randn(8)
    with tracer.trace() as t:
        results = [compiled(x) for _ in range(3)]
    assert all(torch.equal(r, five_ops(x)) for r in results)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert any("torch.compile'd functions ran in this block" in n for n in t.notes)
    if backend == "eager":  # the graph runs as eager torch calls: recorded as usual
        assert [c.name for c in t.calls][:6] == ["sin0", "mul0", "cos0", "add0", "relu0", "sum0"]
    with tracer.trace() as again:  # a later trace reuses the compiled code
        compiled(x)
    assert counters["stats"]["unique_graphs"] == 1
    assert any("torch.compile'd" in n for n in again.notes)
    with tracer.trace() as plain:
        five_ops(x)
    assert not any("torch.compile'd" in n for n in plain.notes)
