"""A Ctrl-C (``KeyboardInterrupt``) that lands inside gradtrace's own work, while it records a
call, a grad node or an optimizer step, reaches the program as it is, and leaves a trace that
holds every call before it whole: the streamed file and ``t.save()`` load, with the same calls.
Before, the outputs of the call being recorded stayed without their call, and both files were
refused ("producer 'AdamW0' is not in the file").

The interrupt is delivered deterministically: a trace function raises it on the N-th entry into
one of the recorder's functions, as a SIGINT handler would at that point, for every N until the
step ends before it."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack as mode_stack

import tracer

# The recorder's functions where an interrupt is delivered: the stats of a value (forward
# outputs, gradients, the optimizer's state and its new versions), every new tensor record, a grad
# node's end and the linking of a call to the grad nodes it made.
WHERE = ["cpu_stats", "new_tensor", "node_done", "link_call_nodes"]


def _interrupt_at(function: str, n: int) -> Any:
    seen = [0]

    def tracer_fn(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == function:
            seen[0] += 1
            if seen[0] == n:
                sys.settrace(None)
                raise KeyboardInterrupt
        return None

    return tracer_fn


def _run(out: str, function: str, n: int) -> tuple[tracer.Trace, bool]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(4, 8)
    interrupted = False
    try:
        with tracer.trace(out=out, flush_every=3) as t:
            sys.settrace(_interrupt_at(function, n))
            try:
                for _ in range(3):
                    m(x).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
            finally:
                sys.settrace(None)
    except KeyboardInterrupt:
        interrupted = True
    return t, interrupted


@pytest.mark.parametrize("function", WHERE)
def test_an_interrupt_inside_the_recorders_work_leaves_every_call_before_it_whole(
        tmp_path: Path, function: str) -> None:
    interrupted_at = 0
    for n in range(1, 400, 2):
        out = str(tmp_path / f"{function}-{n}.gtrace")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (recording stopped: says so)
            t, interrupted = _run(out, function, n)
            if not interrupted:
                break
            interrupted_at += 1
            assert t.status == "failed" and t.error is not None and t.error["type"] == "KeyboardInterrupt"
            streamed = tracer.load(out)
            t.save(out + ".saved.gtrace")
            saved = tracer.load(out + ".saved.gtrace")
        names = [c.name for c in t.calls]
        assert [c.name for c in streamed.calls] == names, n
        assert [c.name for c in saved.calls] == names, n
        assert mode_stack() == []
    assert interrupted_at >= 5  # the loop met the step's work, and went past its end
    assert not interrupted
