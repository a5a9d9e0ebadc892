"""``y.detach()`` of a call's output inside a traced block.

``y.detach()`` is a new tensor object on ``y``'s bytes and version counter, with no ``_base``
that leads a write back to ``y``. A write through either is a new version of the value the
other shows, made by the call that wrote it, with that call's checksum: nothing is left to
look like a change the trace did not see."""

from __future__ import annotations

import hashlib
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


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _call(t: tracer.Trace, name: str) -> tracer.Call:
    return next(c for c in t.calls if c.name == name)


def _linear() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, 4), torch.randn(3, 4)


def test_a_write_through_a_detached_output_is_a_version_of_the_output_made_by_that_call() -> None:
    lin, x = _linear()
    with tracer.trace(hash="md5") as t:
        y = lin(x)
        y.detach().zero_()  # (a hand-written mask, a reset of a kept buffer)
        z = y * 2
    zero = _call(t, "zero_0")
    assert zero.inputs == ["detach0:out"]
    assert zero.outputs == ["detach0:out@v1", "linear0:out@v1"]
    assert _call(t, "mul0").inputs == ["linear0:out@v1"]
    new = t.tensors["linear0:out@v1"]
    assert (new.producer, new.previous, new.role) == ("zero_0", "linear0:out", "output")
    assert new.md5 == _md5(y) == t.tensors["detach0:out@v1"].md5
    assert t.tensors["mul0:out"].md5 == _md5(z)
    assert not any(r.producer is None and r.previous is not None for r in t.tensors.values())


def test_a_write_into_an_output_is_a_version_of_its_detached_alias() -> None:
    lin, x = _linear()
    with tracer.trace(hash="md5") as t:
        y = lin(x)
        d = y.detach()  # a logged copy that is not one
        y.add_(1)
        s = d.sum()
    assert _call(t, "add_0").outputs == ["linear0:out@v1", "detach0:out@v1"]
    assert _call(t, "sum0").inputs == ["detach0:out@v1"]
    new = t.tensors["detach0:out@v1"]
    assert (new.producer, new.previous) == ("add_0", "detach0:out")
    assert new.md5 == _md5(d) == t.tensors["linear0:out@v1"].md5
    assert t.tensors["sum0:out"].md5 == _md5(s)


def test_an_inplace_error_through_a_detached_output_names_the_call_that_wrote_it() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info, tracer.explain_errors():
        y = torch.sigmoid(x)  # saves its output for backward
        y.detach().mul_(2)  # ... which changes here, behind autograd's back but not the trace's
        y.sum().backward()
    note = info.value.__notes__[-1]
    assert ("sigmoid0:out, saved for backward by sigmoid0 (torch.sigmoid), was modified in place by mul_0 "
            "(making sigmoid0:out@v1) before backward ran.") in note
    assert "untraced change" not in note
