"""``explain_errors``: which grad node failed, when the failure is not where a node's own code
runs: a built-in node of the inner graph that a custom backward runs with ``autograd.grad``,
and a module's full backward hook (run by torch as a hook of its BackwardHookFunction node)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

import tracer


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Outer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            y = torch.sigmoid(xd)  # saves its output for backward
            y.mul_(2)  # ... which changes here
        ctx.save_for_backward(xd, y)
        return y.detach()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        xd, y = ctx.saved_tensors
        with torch.enable_grad():
            return torch.autograd.grad(y, xd, g)[0]


def test_an_inplace_error_inside_a_custom_backwards_inner_run_names_the_inner_node() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info, tracer.explain_errors():
        Outer.apply(x).sum().backward()
    note = info.value.__notes__[-1]
    assert note.splitlines()[0].endswith("failed in grad node sigmoid0/SigmoidBackward0 [SigmoidBackward0].")
    heads = [ln.strip() for ln in note.splitlines() if "Error in backward of" in ln]
    assert heads[0].startswith("Error in backward of Outer0/OuterBackward [OuterBackward]")
    assert heads[-1].startswith("Error in backward of sigmoid0/SigmoidBackward0 [SigmoidBackward0]")
    assert ("sigmoid0:out, saved for backward by sigmoid0 (torch.sigmoid), was modified in place by mul_0 "
            "(making sigmoid0:out@v1) before backward ran.") in note
    assert "The tensor Outer0 saved" not in note


def test_a_module_backward_hook_that_raises_names_its_node_and_module() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3)))

    def hook(module, grad_in, grad_out):  # type: ignore[no-untyped-def]
        raise RuntimeError("hook exploded")

    model[1][0].register_full_backward_hook(hook)
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="hook exploded") as info, tracer.explain_errors():
        model(x).sum().backward()
    note = info.value.__notes__[-1]
    lines = note.splitlines()
    assert lines[0].endswith("failed in grad node BackwardHookFunction0/BackwardHookFunctionBackward "
                             "[BackwardHookFunctionBackward].")
    assert "in module '1.0':" in lines[1]
    assert '<locals>.hook: raise RuntimeError("hook exploded")' in note


@pytest.mark.parametrize("make", [tracer.explain_errors, tracer.trace])
def test_a_node_detect_anomaly_finds_returning_nan_is_the_node_named(make) -> None:  # type: ignore[no-untyped-def]
    """detect_anomaly checks a node's results after the node (and gradtrace's hook on it) finished:
    the note names the node torch's message names (the square root's backward, at its line), not
    the next node the graph would have run (the squeeze's, which never ran)."""
    torch.manual_seed(0)
    lin, x = nn.Linear(4, 1), torch.randn(6, 4)
    with pytest.raises(RuntimeError, match="Function 'SqrtBackward0' returned nan values") as info, \
            make(), torch.autograd.detect_anomaly():
        h = lin(x).squeeze(-1)
        y = torch.where(h > 0, torch.sqrt(h), 0.0)  # the sqrt of a negative h: NaN, and a NaN gradient
        y.sum().backward()
    note = info.value.__notes__[-1]
    assert note.splitlines()[0].endswith("failed in grad node sqrt0/SqrtBackward0 [SqrtBackward0].")
    assert "Error in backward of sqrt0/SqrtBackward0 [SqrtBackward0], created by sqrt0 (torch.sqrt)" in note
    assert "y = torch.where(h > 0, torch.sqrt(h), 0.0)" in note
    assert "Squeeze" not in note
