"""``tracer.check_determinism`` and the state it does not own: an LR scheduler stepped inside the
step is put back (after the check, and before each repeat, also when the step reaches it only
through an object of its own); a Python value that changed between the repeats (a warm-up factor
from a counter, a learning rate set from one) is told as arguments that differ, not as an op that
is not deterministic; and a random op reading a private ``torch.Generator`` is named with that
cause, or made deterministic by passing the generator with ``generators=``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import tracer
from tracer.analysis import determinism as analysis

HERE = __file__


def _line_of(marker: str) -> int:
    with open(HERE, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if marker in line and "_line_of(" not in line:
                return n
    raise LookupError(marker)


def _model() -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2), torch.randn(3, 4), torch.tensor([0, 1, 0])


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---- LR schedulers --------------------------------------------------------------------------------
def _scheduled() -> tuple[torch.nn.Linear, torch.optim.SGD, torch.optim.lr_scheduler.LambdaLR, Callable[[], None]]:
    model, x, y = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    return model, opt, sched, step


def test_a_scheduler_stepped_in_the_step_is_put_back_as_it_was() -> None:
    model, opt, sched, step = _scheduled()
    step()
    step()
    report = tracer.check_determinism(step, model=model, optimizer=opt, repeats=3)  # the scheduler: in the closure
    assert report.deterministic
    assert (sched.last_epoch, sched.get_last_lr(), opt.param_groups[0]["lr"]) == (2, [1 / 3], 1 / 3)
    assert vars(opt)["_opt_called"] is True
    step()
    # The same three steps without the check: the same schedule, the same parameters.
    model2, opt2, sched2, step2 = _scheduled()
    for _ in range(3):
        step2()
    assert (sched.last_epoch, opt.param_groups[0]["lr"]) == (sched2.last_epoch, opt2.param_groups[0]["lr"]) == (3, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_each_repeat_starts_with_the_scheduler_as_it_was_also_one_found_through_the_optimizer() -> None:
    model, x, y = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # (Not a name the step uses. LambdaLR's lr follows last_epoch; StepLR's would follow the lr the
    # optimizer snapshot already puts back.)
    parts = {"sched": torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)}

    def step() -> None:  # two micro-steps: the second reads the lr the scheduler set after the first
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            parts["sched"].step()
    step()
    before = _params(model)
    report = tracer.check_determinism(step, model=model, optimizer=opt)
    assert report.describe() == ("deterministic: 2 runs of the step from the same state gave bit-equal results "
                                 "(18 records compared)")
    assert [c.args for c in report.traces[1].calls if c.api.endswith("SGD.step")] == [
        "lr=0.25, momentum=0, dampening=0, weight_decay=0", "lr=0.125, momentum=0, dampening=0, weight_decay=0"]
    sched = parts["sched"]
    assert (sched.last_epoch, opt.param_groups[0]["lr"], opt.param_groups[0]["initial_lr"]) == (2, 0.25, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


# ---- Python values that changed between the repeats -----------------------------------------------
def test_a_python_argument_that_changed_between_repeats_is_told_as_such() -> None:
    model, x, y = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"it": 0}

    def step() -> None:
        state["it"] += 1
        warm = min(1.0, state["it"] / 10)  # a warm-up factor from a Python counter
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * warm).backward()
        opt.step()
    report = tracer.check_determinism(step, model=model, optimizer=opt)
    assert not report and report.first is None
    assert report.before == (
        "run 2 called mul0 (Tensor.mul) with other arguments than run 1 at record 3: inputs match, arguments differ "
        "('0.1' vs '0.2'), outputs differ (the step reads a Python value that changed between the runs, e.g. a "
        "counter, which the check does not put back: another path, not a nondeterministic op)")
    assert report.describe() == f"not comparable: {report.before}"


def test_a_setting_the_step_changes_from_a_counter_names_the_setting() -> None:
    model, x, y = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = {"n": 0}

    def step() -> None:
        calls["n"] += 1
        opt.param_groups[0]["lr"] = 0.1 * calls["n"]  # (restored before each repeat, then set again)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    report = tracer.check_determinism(step, model=model, optimizer=opt)
    assert report.before == (
        "run 2 called SGD0 (torch.optim.sgd.SGD.step) with other arguments than run 1 at record 9: inputs match, "
        "arguments differ ('lr=0.1' vs 'lr=0.2'), outputs differ (the step reads a Python value that changed "
        "between the runs, e.g. a counter, which the check does not put back: another path, not a "
        "nondeterministic op)")
    assert opt.param_groups[0]["lr"] == 0.1  # (as it was before the check)


# ---- private generators -----------------------------------------------------------------------------
def _noisy(g: torch.Generator) -> tuple[torch.nn.Linear, torch.optim.SGD, Callable[[], None]]:
    model, x, y = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        noise = torch.randn(x.shape, generator=g) * 0.01  # PRIVATE-GENERATOR
        opt.zero_grad()
        F.cross_entropy(model(x + noise), y).backward()
        opt.step()
    return model, opt, step


def test_a_random_op_reading_a_private_generator_is_named_with_that_cause() -> None:
    g = torch.Generator().manual_seed(5)
    model, opt, step = _noisy(g)
    report = tracer.check_determinism(step, model=model, optimizer=opt)
    first = report.first
    assert first is not None and (first.name, first.what) == ("randn0", "torch.randn")
    line = _line_of("# PRIVATE-GENERATOR")
    assert report.describe() == (
        f"not deterministic: randn0 (torch.randn) at {HERE}:{line} (noise = torch.randn(x.shape, generator=g) * 0.01"
        "  # PRIVATE-GENERATOR) got bit-equal inputs in runs 1 and 2 and gave different outputs (randn0:out)\n"
        "  usual cause: a random op drawing from a torch.Generator of its own (generator=): the check puts torch's "
        "default generators back before each repeat, not a private one, so each repeat draws other numbers from "
        "where the last one left it\n"
        "  set: re-seed the generator inside the step (g.manual_seed(seed)), or pass it so it can be restored: "
        "tracer.check_determinism(step_fn, ..., generators=[g])")
    assert (first.cause, first.fix) == analysis.PRIVATE_GENERATOR


def test_a_private_generator_passed_to_the_check_is_put_back() -> None:
    g = torch.Generator().manual_seed(5)
    model, opt, step = _noisy(g)
    state = g.get_state()
    report = tracer.check_determinism(step, model=model, optimizer=opt, generators=[g], repeats=3)
    assert report.deterministic and report.before is None
    assert torch.equal(g.get_state(), state)
    with pytest.raises(tracer.TraceError, match=r"generators must be torch\.Generator objects, got int"):
        tracer.check_determinism(step, model=model, optimizer=opt, generators=[5])


def test_the_private_generator_cause_is_for_random_ops_given_a_generator() -> None:
    for text in ("torch.randn (3, 4), generator=Generator", "Tensor.normal_ generator=Generator",
                 "torch.randint 0, 5, (3), generator=Generator", "torch.bernoulli generator=Generator"):
        assert analysis.usual_cause(text) == analysis.PRIVATE_GENERATOR, text
    assert analysis.usual_cause("torch.randn (3, 4), generator=None") is None  # (the default one: put back)
    assert analysis.usual_cause("torch.nn.functional.dropout p=0.5, training=True, inplace=False") is None
