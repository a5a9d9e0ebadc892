"""Tracing chosen steps of a long loop: step boundaries, nothing installed between them, bounds,
multi-step files."""

from __future__ import annotations

import gzip
import os

import pytest
import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_mod
from torch.overrides import _get_current_function_mode_stack

import tracer
from tests.models import MLP
from tracer.loops.steps import StepSelection, step_path
from tracer.loops.steps import step as mark_step
from tracer.model import load_steps
from tracer.record.checksums.bytes import md5_of

ORIGINAL_APPLY = torch.autograd.function.Function.__dict__["apply"]


def _installed() -> dict[str, object]:
    """What tracing puts in place, as the loop body sees it."""
    return {"modes": len(_get_current_function_mode_stack()),
            "module_pre_hooks": len(nn_module._global_forward_pre_hooks),
            "module_hooks": len(nn_module._global_forward_hooks),
            "apply_wrapped": torch.autograd.function.Function.__dict__["apply"] is not ORIGINAL_APPLY,
            "optimizer_pre_hooks": len(optim_mod._global_optimizer_pre_hooks),
            "optimizer_post_hooks": len(optim_mod._global_optimizer_post_hooks)}


def _last_version(trace: tracer.Trace, base: str) -> tracer.TensorRecord:
    versions = [t for t in trace.tensors.values() if t.name == base or t.name.startswith(base + "@v")]
    return max(versions, key=lambda t: t.seq)


def test_gpt2_loop_of_50_steps_traced_at_steps_10_and_40_only(tmp_path):
    import transformers as tf

    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 100, (50, 2, 8))
    wte = model.transformer.wte.weight
    after_step: list[str] = []  # md5 of the embedding after each optimizer step
    snap = optim_mod.register_optimizer_step_post_hook(lambda o, a, k: after_step.append(md5_of(wte)))
    baseline = _installed()
    seen: dict[int, dict[str, object]] = {}
    path = os.fspath(tmp_path / "run.gtrace")
    try:
        with tracer.trace(steps="10,40", out=path) as st:
            for i in range(50):
                loss = model(input_ids=data[i], labels=data[i]).loss
                seen[i] = _installed()  # mid-step: between forward and backward
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert _installed() == baseline
    finally:
        snap.remove()

    # untraced steps: only the one global optimizer hook (and no mode, module hook or wrapper)
    untraced = {**baseline, "optimizer_post_hooks": baseline["optimizer_post_hooks"] + 1}
    assert [i for i in range(50) if seen[i] != untraced] == [10, 40]
    for i in (10, 40):
        assert seen[i]["modes"] == baseline["modes"] + 1 and seen[i]["apply_wrapped"] is True
        assert seen[i]["module_pre_hooks"] == baseline["module_pre_hooks"] + 1

    assert st.steps == [10, 40] and st.paths == [path] and st.skipped == []
    steps = load_steps(path)
    assert list(steps) == [10, 40]
    first = tracer.load(path)
    assert first.header["step"] == 10 and first.meta["steps_in_file"] == [10, 40]
    assert tracer.load(path, step=40).header["step"] == 40
    for n, t in steps.items():
        assert t.header["step"] == n and t.status == "ok" and t.notes == []
        assert len(t.backward_runs) == 1
        # Step n starts right after step n-1's optimizer step and ends with its own.
        assert t["transformer.wte.weight"].md5 == after_step[n - 1]
        assert _last_version(t, "transformer.wte.weight").md5 == after_step[n]
        assert t["transformer.wte.weight.exp_avg"].role == "state"
    # the same program step: the same names in the same order
    assert [c.name for c in steps[10].calls] == [c.name for c in steps[40].calls]
    assert steps[10].calls[0].stack[-1].file == __file__


MLP_STEP_CALLS = ["randn0", "linear0", "tanh0", "linear1", "tanh1", "linear2", "tanh2", "pow0", "mean0",
                  "SGD0"]  # forward, loss, the SGD step (one call)


def _loop(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_every_with_a_file_per_step_and_no_empty_tail(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = os.fspath(tmp_path / "run.gtrace")
    with tracer.trace(every=2, out=out, per_step_files=True) as st:
        _loop(model, opt, 6)
    # Step 6 began after the last optimizer step but nothing of it ran: no file for it.
    assert st.steps == [0, 2, 4]
    assert sorted(os.listdir(tmp_path)) == ["run.step0.gtrace", "run.step2.gtrace", "run.step4.gtrace"]
    for n in (0, 2, 4):
        t = tracer.load(step_path(out, n))
        assert t.header["step"] == n and t.meta["steps_in_file"] == [n] and t.status == "ok"
        assert [c.name for c in t.calls] == MLP_STEP_CALLS
    assert step_path("a/run.gtrace.gz", 7) == "a/run.step7.gtrace.gz"
    assert step_path("run", 7) == "run.step7"


def test_in_memory_steps_and_a_tail_that_ran_is_kept_with_a_note():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(steps="1,3") as st:
        _loop(model, opt, 3)
        model(torch.randn(3, 8))  # step 3 starts but never reaches its optimizer step
    assert list(st.traces) == [1, 3]
    assert st.traces[1].notes == []
    tail = st.traces[3]
    assert [c.name for c in tail.calls] == ["randn0", "linear0", "tanh0", "linear1", "tanh1", "linear2", "tanh2"]
    assert tail.notes == ["step 3 did not reach its end (optimizer.step() or tracer.step()): the traced block "
                          "ended first"]


def test_tracer_step_marks_boundaries_in_a_loop_without_optimizer():
    w = torch.ones(4, requires_grad=True)
    xs = [torch.full((4,), float(i)) for i in range(5)]
    assert mark_step() is None  # outside a step trace: nothing happens
    with tracer.trace(steps="2") as st:
        for i in range(5):
            assert mark_step(i) == i
            (w * xs[i]).sum().backward()
            with torch.no_grad():
                w -= 0.1 * w.grad
            w.grad = None
    t = st.traces[2]
    assert t.header["step"] == 2
    mul = t["mul0"]
    assert t[mul.inputs[1]].md5 == md5_of(xs[2])
    assert len(t.backward_runs) == 1


def test_only_the_chosen_optimizer_counts_steps():
    model = MLP()
    main_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with tracer.trace(steps="2", optimizer=main_opt) as st:
        for _ in range(3):
            model(torch.randn(3, 8)).sum().backward()
            other.step()
            main_opt.step()
            main_opt.zero_grad()
    assert st.steps == [2] and st.step == 3


def test_max_calls_stops_recording_at_the_bound_and_says_so(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = os.fspath(tmp_path / "run.gtrace")
    with pytest.warns(RuntimeWarning, match="recording stopped at max_calls=7"), \
            tracer.trace(steps="1,2", out=out, max_calls=7) as st:
        _loop(model, opt, 4)
    assert st.steps == [1] and st.skipped == [2]
    steps = load_steps(out)
    assert list(steps) == [1]
    t = steps[1]
    assert len(t.calls) == 7 and t.backward_runs == [] and t.status == "ok"
    assert t.notes == ["recording stopped at max_calls=7: later calls, grad nodes and backward runs were not "
                       "recorded"]
    # a plain trace: the same bound, the same note
    with pytest.warns(RuntimeWarning, match="max_calls=3"), tracer.trace(max_calls=3) as plain:
        model(torch.randn(3, 8))
    assert len(plain.calls) == 3 and plain.notes[0].startswith("recording stopped at max_calls=3")


def test_max_calls_counts_all_traced_steps_together():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(steps="0-3", max_calls=14) as st, pytest.warns(RuntimeWarning):
        _loop(model, opt, 4)
    assert list(st.traces) == [0, 1] and st.skipped == [2, 3]
    assert len(st.traces[0].calls) == 10 and len(st.traces[1].calls) == 4
    assert st.traces[1].notes[0].startswith("recording stopped at max_calls=14 (10 in earlier steps)")


def test_max_bytes_stops_recording_and_says_so(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = os.fspath(tmp_path / "run.gtrace")
    with pytest.warns(RuntimeWarning, match="max_bytes=4000"), \
            tracer.trace(steps="0,1", out=out, max_bytes=4000) as st:
        _loop(model, opt, 2)
    assert st.steps == [0] and st.skipped == [1]
    t = tracer.load(out)
    assert t.notes[0].startswith("recording stopped at max_bytes=4000")
    assert 0 < len(t.calls) < 15


def test_a_step_that_raises_is_kept_as_failed_and_nothing_stays_installed(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = os.fspath(tmp_path / "run.gtrace")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"), tracer.trace(steps="1", out=out):
        _loop(model, opt, 1)
        model(torch.randn(3, 5))
    t = tracer.load(out)
    assert t.header["step"] == 1 and t.status == "failed" and t.error["type"] == "RuntimeError"
    assert t.error["last_call"] == "linear0"


def test_nesting_is_refused_and_a_users_own_trace_wins_between_steps():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace() as _, pytest.raises(tracer.TraceError, match="do not nest"), tracer.trace(steps="1"):
        pass
    with tracer.trace(steps="1") as st:
        with pytest.raises(tracer.TraceError, match="already active"), tracer.trace(steps="2"):
            pass
        with tracer.trace() as mine, pytest.warns(RuntimeWarning, match="step 1 not traced"):
            _loop(model, opt, 1)  # step 0 ends inside the user's own trace: step 1 can't start
        _loop(model, opt, 1)
    assert st.steps == [] and st.skipped == [1]
    assert len(mine.calls) == 10


@pytest.mark.parametrize("spec, inside, outside", [
    ("100,200-202", [100, 200, 201, 202], [0, 99, 101, 199, 203]),
    ("5-", [5, 6, 1000], [0, 4]),
    (" 3 , 1 ", [1, 3], [0, 2]),
])
def test_step_specs(spec, inside, outside):
    sel = StepSelection.parse(spec)
    assert all(s in sel for s in inside) and not any(s in sel for s in outside)
    every = StepSelection.parse(every=500)
    assert [s for s in range(1501) if s in every] == [0, 500, 1000, 1500]
    assert str(StepSelection.parse("7,2-3", every=10)) == "2, 3, 7, every 10"


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": "1,x"}, "'x' is not a step number"),
    ({"steps": "5-2"}, "runs backwards"),
    ({"steps": ""}, "is not a step number"),
    ({"every": 0}, "every must be a positive"),
    ({"steps": [1, -1]}, "ints >= 0"),
    ({"steps": "1", "hash": "sha1"}, "hash must be"),
    ({"steps": "1", "per_step_files": True}, "needs out="),
    ({"steps": "1", "max_bytes": 0}, "max_bytes must be a positive"),
    ({"steps": "1", "foo": 1}, r"unknown option\(s\) for tracer.trace\(\): foo"),
    # the same checks, in one place, whether or not steps are chosen
    ({"max_calls": 0}, "max_calls must be a positive integer, got 0"),
    ({"max_calls": True}, "max_calls must be a positive integer, got True"),
    ({"max_bytes": -5}, "max_bytes must be a positive integer, got -5"),
    ({"flush_every": 0}, "flush_every must be a positive integer"),
    ({"stats": "yes"}, "stats must be True, False or None"),
    ({"hash": "sha1"}, "hash must be 'md5', 'fast' or 'none', got 'sha1'"),
    ({"per_step_files": True}, r"unknown option\(s\) for tracer.trace\(\): per_step_files \(only with steps= or every=\)"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(tracer.TraceError, match=message):
        tracer.trace(**kwargs)


def test_record_memory_refuses_steps():
    with pytest.raises(tracer.TraceError, match=r"unknown option\(s\) for tracer.trace\(\): steps"), \
            tracer.record_memory(steps="0"):
        pass


# ---- the multi-step file format ----------------------------------------------------------------
def _two_step_file(path: str) -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace(steps="0,2", out=path):
        _loop(model, opt, 3)


def test_multi_step_gzip_file_loads_each_step(tmp_path):
    path = os.fspath(tmp_path / "run.gtrace.gz")
    _two_step_file(path)
    with gzip.open(path, "rt") as fh:
        heads = [line for line in fh if line.startswith('{"t":"header"')]
    assert len(heads) == 2
    steps = load_steps(path)
    assert list(steps) == [0, 2] and all(t.status == "ok" for t in steps.values())
    assert tracer.load(path, step=2).header["step"] == 2
    with pytest.raises(tracer.TraceFormatError, match=r"no step 5 in this file \(steps: 0, 2\)"):
        tracer.load(path, step=5)


def test_multi_step_file_errors_and_truncation(tmp_path):
    path = os.fspath(tmp_path / "run.gtrace")
    _two_step_file(path)
    with open(path) as fh:
        lines = fh.read().splitlines(keepends=True)
    # cut inside the second step: the first loads clean, the second as truncated
    cut = tmp_path / "cut.gtrace"
    cut.write_text("".join(lines[:-3]))
    assert tracer.load(cut).status == "ok"
    with pytest.warns(tracer.TruncatedTraceWarning):
        assert load_steps(cut)[2].status == "truncated"
    # a header before the first trace's end record is corrupt, not a second step
    ends = [i for i, line in enumerate(lines) if line.startswith('{"t":"end"')]
    bad = tmp_path / "bad.gtrace"
    bad.write_text("".join(lines[: ends[0]] + lines[ends[0] + 1:]))
    with pytest.raises(tracer.TraceFormatError, match="a second header record"):
        tracer.load(bad)
    # a plain trace has no step numbers
    plain = tmp_path / "plain.gtrace"
    with tracer.trace() as t:
        MLP()(torch.randn(2, 8))
    t.save(os.fspath(plain))
    assert "steps_in_file" not in tracer.load(plain).meta
    with pytest.raises(tracer.TraceFormatError, match="has no step number"):
        load_steps(plain)
    with pytest.raises(tracer.TraceFormatError, match="it holds no step numbers"):
        tracer.load(plain, step=1)
