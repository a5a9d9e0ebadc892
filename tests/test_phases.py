"""The three phases of a step (tracer.model.phases): forward, backward, optimizer.

What runs after the last backward on the gradients, parameters and optimizer state (clipping,
GradScaler's unscale and update, the optimizer step, an EMA, zero_grad) is ``optimizer``; a
micro-batch's data and model calls are ``forward`` again; a file of format version 2 gets its
optimizer phase on load. The summary's Phases table is a golden (docs/trace-format.md shows it).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from rich.console import Console

import tracer
from export.summary import render_summary
from tests.test_dot import check_golden
from tracer.analysis.memory_views import record_tables_data
from tracer.model.display import PHASE_ORDER
from tracer.model.phases import CLOSURE_STEP_NOTE
from tracer.model.records import PHASES


def _loop(steps: int = 1, scaler: bool = False, ema: bool = True) -> tracer.Trace:
    """Two micro-batches (the second's data prepared after the first's backward), GradScaler,
    clipping, AdamW, an EMA copy updated in place, zero_grad(set_to_none=False)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters())
    shadow = [p.detach().clone() for p in model.parameters()]
    amp = torch.amp.GradScaler("cpu") if scaler else None
    batches = torch.randn(2, 4, 8)
    with tracer.trace() as t:
        for x in batches:
            x = x * 2  # the micro-batch's data
            loss = model(x).pow(2).mean() / 2
            (amp.scale(loss) if amp else loss).backward()
        if amp:
            amp.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if amp:
            amp.step(opt)
            amp.update()
        else:
            opt.step()
        if ema:
            with torch.no_grad():
                for e, p in zip(shadow, model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
        opt.zero_grad(set_to_none=False)
    return t


def _phases(t: tracer.Trace) -> dict[str, str]:
    return {c.name: c.phase for c in t.calls}


def test_what_runs_after_the_backward_is_the_optimizer_phase() -> None:
    t = _loop(scaler=True)
    phase = _phases(t)
    # the model's calls and each micro-batch's data are forward, the second micro-batch too
    assert all(phase[c.name] == "forward" for c in t.calls if c.module)
    assert phase["mul0"] == phase["mul1"] == "forward"  # x * 2, before and after the first backward
    # GradScaler's unscale (its inverse scale, found_inf), clipping, the step, the scaler's update,
    # the EMA (the in-place mul_ of a copy, the add_ that reads the parameters), zero_grad
    optimizer = [c.name for c in t.calls if c.phase == "optimizer"]
    for name in ("reciprocal0", "full2", "_amp_foreach_non_finite_check_and_unscale_0", "_foreach_norm0",
                 "clamp0", "_foreach_mul_0", "AdamW0", "_amp_update_scale_0", "mul_0", "add_0", "zero_0"):
        assert name in optimizer, name
    first_optimizer = min(c.seq for c in t.calls if c.phase == "optimizer")
    assert all(c.phase == "optimizer" for c in t.calls if c.seq > first_optimizer)
    # the scaled losses build a graph: forward
    assert all(c.phase == "forward" for c in t.calls if c.seq < first_optimizer and not c.module and c.outputs
               and t.tensors[c.outputs[0]].requires_grad)
    # backward runs are placed among the calls
    assert [r.at for r in t.backward_runs] == sorted(r.at for r in t.backward_runs)
    assert all(r.at is not None for r in t.backward_runs)


def test_a_step_trace_begins_in_the_optimizer_phase_of_the_step_before() -> None:
    """Step N's trace begins inside step N-1's optimizer step: the EMA and zero_grad that follow
    it in the loop are optimizer work; the first module call opens the forward."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shadow = [p.detach().clone() for p in model.parameters()]
    with tracer.trace(steps="1") as run:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(shadow, model.parameters()):
                    e.mul_(0.5).add_(p, alpha=0.5)
            opt.zero_grad(set_to_none=False)
    t = run.traces[1]
    names = [(c.name, c.phase) for c in t.calls]
    assert names[:6] == [("mul_0", "optimizer"), ("add_0", "optimizer"), ("mul_1", "optimizer"),
                         ("add_1", "optimizer"), ("zero_0", "optimizer"), ("zero_1", "optimizer")]
    assert ("linear0", "forward") in names and ("SGD0", "optimizer") in names
    forward = names[names.index(("linear0", "forward")):names.index(("SGD0", "optimizer"))]
    assert forward and all(p == "forward" for _, p in forward)



def _data_prepared_after_the_step(step_traces: bool) -> tuple[tracer.Trace, dict[str, str]]:
    """DCGAN's loop, twice: the batch's labels filled in place and the batch copied into a kept
    buffer right after the step before (a new DataLoader iterator's seed, ``random_``, too), an
    EMA copy updated in place after each step. ``step_traces``: the second step's trace of
    ``trace(steps="1")``, which begins at the first step's ``optimizer.step()``; else one block
    around both."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shadow = [p.detach().clone() for p in model.parameters()]
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    label, kept = torch.zeros(4), torch.empty(4, 4)
    with tracer.trace(steps="1") if step_traces else tracer.trace() as run:
        for (x,) in torch.utils.data.DataLoader(data, batch_size=4):  # its iterator draws a seed: random_
            label.fill_(1.0)
            kept.copy_(x)
            loss = nn.functional.mse_loss(model(kept).squeeze(1), label)
            loss.backward()
            opt.step()
            with torch.no_grad():
                for e in shadow:
                    e.mul_(0.5)  # an update of a copy from its old value: still optimizer work
            opt.zero_grad()
    t = run.traces[1] if step_traces else run
    return t, _phases(t)


@pytest.mark.parametrize("step_traces", [True, False], ids=["step-trace", "one-block"])
def test_data_overwritten_in_place_after_the_step_is_the_next_steps_data_not_optimizer_work(
        step_traces: bool) -> None:
    t, phase = _data_prepared_after_the_step(step_traces)
    second = "_1" if not step_traces else "_0"  # (the second iteration's, in one block)
    assert phase[f"fill{second}"] == phase[f"copy{second}"] == "forward"  # overwritten whole, none of it read
    assert phase["mul_0"] == phase["mul_1"] == "optimizer"  # the EMA copies' mul_ (rule 6)
    assert all(phase[c.name] == "forward" for c in t.calls if c.api == "torch.nn.functional.linear")
    assert all(phase[c.name] == "optimizer" for c in t.calls if c.kind == "optimizer")


def _saved_as_format_2(t: tracer.Trace, tmp_path: Path) -> Path:
    """``t`` saved as format version 2 wrote it: two phases (no ``optimizer``), runs without
    their place among the calls."""
    path = tmp_path / "v3.gtrace"
    t.save(path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        if r["t"] == "header":
            r["version"] = 2
        if r["t"] == "call" and r["phase"] == "optimizer":
            r["phase"] = "forward"
        r.pop("at", None)
    old = tmp_path / "v2.gtrace.gz"
    with gzip.open(old, "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
    return old


def test_a_format_2_file_gets_the_same_rule_for_data_overwritten_in_place(tmp_path: Path) -> None:
    t, phase = _data_prepared_after_the_step(step_traces=False)
    assert phase["fill_1"] == "forward" and phase["mul_0"] == "optimizer"
    assert _phases(tracer.load(_saved_as_format_2(t, tmp_path))) == phase


def test_a_format_2_file_gets_its_optimizer_phase_on_load(tmp_path: Path) -> None:
    t = _loop()
    loaded = tracer.load(_saved_as_format_2(t, tmp_path))
    assert _phases(loaded) == _phases(t)
    assert [r.at for r in loaded.backward_runs] == [None, None]
    # the story reads the same from either file: the runs are placed after the losses they start from
    assert loaded.anomalies.headline_text() == t.anomalies.headline_text()


def test_the_summary_says_what_each_phase_holds(update_golden: bool) -> None:
    """The Phases table of `gradtrace summary` (the example in docs/trace-format.md)."""
    t = _loop()
    console = Console(width=100, record=True, force_terminal=False)
    render_summary(t, console)
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    start = lines.index("Phases")
    end = next(i for i in range(start + 3, len(lines)) if not lines[i].strip())
    check_golden("summary_phases.txt", "\n".join(lines[start:end]) + "\n", update_golden)


def test_memory_is_counted_by_phase() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    with tracer.record_memory() as rec:
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
    assert {e["phase"] for e in rec.allocs} == {"forward", "backward", "optimizer"}
    made = {e["owner"] for e in rec.allocs if e["phase"] == "optimizer"}
    assert "AdamW0" in made
    rows = {r[0] for r in next(t for t in record_tables_data(rec).tables if t.title == "By phase").rows}
    assert rows == {"forward", "backward", "optimizer"}


def test_the_watch_applies_the_policy_before_a_save_that_fails(tmp_path: Path) -> None:
    """Issue 45 item 9: the incident cannot be saved (its directory is missing): the state is put
    back first, a warning names the path, and the run goes on as the policy says."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = tmp_path / "missing" / "incident.gtrace"

    @tracer.watch(model, opt, out=str(out), policy="skip")
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean() + x.abs().mean().log()  # log(0): -Inf for a zero batch
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step(torch.ones(2, 4))
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step(torch.zeros(2, 4))  # trips: skipped, not raised
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    said = [str(w.message) for w in seen if "could not be saved" in str(w.message)]
    assert len(said) == 1 and str(out.parent / "incident.step1.gtrace") in said[0]
    [incident] = step.watch.incidents
    assert incident.path is None and incident.trace is not None and incident.save_error is not None
    step(torch.ones(2, 4))  # the run goes on: no NaN left behind, no new incident
    assert len(step.watch.incidents) == 1 and all(torch.isfinite(p).all() for p in model.parameters())

    # under raise: the state is put back, the save failure is in the message, the exception is the one raised
    model2 = nn.Linear(4, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    def step2(x: torch.Tensor) -> torch.Tensor:
        loss = model2(x).sum() + x.abs().mean().log()
        loss.backward()
        opt2.step()
        return loss

    watched = tracer.watch(model2, opt2, out=str(out), policy="raise")(step2)
    kept = [p.detach().clone() for p in model2.parameters()]
    with warnings.catch_warnings(record=True), pytest.raises(tracer.WatchTripped) as info:
        watched(torch.zeros(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(kept, model2.parameters()))
    assert "could not be saved" in str(info.value)


def test_report_false_writes_no_html_and_the_default_writes_it(tmp_path: Path) -> None:
    # The default report is found through the installed entry point; a checkout put on the path
    # by PYTHONPATH alone (the GPU machine's runs) has none, and writes no report, as documented.
    try:
        importlib.metadata.distribution("gradtrace")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gradtrace is not installed: no gradtrace.report_writers entry point")
    for report, expect in ((None, True), (False, False)):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = tmp_path / f"r{expect}" / "incident.gtrace"
        out.parent.mkdir()
        def train(x: torch.Tensor, model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> torch.Tensor:
            loss = model(x).sum() + x.abs().mean().log()
            loss.backward()
            opt.step()
            return loss

        step = tracer.watch(model, opt, out=str(out), policy="skip", report=report)(train)
        step(torch.zeros(2, 4))
        [incident] = step.watch.incidents
        assert (incident.report is not None) == expect
        assert (out.parent / "incident.step0.html").is_file() == expect


def test_the_docs_show_the_phases_golden() -> None:
    """docs/trace-format.md and the README show the golden Phases table as it is."""
    golden = (Path(__file__).parent / "golden" / "summary_phases.txt").read_text(encoding="utf-8").rstrip("\n")
    root = Path(__file__).resolve().parents[1]
    for doc in ("docs/trace-format.md", "README.md"):
        assert golden in (root / doc).read_text(encoding="utf-8"), doc


def test_one_order_of_the_phases() -> None:
    assert PHASE_ORDER == PHASES == ("forward", "backward", "optimizer")


def test_a_parameter_updated_in_place_outside_an_optimizer_call_is_optimizer_phase() -> None:
    # A leaf that requires grad, written in place (only possible under no_grad), builds no graph:
    # a hand-written SGD update, LBFGS (whose closure makes step() record its ops one by one) and
    # any optimizer under optimizer_ops=True update the parameters in the optimizer phase.
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randn(8, 1)
    model = nn.Linear(5, 1)
    with tracer.trace() as t:
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
    assert [(c.name, c.phase) for c in t.calls if c.mutated] == [("sub_0", "optimizer"), ("sub_1", "optimizer")]
    assert t["linear0"].phase == "forward"

    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=2)

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with tracer.trace() as t:
        lbfgs.step(closure)
    updates = [c for c in t.calls if any(m.startswith(("weight@v", "bias@v")) for m in c.mutated)]
    assert updates and {c.phase for c in updates} == {"optimizer"}
    assert all(c.phase == "forward" for c in t.calls if c.api == "torch.nn.functional.linear")
    # Why no call is the optimizer step, said once; the summary neither says "no optimizer step"
    # nor calls the closure's two evaluations micro-batches.
    assert t.notes == [CLOSURE_STEP_NOTE.format(cls="LBFGS")] and len(t.backward_runs) == 2
    console = Console(width=200, record=True, color_system=None)
    render_summary(t, console)
    text = console.export_text()
    assert re.search(r"^\s*optimizer\s+\d+\s+\S+\s+\S+\s+a step with a closure: its ops one by one\s*$", text, re.M)
    assert "micro-batches" not in text and "no optimizer step" not in text


def _adversarial_step(by_grad: bool) -> tracer.Trace:
    """FGSM adversarial training: the input's gradient (from ``torch.autograd.grad``, or the
    ``.grad`` of an input the block made) builds the adversarial batch before the step's real
    forward and backward; a frozen weight is read at the top of the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    frozen = nn.Parameter(torch.randn(2, 2), requires_grad=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with tracer.trace() as t:
        frozen.view(4).sum()  # (a frozen weight read before any backward: data, not optimizer work)
        x_ = x.clone().requires_grad_(True)
        if by_grad:
            g, = torch.autograd.grad(nn.functional.cross_entropy(model(x_), y), x_)
        else:
            nn.functional.cross_entropy(model(x_), y).backward()
            g = x_.grad
            opt.zero_grad()
        x_adv = (x + 0.1 * g.sign()).clamp(-3, 3)
        nn.functional.cross_entropy(model(x_adv), y).backward()
        opt.step()
    return t


@pytest.mark.parametrize("by_grad", [True, False], ids=["autograd.grad", "x.grad"])
def test_an_input_gradient_that_makes_the_steps_data_is_forward_not_optimizer(by_grad: bool) -> None:
    t = _adversarial_step(by_grad)
    phase = _phases(t)
    assert phase["view0"] == phase["sum0"] == "forward"
    assert phase["sign0"] == phase["mul0"] == phase["add0"] == phase["clamp0"] == "forward"
    assert phase["SGD0"] == "optimizer"
    if not by_grad:  # zero_grad(): the parameters' gradients are the model's state
        assert {c.phase for c in t.calls if c.name.startswith("zero_")} <= {"optimizer"}


def test_a_format_2_file_gets_the_same_phases_for_an_adversarial_step(tmp_path: Path) -> None:
    t = _adversarial_step(by_grad=True)
    assert _phases(tracer.load(_saved_as_format_2(t, tmp_path))) == _phases(t)


def test_clamping_weights_at_the_top_of_a_step_is_still_optimizer_work() -> None:
    """WGAN's weight clipping before the critic's forward: written in place, so rule 5 holds
    with the window closed; a manual SGD update reading ``.grad`` too."""
    torch.manual_seed(0)
    critic = nn.Linear(4, 1)
    with tracer.trace() as t:
        with torch.no_grad():
            for p in critic.parameters():
                p.clamp_(-0.01, 0.01)
        critic(torch.randn(3, 4)).mean().backward()
        with torch.no_grad():
            for p in critic.parameters():
                p.add_(p.grad, alpha=-0.1)
    phase = _phases(t)
    assert phase["clamp_0"] == phase["clamp_1"] == "optimizer"
    assert phase["add_0"] == phase["add_1"] == "optimizer"


def test_a_batch_prepared_in_place_at_a_step_trace_s_start_is_the_step_s_data() -> None:
    """A step trace begins right after the optimizer step before it, with the optimizer window
    open (an EMA's ``mul_`` there is optimizer work): a batch the step makes and then writes in
    place (``x[0, 0] = v``, data corrupted or masked before the forward) is the step's data, and
    so is what reads it."""
    torch.manual_seed(0)
    data = torch.randn(16, 10)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    ema = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(steps=[1], hash="none") as steps:
        for step in range(2):
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.9).add_(p.detach(), alpha=0.1)  # the EMA of the step before: optimizer work
            x = data[step * 8:(step + 1) * 8].clone()
            x[0, 0] = 0.0  # the batch, prepared in place
            xs = x[:8]
            model(xs).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    t = steps.traces[1]
    phases = {c.name: c.phase for c in t.calls}
    assert [phases[n] for n in ("clone0", "setitem0", "getitem1")] == ["forward"] * 3
    assert {phases[c.name] for c in t.calls if c.api in ("Tensor.mul_", "Tensor.add_")} == {"optimizer"}
