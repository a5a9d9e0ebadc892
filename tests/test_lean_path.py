"""The recorder's lean hot path (issue 44) records what the plain ways it replaces record.

Each shortcut is checked against the straightforward result on a real model: function
descriptions kept for the process, grad nodes that need no hook registered inline, the storage
identity read alone before the checks that make it an alias key.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import weakref
from typing import Any, ClassVar

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer
from tests.modes import CountingMode
from tracer.model import TensorRecord
from tracer.record import autograd as autograd_mod
from tracer.record import naming
from tracer.record import optimizer as optimizer_mod
from tracer.record.checksums.hasher import Hasher
from tracer.record.checksums.stats import cpu_stats
from tracer.record.mode import top_recording_mode
from tracer.record.tensors import get_seq, indexed_storage_key, storage_key


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.a(x)))
        return self.b(h.view(-1, 8)).softmax(dim=-1)


def _step(net: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=True)
    net(torch.ones(3, 4)).pow(2).sum().backward()
    opt.step()


def _facts(t: tracer.Trace) -> tuple[list[Any], ...]:
    calls = [(c.name, c.api, c.module, c.inputs, c.outputs, c.args, c.grad_nodes, c.parent, c.kind, c.phase,
              c.mutated, c.stack_id) for c in t.calls]
    nodes = [(n.name, n.kind, n.call, n.param, n.next, n.stack_id, n.seq, n.external, n.grads_in, n.grads_out)
             for n in t.grad_nodes]
    tensors = [(r.name, r.shape, r.stride, r.role, r.producer, r.previous, r.version, r.md5)
               for r in t.tensors.values()]
    return calls, nodes, tensors, [(b.name, [(s.node, s.grads_in, s.grads_out) for s in b.steps])
                                   for b in t.backward_runs]


# ---- function descriptions --------------------------------------------------------------------
def test_a_later_trace_describes_no_function_again_and_records_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(naming, "_DESCRIBED", {})  # (a fresh process's)
    described: list[object] = []
    real = naming._described

    def counting(func: object) -> naming.Described:
        described.append(func)
        return real(func)

    monkeypatch.setattr(naming, "_described", counting)
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    _step(net, opt)
    traces = []
    counts = []
    for _ in range(2):
        torch.manual_seed(1)
        with tracer.trace(hash="md5") as t:
            _step(net, opt)
        traces.append(t)
        counts.append(len(described))
    first = counts[0]
    assert first > 10  # the first trace met F.linear, gelu, layer_norm, view, softmax, pow...
    # Tensor.backward alone is described again (a program may swap its wrapper in between).
    assert {naming._describe(f)[0] for f in described[first:]} <= {"Tensor.backward"}
    one, two = (_facts(t) for t in traces)
    # The second step's records: the first's, but for the new versions of what the step changed.
    assert [c[1:3] + c[5:6] + c[8:10] for c in one[0]] == [c[1:3] + c[5:6] + c[8:10] for c in two[0]]
    assert any(c[1] == "torch.nn.functional.linear" for c in two[0])
    assert [c[5] for c in two[0] if c[1] == "Tensor.view"] == ["-1, 8"]
    assert [c[5] for c in two[0] if c[1] == "Tensor.softmax"] == ["dim=-1"]


def test_a_method_bound_to_a_tensor_is_described_but_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(naming, "_DESCRIBED", {})
    x = torch.ones(2)
    api = naming.ApiNames()
    assert api.describe(x.add)[:3] == ("Tensor.add", "add", "op")
    assert api.describe(torch.Tensor.add)[:3] == ("Tensor.add", "add", "op")
    assert list(api.cache) == [torch.Tensor.add]
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None  # the cache held no reference to it


# ---- grad nodes registered inline -------------------------------------------------------------
def test_nodes_registered_inline_are_the_ones_register_node_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    def record() -> tuple[tracer.Trace, set[str]]:
        torch.manual_seed(0)
        net = _Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        _step(net, opt)
        with tracer.trace(hash="none") as t:
            rec = tracer.record.recorder.active_recorder()
            assert rec is not None
            _step(net, opt)
            unhooked = set(rec.graph._unhooked)
        return t, unhooked

    inline, inline_unhooked = record()
    # Every node through Graph._register_node (no node class passes the inline test).
    monkeypatch.setattr(autograd_mod, "BackwardCFunction", object)
    general, general_unhooked = record()
    assert _facts(inline) == _facts(general)
    assert inline_unhooked == general_unhooked and "linear0/AddmmBackward0" in inline_unhooked
    assert len(inline.grad_nodes) > 10


# ---- storage keys -----------------------------------------------------------------------------
def _tensors() -> list[torch.Tensor]:
    p = nn.Parameter(torch.randn(4, 4))
    freed = torch.randn(3)
    freed.untyped_storage().resize_(0)
    return [p, p.data, p[1], p[0:0], torch.empty(0), torch.randn(()), freed, torch.empty(2, device="meta"),
            torch.randn(2, 3).t(), torch.randn(4).to_sparse()]


def test_the_indexed_storage_key_is_the_storage_key_when_indexed_else_zero() -> None:
    ts = _tensors()
    index = {storage_key(t): t for t in ts if storage_key(t)}
    assert len(index) >= 4
    for t in ts:
        key = storage_key(t)
        assert indexed_storage_key(t, index) == key
        assert indexed_storage_key(t, {}) == 0
        assert indexed_storage_key(t, {key + 1: None}) == 0


# ---- an optimizer step recorded as one call runs without the mode -------------------------------
class _Spy(torch.optim.AdamW):
    """AdamW that notes which recording mode is on top of the stack while its step runs."""

    seen: ClassVar[list[object]] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        _Spy.seen.append(top_recording_mode())
        return super().step(closure)


def _spy_steps() -> tracer.Trace:
    torch.manual_seed(0)
    net = _Net()
    opt = _Spy(net.parameters(), lr=0.1)
    _step(net, opt)
    with tracer.trace(hash="md5") as t:
        for _ in range(2):
            _step(net, opt)
        after = torch.ones(2) * 3  # recorded: the mode is back
    assert after is not None and t.calls[-1].api == "Tensor.mul"
    return t


def _step_cell(cls: type) -> object:
    step = cls.step  # type: ignore[attr-defined]
    return step.__closure__[step.__code__.co_freevars.index("func")].cell_contents


def test_an_optimizer_step_runs_without_the_mode_and_records_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    _Spy.seen = []
    off = _spy_steps()
    assert _Spy.seen == [None, None, None]  # (the step before the block had no mode either)
    assert sum(c.kind == "optimizer" for c in off.calls) == 2
    # The same step with its calls handed to the mode one by one.
    monkeypatch.setattr(optimizer_mod, "step_function_cell", lambda frame, step: None)
    _Spy.seen = []
    on = _spy_steps()
    assert [type(m).__name__ for m in _Spy.seen] == ["NoneType", "RecordingMode", "RecordingMode"]
    assert _facts(off) == _facts(on)


def test_the_step_function_is_put_back_after_a_step_and_after_one_that_raises() -> None:
    class Exploding(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def,override]
            with torch.no_grad():
                self.param_groups[0]["params"][0].add_(1.0)
            raise RuntimeError("boom in the optimizer")

    net = _Net()
    adam, bad = torch.optim.AdamW(net.parameters()), Exploding(net.parameters(), lr=0.1)
    real = (_step_cell(torch.optim.AdamW), _step_cell(Exploding))
    with tracer.trace() as t:
        _step(net, adam)
        with pytest.raises(RuntimeError, match="boom"):
            bad.step()
        top = top_recording_mode()
        after = torch.ones(2) * 3
    assert (_step_cell(torch.optim.AdamW), _step_cell(Exploding)) == real
    assert top is not None and after is not None
    assert "raised" in (t["Exploding0"].error or "") and t.calls[-1].inputs == ["ones1:out"]


def test_under_a_programs_mode_the_step_runs_as_before() -> None:
    torch.manual_seed(0)
    net = _Net()
    opt = _Spy(net.parameters(), lr=0.1)
    _Spy.seen = []
    with tracer.trace(hash="none") as t, CountingMode() as counting:
        opt.zero_grad()
        net(torch.ones(3, 4)).sum().backward()
        before = counting.calls
        opt.step()
    assert [type(m).__name__ for m in _Spy.seen] == ["NoneType"]  # (the program's mode is on top)
    assert counting.calls - before > 20  # AdamW's calls, seen by the program's mode all the same
    assert [c.kind for c in t.calls].count("optimizer") == 1


# ---- argument texts made once per distinct values ------------------------------------------------
def test_argument_texts_kept_for_the_process_are_the_texts_of_those_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(naming, "_ARGS_TEXT", {})
    x = torch.ones(2)
    cases: list[tuple[tuple[object, ...], dict[str, object]]] = [
        ((x, 1), {}), ((x, 1.0), {}), ((x, True), {}),  # equal as keys of a dict, not as texts
        ((x, 0.0), {}), ((x, -0.0), {}), ((x, float("nan")), {}), ((x, float("inf")), {}), ((x, -float("inf")), {}),
        ((x, (1, 2)), {}), ((x, (True, 2)), {}), ((x, [1, 2]), {}), ((x, (64,)), {}), ((x, ()), {}),
        ((x, "mean"), {}), ((x, "sum"), {}), ((x,), {"dim": -1}), ((x, -1), {}), ((x,), {"dim": -1, "keepdim": True}),
        ((x, torch.float32), {}), ((x, torch.float16), {}), ((x, torch.device("cpu")), {}),
        ((x, torch.device("cuda")), {}), ((x, torch.device("cuda", 0)), {}), ((x, None), {}), ((x, [x, x]), {}),
        ((x, 0.1, True, False), {}), ((x, x, x), {}), ((x,), {"weight": x}), ((x, 2 ** 70), {}), ((x, "a" * 200), {}),
    ]
    for _ in range(2):  # the second time from the kept texts
        for args, kwargs in cases:
            assert naming.short_args(args, kwargs) == naming._format_args(args, kwargs, 120), (args, kwargs)
    assert naming.short_args((x, 1), {}) == "1" and naming.short_args((x, True), {}) == "True"
    assert naming.short_args((x, 1.0), {}) == "1.0" and naming.short_args((x, -0.0), {}) == "-0.0"
    assert naming.short_args((x, (True, 2)), {}) == "(True, 2)" and naming.short_args((x, [1, 2]), {}) == "[1, 2]"
    assert naming.short_args((x, x), {}) == "" and len(naming._ARGS_TEXT) > 15


def test_long_argument_values_are_not_kept_for_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The texts are kept for the whole process: a megabyte string or a long list of ints given to
    a call would stay with them (as part of the key) after its trace is gone. Their texts are
    still the same, made each time."""
    monkeypatch.setattr(naming, "_ARGS_TEXT", {})
    x = torch.ones(2)
    long_text, many = "q" * 1_000_000, list(range(100_000))
    for args, kwargs in (((x, long_text), {}), ((x,), {"mode": long_text}), ((x, many), {}), ((x, tuple(many)), {})):
        assert naming.short_args(args, kwargs) == naming._format_args(args, kwargs, 120)
    assert naming.short_args((x, long_text), {}) == repr(long_text)[:39] + "…"
    assert naming._ARGS_TEXT == {}
    # short ones are kept as before
    assert naming.short_args((x, "q" * 256), {}) and naming.short_args((x, list(range(64))), {})
    assert len(naming._ARGS_TEXT) == 2


# ---- check_numerics' per-value host work ------------------------------------------------------------
def test_stats_of_a_value_that_requires_grad_make_no_grad_node_and_match_its_detached_alias() -> None:
    assert get_seq is not None
    w = torch.linspace(-2.0, 3.0, 48).reshape(6, 8).requires_grad_()
    y = (w * 3).t()  # requires grad, not contiguous: read through a detached reshape
    seq = get_seq()
    stats = [cpu_stats(w), cpu_stats(y)]
    assert get_seq() == seq  # no grad node was made by the reductions
    assert stats == [cpu_stats(w.detach()), cpu_stats(y.detach())]
    expected_mean = float(w.detach().double().sum()) / 48
    assert stats[0] is not None and (stats[0].min, stats[0].max, stats[0].absmax) == (-2.0, 3.0, 3.0)
    assert stats[0].mean == pytest.approx(expected_mean, rel=1e-12)
    i = torch.arange(-3, 5, dtype=torch.int64)  # an integer value: min and max as floats
    s = cpu_stats(i)
    assert s is not None and (type(s.min), s.min, s.max, s.mean) == (float, -3.0, 4.0, 0.5)


def test_the_hashers_work_is_its_own_inside_the_recorder_and_outside_it() -> None:
    """The hasher's entry points skip entering ``OWN_WORK`` where torch functions are off already
    (inside the recorder's bracket); called with them on, under a program's mode, the mode still
    sees none of their torch calls."""
    hasher = Hasher("md5", stats=True)
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    outside, inside = (TensorRecord("x", (3, 4), "float32", "cpu", "input") for _ in range(2))
    with CountingMode() as counting:
        hasher.submit(outside, x)
        with torch._C.DisableTorchFunction():
            hasher.submit(inside, x)
    hasher.drain(wait=True)
    assert counting.calls == 0
    assert outside.md5 == inside.md5 == hashlib.md5(x.numpy().tobytes()).hexdigest()
    assert outside.stats == inside.stats and outside.stats is not None and outside.stats.mean == 5.5


# ---- the backward's gradients -------------------------------------------------------------------
def test_a_gradient_passed_on_unchanged_is_recorded_as_dataclasses_replace_made_it() -> None:
    torch.manual_seed(0)
    net = _Net()
    with tracer.trace(hash="fast") as t:
        rec = tracer.record.recorder.active_recorder()
        assert rec is not None
        net(torch.ones(3, 4)).sum().backward()
        original = t.tensors["a.weight@grad"]
        original.values = b"kept"  # (every field is copied but those a copy has of its own)
        with rec.lock:
            copy = rec.names.add_copy(original, "a.weight@grad:copy", "b/AddBackward0")
    expected = dataclasses.replace(original, name="a.weight@grad:copy", role="grad", producer="b/AddBackward0",
                                   seq=copy.seq, md5=None, fingerprint=None, hash_note=None, stats=None,
                                   previous=None)
    expected.fingerprint, expected.stats = original.fingerprint, original.stats  # (filled in from it at the end)
    assert copy == expected and copy.values == b"kept" and copy.fingerprint is not None
    assert copy.seq > max(r.seq for r in t.tensors.values() if r is not copy)
