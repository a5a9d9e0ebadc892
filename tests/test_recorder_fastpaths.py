"""The recorder's fast paths give the same records as the plain ways they replace.

Each shortcut (stack scopes, the sweeping weak map, the one-callable node hook, positional
records, interned texts, cycle-free teardown) is checked against the straightforward result.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

import tracer
from tracer.model import Call, GradNode, TensorRecord
from tracer.record import autograd as autograd_mod
from tracer.record import naming
from tracer.record import recorder as recorder_mod
from tracer.record.identity import identity
from tracer.record.stacks import StackTable
from tracer.record.weakmap import IdWeakMap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inner(x)) * 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) + x
        return self.head(x)


def _record_net() -> tracer.Trace:
    torch.manual_seed(0)
    net = _Net()
    with tracer.trace(hash="none") as t:
        net(torch.randn(3, 4)).sum().backward()
    return t


def _stacks_by_call(t: tracer.Trace) -> dict[str, list[tuple[str, int, str]]]:
    return {c.name: [(f.file, f.line, f.function) for f in c.stack] for c in t.calls}


# ---- stack capture ----------------------------------------------------------------------------
def test_stack_scopes_give_the_same_stacks_as_a_full_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    traces = []
    for walk_all in (False, True):
        if walk_all:  # every capture walks the whole stack
            monkeypatch.setattr(StackTable, "open_scope", lambda self, frame: None)
        traces.append(_record_net())  # the same line both times: equal stacks expected
    scoped, walked = traces
    assert _stacks_by_call(scoped) == _stacks_by_call(walked)
    # The saved tables too: frame ids are handed out in the order a full walk meets the frames
    # (the first call here is two modules deep, below the scopes opened on the way in).
    assert scoped.frames == walked.frames and scoped.stacks == walked.stacks
    assert [c.stack_id for c in scoped.calls] == [c.stack_id for c in walked.calls]
    assert [n.stack for n in scoped.grad_nodes] == [n.stack for n in walked.grad_nodes]
    # and the stacks are the user's: the innermost frame is the block's forward for its calls
    relu = next(c for c in scoped.calls if c.api == "torch.relu")
    assert relu.stack[-1].function == "_Block.forward" and "torch.relu" in relu.stack[-1].code
    assert any(f.function == "_Net.forward" for f in relu.stack)


def test_no_frame_is_held_after_the_trace_even_when_a_module_raises() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    outer = nn.Sequential(nn.Linear(2, 2), Boom())
    with pytest.raises(ValueError), tracer.trace(hash="none") as t:
        rec = recorder_mod.active_recorder()
        assert rec is not None and rec.stack_table is not None
        outer(torch.randn(1, 2))
    assert t.status == "failed"
    assert rec.stack_table._scopes == {} and rec.scopes._scope_frames == [] and rec.scopes._stack == []


def _gen() -> Iterator[object]:
    yield sys._getframe()


def test_a_generator_frame_is_never_a_scope() -> None:
    table = StackTable()
    gen = _gen()
    frame = next(gen)
    table.open_scope(frame)  # type: ignore[arg-type]
    assert table._scopes == {}
    table.open_scope(sys._getframe())
    assert list(table._scopes) == [sys._getframe()]
    table.close_scope(sys._getframe())
    assert table._scopes == {}


# ---- the weak identity map --------------------------------------------------------------------
class _Obj:
    pass


def test_weak_map_sweeps_dead_entries_and_never_returns_a_stale_value() -> None:
    m: IdWeakMap[int] = IdWeakMap()
    keep = [_Obj() for _ in range(10)]
    for i, o in enumerate(keep):
        m[o] = i
    for i in range(5000):  # short-lived keys: swept in bulk, not one callback each
        m[_Obj()] = i
    assert len(m._d) < 2100
    assert len(m) == 10 and [m.get(o) for o in keep] == list(range(10))
    # An entry whose object died answers nothing, also for a new object under the same key.
    dead = _Obj()
    m[dead] = 99
    entry = m._d[identity(dead)]
    del dead
    other = _Obj()
    m._d[identity(other)] = entry
    assert m.get(other) is None and other not in m
    m.clear()
    assert len(m) == 0


def test_weak_map_holds_no_reference_to_its_keys() -> None:
    m: IdWeakMap[str] = IdWeakMap()
    t = torch.ones(3)
    ref = weakref.ref(t)
    m[t] = "x"
    del t
    assert ref() is None


# ---- teardown without reference cycles --------------------------------------------------------
def _record_step(m: nn.Module, opt: torch.optim.Optimizer, out: str | None) -> None:
    with tracer.trace(hash="none", out=out) as t:
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert len(t.calls) > 3 and len(t.grad_nodes) > 3


def test_a_finished_trace_is_freed_without_the_cycle_collector(tmp_trace: str) -> None:
    # Made outside the recorded function: building an optimizer leaves garbage cycles of its own
    # that hold its caller's frame (and so that frame's locals).
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _record_step(m, opt, None)  # the optimizer's first step creates its state
    ours = (TensorRecord, Call, GradNode, tracer.Trace, recorder_mod.Recorder, IdWeakMap)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for out in (None, tmp_trace):
            _record_step(m, opt, out)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            leaked = [type(o).__name__ for o in gc.garbage if isinstance(o, ours)]
            gc.set_debug(0)
            gc.garbage.clear()
            assert leaked == [], f"freed only by the cycle collector (out={out}): {sorted(set(leaked))}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


def test_the_mode_lets_calls_through_once_its_recorder_is_gone() -> None:
    with tracer.trace(hash="none"):
        rec = recorder_mod.active_recorder()
        assert rec is not None
        mode = rec.mode
    assert mode.recorder is None and rec.on_records is None
    x = torch.ones(2)
    assert mode.__torch_function__(torch.add, (torch.Tensor,), (x, x)).tolist() == [2.0, 2.0]


# ---- names and records ------------------------------------------------------------------------
def test_foreach_in_place_op_names_each_tensor_once() -> None:
    ts = [torch.zeros(2) for _ in range(40)]
    others = [torch.ones(2) for _ in range(40)]
    with tracer.trace(hash="none", stacks=False) as t:
        torch._foreach_add_(ts, others)
        torch._foreach_mul_(ts, 2.0)
    add, mul = t.calls
    assert add.inputs[:2] == ["input0", "input1"] and len(add.inputs) == 80
    assert add.mutated == [f"input{i}@v1" for i in range(40)]
    assert mul.inputs == add.mutated and mul.mutated == [f"input{i}@v2" for i in range(40)]
    # An in-place foreach op returns the tensors it changed (or nothing): either way each new
    # version is recorded once, as its output and as a change.
    assert add.outputs in ([], add.mutated) and mul.outputs in ([], mul.mutated)
    assert t.tensors["input7@v2"].previous == "input7@v1" and t.tensors["input7@v2"].producer == mul.name
    assert len(t.tensors) == 80 + 40 + 40


def test_an_input_returned_unchanged_keeps_its_name_and_outputs_are_new_records() -> None:
    x = torch.randn(2, 3)
    with tracer.trace(hash="none", stacks=False) as t:
        y = x.to(torch.float32)  # returns x itself
        z = y.contiguous()  # likewise
        w = z.transpose(0, 1)
        w.contiguous()
    to, contiguous, transpose, contiguous1 = t.calls
    assert to.outputs == ["input0"] and contiguous.outputs == ["input0"]
    assert transpose.outputs == ["transpose0:out"] and contiguous1.outputs == ["contiguous1:out"]
    rec = t.tensors["transpose0:out"]
    assert (rec.shape, rec.stride, rec.contiguous, rec.dtype, rec.device) == ((3, 2), (1, 3), False, "float32", "cpu")
    assert t.tensors["contiguous1:out"].stride == (2, 1)


def test_records_are_built_in_the_field_order_the_recorder_assumes() -> None:
    # The hot path constructs these positionally; a reordered data model must fail here.
    assert [f.name for f in dataclasses.fields(TensorRecord)] == [
        "name", "shape", "dtype", "device", "role", "producer", "stride", "contiguous", "requires_grad",
        "version", "seq", "md5", "fingerprint", "hash_note", "stats", "previous", "uninitialized", "sharding",
        "values"]  # (every field: TensorNames.add_copy copies the last three positionally)
    assert [f.name for f in dataclasses.fields(Call)][:13] == [
        "name", "api", "module", "inputs", "outputs", "args", "grad_nodes", "stack_id", "parent", "kind",
        "phase", "seq", "mutated"]
    assert [f.name for f in dataclasses.fields(GradNode)][:8] == [
        "name", "kind", "call", "param", "next", "stack_id", "seq", "external"]


def test_equal_argument_texts_are_one_string() -> None:
    x = torch.randn(3)
    with tracer.trace(hash="none", stacks=False) as t:
        x.add(1.5).add(1.5)
        x.sum(dim=0, keepdim=True)
    a, b, s = t.calls
    assert a.args == b.args == "1.5" and a.args is b.args
    assert s.args == "dim=0, keepdim=True"
    assert naming.short_args((x, 2, [x, x]), {"alpha": 0.5}) == "2, alpha=0.5"
    assert naming.short_args((x,), {}) == ""


def test_counters_put_an_underscore_after_a_trailing_digit() -> None:
    c = naming.Counters()
    assert [c.next("log10"), c.next("add"), c.next("log10"), c.next("add"), c.next("conv2d")] == \
        ["log10_0", "add0", "log10_1", "add1", "conv2d0"]


def test_records_made_at_one_line_share_their_stack() -> None:
    t = _record_net()
    by_stack: dict[int | None, list[Call]] = {}
    for c in t.calls:
        by_stack.setdefault(c.stack_id, []).append(c)
    shared = [cs for cs in by_stack.values() if len(cs) > 1]
    assert shared, "the two blocks run the same lines"
    for cs in shared:
        assert all(c.stack is cs[0].stack for c in cs)
    relu = next(c for c in t.calls if c.api == "torch.relu")
    node = t[relu.grad_nodes[0]]
    assert isinstance(node, GradNode) and node.stack == relu.stack


# ---- the node hook ----------------------------------------------------------------------------
class _Seen:
    closed = False

    def __init__(self) -> None:
        self.owner = threading.get_ident()  # the hooks record only for the tracing thread
        self.events: list[tuple[str, str, tuple[object, ...]]] = []
        self.received: list[tuple[object, ...]] = []  # the hook's grad_outputs (an accumulator's own need them)
        self.graph = self  # the recorder's part that hears node events (tracer.record.autograd.Graph)

    def node_begin(self, name: str, grads: tuple[object, ...]) -> None:
        self.events.append(("begin", name, grads))

    def node_end(self, name: str, grads: tuple[object, ...], grad_outputs: tuple[object, ...]) -> None:
        self.events.append(("end", name, grads))
        self.received.append(grad_outputs)


def test_one_callable_tells_the_pre_hook_from_the_hook() -> None:
    seen = _Seen()
    ref = weakref.ref(seen)
    g = torch.ones(1)
    autograd_mod.node_hook(ref, "n", (g,))  # type: ignore[arg-type]
    autograd_mod.node_hook(ref, "n", (None,), ())  # type: ignore[arg-type]  # a hook with empty grad_outputs
    autograd_mod.node_hook(ref, "n", (), (g,))  # type: ignore[arg-type]
    assert [(e, n, len(gs)) for e, n, gs in seen.events] == [("begin", "n", 1), ("end", "n", 1), ("end", "n", 0)]
    assert seen.received == [(), (g,)]
    seen.closed = True
    autograd_mod.node_hook(ref, "n", (g,))  # type: ignore[arg-type]
    assert len(seen.events) == 3


def test_backward_steps_pair_each_nodes_gradients() -> None:
    x = torch.randn(3, requires_grad=True)
    with tracer.trace(hash="none", stacks=False, node_runs=True) as t:
        y = (x * 2).sum()
        y.backward()
    (run,) = t.backward_runs
    assert run.order == ["sum0/SumBackward0", "mul0/MulBackward0", "input0/AccumulateGrad"]
    steps = {s.node: (s.grads_in, s.grads_out) for s in run.steps}
    assert steps["sum0/SumBackward0"] == (["sum0:out@grad"], ["mul0:out@grad"])
    assert steps["mul0/MulBackward0"] == (["mul0:out@grad"], ["input0@grad", None])
    assert steps["input0/AccumulateGrad"] == (["input0@grad"], [])


def test_a_stand_in_hasher_is_called_even_when_nothing_is_hashed() -> None:
    x = torch.randn(3)
    with tracer.trace(hash="none", stacks=False) as t:
        rec = recorder_mod.active_recorder()
        assert rec is not None and not rec.hasher.active
        x.add(1)
        with rec.unhashed("not hashed: async collective, result not ready when issued"):
            x.mul(2)
    assert t.tensors["add0:out"].hash_note is None
    assert t.tensors["mul0:out"].hash_note == "not hashed: async collective, result not ready when issued"


def test_identity_keys_are_unique_among_live_objects_and_raise_no_audit_event() -> None:
    """The recorder's identity keys (tracer.record.identity) tell live objects apart as id() does, also
    for tensors, whose class defines __hash__. And they raise no audit event: a library's audit
    hook (filelock 4 installs one on Python 3.12+) would otherwise run on every look-up. The
    hook goes in a subprocess, since an audit hook cannot be removed."""
    objs = [torch.ones(1) for _ in range(1000)] + [object() for _ in range(1000)] + [sys._getframe()]
    assert len({identity(o) for o in objs}) == len(objs)
    assert identity(objs[0]) == identity(objs[0])
    script = textwrap.dedent("""
        import sys, torch
        from tracer.record.identity import identity
        from tracer.record.weakmap import IdWeakMap
        seen = []
        sys.addaudithook(lambda event, args: event == "builtins.id" and seen.append(event))
        t, m = torch.ones(1), IdWeakMap()
        m[t] = 1
        assert m.get(t) == 1 and identity(t) == identity(t)
        before = len(seen)
        id(t)
        print(before, len(seen))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["0", "1"]  # none from the map; the hook does see a plain id()


@pytest.mark.parametrize("value", [(1, 1), (0, -3), [2, 2, 2], (1, 2, 3, 4, 5, 6, 7, 8), (10**20, -1), [7, 8]])
def test_int_sequences_format_as_every_other_sequence(value: tuple[int, ...] | list[int]) -> None:
    """A tuple or list of ints (a conv's stride, padding) is formatted by ``repr``: the text of
    the general path, element by element, bracketed as the sequence is."""
    x = torch.zeros(1)
    body = ", ".join(repr(v) for v in value)
    expected = f"({body})" if isinstance(value, tuple) else f"[{body}]"
    assert naming.short_args((x, value), {}) == expected
    assert naming.short_args((x,), {"stride": value}) == f"stride={expected}"
    # Not taken: one element, more than eight, a bool among ints (each keeps its own format).
    assert naming.short_args((x, (5,)), {}) == "(5)"
    assert naming.short_args((x, tuple(range(9))), {}) == "(0, 1, 2, 3, 4, 5, 6, 7, …)"
    assert naming.short_args((x, (1, True)), {}) == "(1, True)"
    # Nested: a sequence inside a sequence as the general path has it, three levels down "…".
    assert naming.short_args((x, [value]), {}) == f"[{expected}]"
    assert naming.short_args((x, [[value]]), {}) == "[[…]]"
