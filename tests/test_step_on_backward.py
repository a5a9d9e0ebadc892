"""Loops without an optimizer: ``tracer.trace(steps=..., step_on="backward")`` ends a step at each
backward pass, and a gradient left from before the block is named after its parameter."""

from __future__ import annotations

import hashlib
import os
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer
from export.cli import main
from tracer.model import load_steps
from tracer.options import TraceError


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _manual_sgd(model: nn.Module, passes: int, after_backward: list[dict[str, str]] | None = None) -> None:
    """The pytorch/examples word-language-model loop: zero_grad, forward, backward, clipping,
    an update by hand."""
    x, y = torch.randn(5, 4), torch.randn(5, 1)
    for _ in range(passes):
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        if after_backward is not None:
            with torch._C.DisableTorchFunction():  # (the test's own reads: not part of the step)
                after_backward.append({n: _md5(p) for n, p in model.named_parameters()})
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)


def test_each_backward_pass_ends_a_step() -> None:
    model = _model()
    seen: list[dict[str, str]] = []
    original = torch.Tensor.backward, torch.autograd.backward
    with tracer.trace(steps="1,2", step_on="backward") as st:
        _manual_sgd(model, 4, seen)
    assert st.steps == [1, 2] and st.step == 4
    assert (torch.Tensor.backward, torch.autograd.backward) == original  # the wrappers are gone
    for n in (1, 2):
        t = st.traces[n]
        assert len(t.backward_runs) == 1
        # It starts with the update made from the previous pass's gradients, by their names.
        first = t.calls[0]
        assert first.api == "torch._foreach_norm"
        assert first.inputs == ["0.weight@grad", "0.bias@grad", "2.weight@grad", "2.bias@grad"]
        updates = [c for c in t.calls if c.api == "Tensor.add_"]
        assert [(c.inputs, c.outputs) for c in updates] == [
            ([p, f"{p}@grad@v1"], [f"{p}@v1"]) for p in ("0.weight", "0.bias", "2.weight", "2.bias")]
        # Its forward reads the updated parameters; they hold the bytes the loop had after the pass.
        assert next(c for c in t.calls if c.api == "torch.nn.functional.linear").inputs[1:] == ["0.weight@v1", "0.bias@v1"]
        for name, digest in seen[n].items():
            assert t.tensors[f"{name}@v1"].md5 == digest, (n, name)
        assert t.tensors["0.weight@grad"].role == "grad"


def test_a_gradient_penalty_pass_does_not_end_a_step() -> None:
    model = _model()
    x = torch.randn(5, 4, requires_grad=True)
    with tracer.trace(steps="0-1", step_on="backward") as st:
        for _ in range(3):
            out = model(x).sum()
            (g,) = torch.autograd.grad(out, x, create_graph=True)
            (out + g.pow(2).sum()).backward()
    assert st.steps == [0, 1] and st.step == 3
    assert [len(st.traces[n].backward_runs) for n in (0, 1)] == [2, 2]  # grad, then backward


def test_a_loop_without_an_optimizer_is_told_how_to_count_its_steps() -> None:
    model = _model()
    with pytest.warns(RuntimeWarning, match="no optimizer.step\\(\\) ran.*step_on='backward'") as caught, \
            tracer.trace(steps="0-2") as st:
        _manual_sgd(model, 3)
    assert st.steps == [0] and len(st.traces[0].backward_runs) == 3
    assert st.hint is not None and str(caught[0].message) == f"gradtrace: {st.hint}"


def test_step_on_is_checked() -> None:
    with pytest.raises(TraceError, match="step_on must be one of 'optimizer', 'backward'"):
        tracer.trace(steps="0", step_on="forward")  # type: ignore[call-overload]
    with pytest.raises(TraceError, match="no meaning with step_on='backward'"):
        tracer.trace(steps="0", step_on="backward", optimizer=object())
    with pytest.raises(TraceError, match="only with steps= or every="):
        tracer.trace(step_on="backward")  # type: ignore[call-overload]


def test_a_gradient_read_before_the_block_named_it_is_the_parameters() -> None:
    model = _model()
    x = torch.randn(5, 4)
    model(x).sum().backward()
    with tracer.trace(hash="md5") as t:
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        model.zero_grad()
        model(x).sum().backward()
    assert t.calls[0].inputs == ["0.weight@grad", "0.bias@grad", "2.weight@grad", "2.bias@grad"]
    assert t.tensors["0.weight@grad"].producer is None
    # The backward's new gradient (zero_grad set .grad to None) is the parameter's next one.
    assert _md5(model[0].weight.grad) == t.tensors["0.weight@grad#1"].md5


SCRIPT = textwrap.dedent("""\
    import torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    for i in range(4):
        model.zero_grad()
        model(torch.ones(3, 4)).pow(2).sum().backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.01)
    """)


def test_gradtrace_run_step_on_backward(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "manual.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--steps", "2", "manual.py"]) == 0
    err = capsys.readouterr().err
    assert "no step of manual.py was traced" in err and "--step-on backward counts backward passes" in err
    assert main(["run", "-o", "all.gtrace", "manual.py"]) == 0
    err = capsys.readouterr().err
    assert err.count("no optimizer.step() ran") == 1 and "\ngradtrace: no optimizer.step() ran, so the whole block " \
        "was step 0 (4 backward runs)" in err
    assert main(["run", "--step-on", "backward", "--steps", "1,3", "-o", "m.gtrace", "manual.py"]) == 0
    assert "traced steps 1, 3 of manual.py" in capsys.readouterr().err
    steps = load_steps(os.path.join(tmp_path, "m.gtrace"))
    assert sorted(steps) == [1, 3]
    assert steps[3].calls[0].inputs == ["weight", "weight@grad"]  # the update from pass 2's gradient


def test_zero_grad_at_the_top_of_a_block_looks_for_no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``zero_grad()`` reads every ``.grad`` and uses none: no search of the live objects for the
    parameters' model (~100 ms beside GPT-2 small) until a call uses such a gradient."""
    from tracer.record import owners

    searches: list[int] = []
    search = owners._search_all
    monkeypatch.setattr(owners, "_search_all", lambda: searches.append(1) or search())
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    model(x).sum().backward()
    with tracer.trace(hash="none") as t:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    assert searches == [] and not any(n.startswith("input") and n != "input0" for n in t.tensors)
    model(x).sum().backward()
    with tracer.trace(hash="none") as t:
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # uses them before the model runs
    assert searches == [1] and t.calls[0].inputs == ["0.weight@grad", "0.bias@grad", "2.weight@grad", "2.bias@grad"]
