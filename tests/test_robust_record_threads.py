"""Two threads entering ``tracer.trace()`` at once: one process records one trace at a time
(docs/api.md), enforced atomically; the other thread gets ``TraceError`` at once, the winner's
trace misses nothing, and the process-wide state (gc thresholds, hooks, modes, the apply
wrapper) is exactly as before."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any

import pytest
import torch

import tracer


def installed_state() -> tuple[Any, ...]:
    """What a trace installs process-wide: global module hooks, modes, the apply wrappers."""
    from torch.nn.modules import module as nn_module  # (tests: torch's private hook tables)
    from torch.overrides import _get_current_function_mode_stack

    return (dict(nn_module._global_forward_pre_hooks), dict(nn_module._global_forward_hooks),
            len(_get_current_function_mode_stack()), torch.autograd.function.Function.__dict__["apply"],
            torch.autograd.function.BackwardCFunction.__dict__["apply"])


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def _work(x: torch.Tensor) -> None:
    for _ in range(30):
        x = Double.apply(x)


def _race(hold: bool) -> tuple[list[Any], list[BaseException]]:
    """Two threads enter trace() together; with ``hold`` the winner stays inside until the loser
    has tried."""
    start = threading.Barrier(2)
    tried = threading.Barrier(2)
    traces: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        start.wait()
        try:
            with tracer.trace(hash="none") as t:
                _work(torch.ones(3))
                if hold:
                    tried.wait(timeout=30)
            with lock:
                traces.append(t)
        except tracer.TraceError as exc:
            with lock:
                errors.append(exc)
            if hold:
                tried.wait(timeout=30)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    return traces, errors


def test_second_thread_is_refused_while_the_first_traces() -> None:
    before_gc, before_hooks = gc.get_threshold(), installed_state()
    for _ in range(30):
        traces, errors = _race(hold=True)
        assert len(traces) == 1 and len(errors) == 1
        (t,) = traces
        assert [c.name for c in t.calls if c.kind == "function"] == [f"Double{i}" for i in range(30)]
        assert "already active in this process (entered by thread " in str(errors[0])
        assert gc.get_threshold() == before_gc
        assert installed_state() == before_hooks


@pytest.mark.parametrize("thresholds", [(700, 10, 10), (0, 10, 10), (123_456, 77, 55)])
def test_racing_threads_leave_the_process_exactly_as_before(thresholds: tuple[int, int, int]) -> None:
    saved = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        before_hooks = installed_state()
        for _ in range(100):
            traces, errors = _race(hold=False)
            assert len(traces) + len(errors) == 2 and traces
            for t in traces:  # a trace that was accepted saw all of its thread's calls
                assert sum(c.kind == "function" for c in t.calls) == 30
            assert gc.get_threshold() == thresholds
            assert installed_state() == before_hooks
    finally:
        gc.set_threshold(*saved)


def test_same_thread_nesting_still_says_so() -> None:
    refused = r"already active in this process \(entered by this thread\)"
    with tracer.trace(hash="none"):
        with pytest.raises(tracer.TraceError, match=refused), tracer.trace(hash="none"):
            pass
        torch.ones(1) + 1
    with tracer.trace(hash="none") as t:  # and the process is free again
        torch.ones(1) + 1
    assert [c.name for c in t.calls] == ["ones0", "add0"]


@pytest.mark.parametrize("raises", [False, True])
def test_the_end_reads_results_before_the_users_gc_thresholds_come_back(monkeypatch: pytest.MonkeyPatch,
                                                                        raises: bool) -> None:
    """The end of a block fills in thousands of records' results (a Stats object each): under the
    user's young-generation threshold each few hundred set off a collection (9 a step on
    resnet50-tiny under ``hash="fast"``). They are filled in while the trace's raised threshold
    holds; the user's thresholds come back afterwards, whether or not the block raised."""
    from tracer.record.checksums.hasher import Hasher

    seen: list[tuple[int, int, int]] = []
    close = Hasher.close

    def watched(self: Hasher, *args: Any, **kwargs: Any) -> None:
        seen.append(gc.get_threshold())
        close(self, *args, **kwargs)

    monkeypatch.setattr(Hasher, "close", watched)
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        with pytest.raises(RuntimeError, match="on purpose") if raises else contextlib.nullcontext(), \
                tracer.trace(hash="fast", stats=True) as t:
            model(torch.randn(3, 4)).sum().backward()
            if raises:
                raise RuntimeError("on purpose")
        assert seen and seen[0][0] >= 50_000
        assert gc.get_threshold() == (700, 10, 10)
        assert all(r.stats is not None for r in t.tensors.values())
    finally:
        gc.set_threshold(*saved)
