"""Only the thread that entered ``tracer.trace()`` is recorded, whatever other threads do
meanwhile: a second thread running its own training step with a custom ``autograd.Function``
(the same class the traced step uses) while the traced step is in its backward adds nothing to
the trace, and takes nothing from it. Events order the two threads, so the overlap happens on
every repetition instead of by luck."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack as mode_stack

import tracer
from tracer.options import TraceError

STEPS = 8  # Function applications per forward
TIMEOUT = 30.0


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class Gate(torch.autograd.Function):
    """Identity; its backward runs ``ctx.hook`` (set per thread by ``forward``'s caller) before
    passing the gradient on: where each thread waits for the other."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Callable[[], None]) -> torch.Tensor:
        ctx.hook = hook
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.hook()
        return g.clone(), None


def _step(w: torch.Tensor, hook: Callable[[], None]) -> None:
    """A training step: STEPS Doubles, a Gate last (its backward runs first), the backward."""
    y = w
    for _ in range(STEPS):
        y = Double.apply(y)
    Gate.apply(y, hook).sum().backward()


def _expected_calls() -> list[tuple[str, str | None, str]]:
    """(name, parent, phase) of every call of the traced step, by construction."""
    calls: list[tuple[str, str | None, str]] = []
    for i in range(STEPS):
        calls += [(f"Double{i}", None, "forward"), (f"mul{i}", f"Double{i}", "forward")]
    calls += [("Gate0", None, "forward"), ("clone0", "Gate0", "forward"), ("sum0", None, "forward")]
    calls += [("clone1", "Gate0/GateBackward", "backward")]
    calls += [(f"mul{STEPS + k}", f"Double{STEPS - 1 - k}/DoubleBackward", "backward") for k in range(STEPS)]
    return calls


def _traced_while_another_thread_steps() -> tracer.Trace:
    """The traced step's backward waits, inside its Gate, for the other thread's whole step
    (forward and a backward through its own Doubles and Gate) to run, then goes on."""
    traced_in_backward, other_done = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def other() -> None:
        try:
            w = torch.ones(16, requires_grad=True)
            assert traced_in_backward.wait(TIMEOUT)
            _step(w, lambda: None)
        except BaseException as exc:  # reported by the traced thread
            failures.append(exc)
        finally:
            other_done.set()

    def wait_for_other() -> None:
        traced_in_backward.set()
        assert other_done.wait(TIMEOUT)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        w = torch.ones(16, requires_grad=True)
        with tracer.trace(hash="none") as t:
            _step(w, wait_for_other)
    finally:
        traced_in_backward.set()
        thread.join(TIMEOUT)
    assert not failures, failures
    assert not thread.is_alive()
    return t


def test_another_threads_custom_backward_stays_out_of_the_trace() -> None:
    expected = _expected_calls()
    for _ in range(5):
        t = _traced_while_another_thread_steps()
        assert [(c.name, c.parent, c.phase) for c in t.calls] == expected
        (run,) = t.backward_runs
        # (hash="none": the runs of nodes that run Python, and the accumulator of w, input0)
        assert [s.node for s in run.steps] == ["Gate0/GateBackward"] + [
            f"Double{i}/DoubleBackward" for i in reversed(range(STEPS))] + ["input0/AccumulateGrad"]


def test_racing_steps_of_two_threads_record_the_traced_one_exactly() -> None:
    """The other thread steps without a pause, from before the first traced step to after the
    last: each trace holds its own thread's calls, no more, no fewer."""
    running, stop = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def other() -> None:
        try:
            w = torch.ones(64, requires_grad=True)
            while not stop.is_set():
                _step(w, running.set)
        except BaseException as exc:  # reported by the traced thread
            failures.append(exc)
            running.set()

    thread = threading.Thread(target=other)
    thread.start()
    expected = _expected_calls()
    try:
        assert running.wait(TIMEOUT)  # its first backward has run
        for _ in range(100):
            w = torch.ones(64, requires_grad=True)
            with tracer.trace(hash="none") as t:
                _step(w, lambda: None)
            assert [(c.name, c.parent, c.phase) for c in t.calls] == expected
    finally:
        stop.set()
        thread.join(TIMEOUT)
    assert not failures, failures


def test_a_block_left_on_another_thread_is_refused_and_stays_whole(tmp_path: Any) -> None:
    """``__exit__`` called on a thread other than the one that entered the block (a pool thread
    entered it) is refused with a message naming both threads: the recording mode sits on the
    entering thread's stack of modes and can only come off there. The block goes on recording
    its own thread, and ends whole when it is left there."""
    m, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    out = str(tmp_path / "pool.gtrace")
    block = tracer.trace(out=out)
    results: dict[str, Any] = {}
    entered, left_elsewhere = threading.Event(), threading.Event()

    def pool_thread() -> None:
        results["trace"] = block.__enter__()
        m(x)
        entered.set()
        assert left_elsewhere.wait(TIMEOUT)
        m(x)  # (still recorded: the block is open)
        block.__exit__(None, None, None)
        results["stack after"] = mode_stack()

    worker = threading.Thread(target=pool_thread, name="pool-0")
    worker.start()
    assert entered.wait(TIMEOUT)
    with pytest.raises(TraceError, match=r"must end on the thread that entered it \(thread 'pool-0'\), "
                                         r"not on thread 'MainThread'; it is still recording"):
        block.__exit__(None, None, None)
    assert mode_stack() == []  # nothing of this thread's was touched
    left_elsewhere.set()
    worker.join(TIMEOUT)
    t = results["trace"]
    assert results["stack after"] == [] and t.status == "ok"
    assert [c.name for c in t.calls] == ["linear0", "linear1"]
    assert [c.name for c in tracer.load(out).calls] == ["linear0", "linear1"]
    m(x)  # after the block: not recorded
    assert len(t.calls) == 2
