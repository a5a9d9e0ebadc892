"""The tracer under real-world conditions: failures, threads, grad modes, autocast, checkpointing."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import tracer
from tests.models import MLP


def test_exception_in_block_leaves_a_failed_readable_trace(tmp_trace):
    model = MLP()
    boom = ValueError("boom at step 3")
    with pytest.raises(ValueError) as info, tracer.trace(out=tmp_trace) as t:
        y = model(torch.randn(2, 8))
        y.sum().backward()
        raise boom
    assert info.value is boom  # the very same exception propagates
    assert t.status == "failed" and t.error == {"type": "ValueError", "message": "boom at step 3",
                                                "last_call": t.calls[-1].name}
    loaded = tracer.load(tmp_trace)
    assert loaded.status == "failed"
    assert [c.name for c in loaded.calls] == [c.name for c in t.calls]
    assert loaded.backward_runs[0].order == t.backward_runs[0].order


def test_failing_op_is_recorded_with_its_error():
    a, b = torch.randn(2, 3), torch.randn(4, 5)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"), tracer.trace() as t:
        torch.matmul(a, b)
    (call,) = t.calls
    assert call.name == "matmul0" and call.outputs == [] and call.error.startswith("RuntimeError: ")
    assert call.stack[-1].code == "torch.matmul(a, b)"


def test_nested_trace_is_refused_clearly():
    with tracer.trace() as outer:
        torch.ones(2) + 1
        with pytest.raises(tracer.TraceError, match="already active"), tracer.trace():
            pass
        torch.ones(2) * 3
    assert [c.name for c in outer.calls] == ["ones0", "add0", "ones1", "mul0"]


def test_other_threads_are_not_traced():
    model = MLP()
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            model(torch.randn(1, 8)).sum()

    th = threading.Thread(target=busy)
    th.start()
    try:
        with tracer.trace() as t:
            x = torch.randn(2, 8)
            y = torch.tanh(x)
            z = y * 2
    finally:
        stop.set()
        th.join()
    assert [c.name for c in t.calls] == ["randn0", "tanh0", "mul0"]
    assert not t.grad_nodes and not t.modules
    del z


def test_no_tensor_is_kept_alive_by_the_trace():
    model = MLP()
    refs = []
    with tracer.trace() as t:
        x = torch.randn(4, 8, requires_grad=True)
        h = model(x)
        loss = h.pow(2).mean()
        refs += [weakref.ref(h), weakref.ref(loss), weakref.ref(x)]
        loss.backward()
        refs.append(weakref.ref(x.grad))
    del x, h, loss
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    assert len(t.calls) > 5  # and the trace is still whole


def test_stack_points_at_the_users_line():
    w = torch.randn(3, 3)
    with tracer.trace() as t:
        line = sys._getframe().f_lineno + 1
        out = torch.matmul(w, w)  # the line the stack must end at
    frame = t["matmul0"].stack[-1]
    assert (frame.file, frame.line, frame.function) == (__file__, line, "test_stack_points_at_the_users_line")
    assert frame.code == "out = torch.matmul(w, w)  # the line the stack must end at"
    assert all("site-packages/torch" not in f.file and "/tracer/" not in f.file for f in t["matmul0"].stack)
    del out


def test_module_stack_line_is_inside_the_model():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return F.relu(self.fc(x))

    net = Net()
    with tracer.trace() as t:
        net(torch.randn(2, 4))
    assert t["linear0"].module == "fc" and t["relu0"].module == ""
    assert t["linear0"].stack[-1].code == "return F.relu(self.fc(x))"
    assert t["linear0"].stack[-1].function.endswith("Net.forward")


def test_no_grad_inference_mode_and_autocast():
    model = MLP()
    with tracer.trace() as t:
        with torch.no_grad():
            a = model(torch.randn(2, 8))
        with torch.inference_mode():
            b = model(torch.randn(2, 8)) + 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            c = model(torch.randn(2, 8))
        c.float().sum().backward()
    assert a.grad_fn is None and b.is_inference()
    no_grad_calls = [c for c in t.calls if c.name in ("linear0", "linear3")]
    assert all(not c.grad_nodes for c in no_grad_calls)
    bf16 = [t.tensors[c.outputs[0]] for c in t.calls if c.api == "torch.nn.functional.linear"][-3:]
    assert {r.dtype for r in bf16} == {"bfloat16"}
    # autocast's casts are grad nodes of the linear call that made them
    assert any(n.endswith("ToCopyBackward0") for n in t["linear6"].grad_nodes)
    assert t.backward_runs[0].status == "ok" and all(r.md5 for r in bf16)


def test_retain_graph_double_backward_and_autograd_grad():
    x = torch.randn(3, requires_grad=True)
    with tracer.trace() as t:
        y = (x * x).sum()
        y.backward(retain_graph=True)
        y.backward()
        (gx,) = torch.autograd.grad((x ** 3).sum(), x)
    b0, b1, g0 = t.backward_runs
    assert (b0.name, b1.name, g0.name) == ("backward0", "backward1", "grad0")
    assert b0.order == b1.order == ["sum0/SumBackward0", "mul0/MulBackward0", "input0/AccumulateGrad"]
    assert "input0@grad" in t.tensors and "input0@grad#1" in t.tensors
    assert g0.outputs == ["grad0:out"] and g0.api == "torch.autograd.grad"
    assert t.tensors["grad0:out"].md5 == tracer.md5_of(gx)
    assert torch.equal(x.grad, 4 * x.detach())


def test_autograd_grad_with_unused_inputs_names_each_gradient_by_its_inputs_position():
    a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
    with tracer.trace() as t:
        y = (a * 2 + c).sum()
        ga, gb, gc = torch.autograd.grad(y, [a, b, c], allow_unused=True)
        z = ga + gc
    assert gb is None
    (run,) = t.backward_runs
    assert run.outputs == ["grad0:out0", "grad0:out2"]  # b's is None: no name takes its place
    assert t["add1"].inputs == ["grad0:out0", "grad0:out2"]
    assert t.tensors["grad0:out0"].md5 == tracer.md5_of(ga)
    assert t.tensors["grad0:out2"].md5 == tracer.md5_of(gc)
    assert t.tensors["add1:out"].md5 == tracer.md5_of(z)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    model = MLP(depth=2)
    x = torch.randn(2, 8, requires_grad=True)
    with tracer.trace() as t:
        y = checkpoint.checkpoint(model, x, use_reentrant=reentrant)
        y.sum().backward()
    # Reentrant checkpointing recomputes the forward in its backward and runs a backward of its
    # own there: a second, nested backward run.
    assert t.status == "ok" and len(t.backward_runs) == (2 if reentrant else 1)
    assert x.grad is not None and model.layers[0].weight.grad is not None
    assert [c.name for c in t.calls if c.api == "torch.nn.functional.linear"][:2] == ["linear0", "linear1"]
    if reentrant:
        assert any(c.kind == "function" and c.api.endswith("CheckpointFunction.apply") for c in t.calls)


def test_compiled_submodule_is_one_opaque_call():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(4, 4)
            self.body = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), backend="aot_eager")

        def forward(self, x):
            return self.body(self.pre(x)).sum()

    net = Net()
    x = torch.randn(2, 4)
    net(x)  # compile outside the trace, as a warm training loop would have
    with tracer.trace() as t:
        loss = net(x)
        loss.backward()
    compiled = [c for c in t.calls if c.kind == "compiled"]
    assert len(compiled) == 1 and compiled[0].module == "body"
    assert compiled[0].inputs == ["linear0:out"] and compiled[0].outputs
    assert any("torch.compile" in n for n in t.notes)
    assert net.pre.weight.grad is not None
    assert t.backward_runs[0].status == "ok"


def test_views_and_in_place_changes_get_versions():
    x = torch.randn(4, 4, requires_grad=True)
    with tracer.trace() as t:
        y = x * 1
        row = y[0]
        row.mul_(2)
        y.add_(1)
        y.sum().backward()
    assert t["mul_0"].mutated == ["getitem0:out@v1"]
    # What it wrote through the view: the base's new version, made by it and among its outputs.
    assert t["mul_0"].outputs == ["getitem0:out@v1", "mul0:out@v1"]
    assert t.tensors["mul0:out@v1"].producer == "mul_0"
    assert t["add_0"].inputs[0] == "mul0:out@v1"  # the base changed through its view
    assert t["add_0"].outputs == ["mul0:out@v2"]
    assert t.tensors["mul0:out@v2"].previous == "mul0:out@v1"
    assert any(n.endswith("CopySlices") for n in t["mul_0"].grad_nodes)


def test_lookup_suggests_close_names():
    with tracer.trace() as t:
        torch.ones(3).exp()
    with pytest.raises(KeyError, match="did you mean exp0"):
        t["exp1"]


def test_max_calls_stops_recording_cleanly_and_says_so(tmp_trace):
    model = MLP(depth=4)
    with pytest.warns(RuntimeWarning, match="max_calls=5") as caught, tracer.trace(max_calls=5, out=tmp_trace) as t:
        loss = model(torch.randn(2, 8)).sum()
        loss.backward()
    # The warning points at the user's line that made the call past the bound, not at gradtrace.
    [w] = [w for w in caught if "max_calls=5" in str(w.message)]
    with open(w.filename, encoding="utf-8") as fh:
        line = fh.read().splitlines()[w.lineno - 1]
    assert (os.path.basename(w.filename), line.strip()) == ("models.py", "x = torch.tanh(layer(x))")
    assert len(t.calls) == 5 and not t.backward_runs
    assert any("max_calls=5" in n for n in t.notes)
    assert tracer.load(tmp_trace).notes[0].startswith("recording stopped at max_calls=5")
    assert model.layers[0].weight.grad is not None  # the program itself ran on unchanged


def test_listeners_see_calls_and_nodes():
    from tracer.record.listeners import Listener

    class Tap(Listener):
        def __init__(self) -> None:
            self.events: list[str] = []

        def on_call(self, trace, call, token, outputs):
            self.events.append(f"call {call.name} {[tuple(o.shape) for o in outputs]}")

        def on_node_begin(self, trace, node, step, grads):
            self.events.append(f"begin {node}")

        def on_node_end(self, trace, node, step, grads):
            self.events.append(f"end {node}")

    tap = Tap()
    x = torch.randn(3, requires_grad=True)
    with tracer.trace(listeners=[tap]):
        (x * 2).sum().backward()
    assert tap.events == ["call mul0 [(3,)]", "call sum0 [()]", "begin sum0/SumBackward0", "end sum0/SumBackward0",
                          "begin mul0/MulBackward0", "end mul0/MulBackward0", "begin input0/AccumulateGrad",
                          "end input0/AccumulateGrad"]


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_custom_function_stack_ends_at_the_apply_line():
    x = torch.randn(3, requires_grad=True)
    with tracer.trace() as t:
        line = sys._getframe().f_lineno + 1
        y = _Twice.apply(x)
    frame = t["_Twice0"].stack[-1]
    assert y.shape == (3,)
    assert (frame.line, frame.code) == (line, "y = _Twice.apply(x)")
    assert t["_Twice0/_TwiceBackward"].stack[-1] == frame


def test_shallow_stack_at_module_level(tmp_path):
    import subprocess

    code = ("import torch, tracer\nclass F(torch.autograd.Function):\n"
            "    @staticmethod\n    def forward(ctx, x): return x + 1\n"
            "    @staticmethod\n    def backward(ctx, g): return g\n"
            "with tracer.trace() as t: F.apply(torch.ones(2))\nprint(t['F0'].stack[-1].line)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7"


def test_identical_functions_in_two_files_keep_their_own_stacks(tmp_path):
    """Code objects compare equal by content, file name aside: stacks must still tell them apart."""
    import importlib.util

    mods = []
    for name in ("first_copy", "second_copy"):
        src = tmp_path / f"{name}.py"
        src.write_text("def run(x):\n    return x * 2\n")
        spec = importlib.util.spec_from_file_location(name, src)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append((mod, str(src)))
    assert mods[0][0].run.__code__ == mods[1][0].run.__code__  # the trap
    with tracer.trace() as t:
        for mod, _ in mods:
            mod.run(torch.ones(2))
    assert [c.stack[-1].file for c in t.calls if c.api == "Tensor.mul"] == [mods[0][1], mods[1][1]]


def test_gradient_changed_in_place_before_the_optimizer_gets_a_new_version():
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.trace() as t:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()  # names the gradient on the parameter: weight@grad
        with torch._C.DisableTorchFunction():  # an in-place change no traced call sees (a C++ hook)
            model.weight.grad.mul_(0.5)
        opt.step()
    versions = [r for r in t.tensors.values() if r.previous == "weight@grad"]
    assert [r.name for r in versions] == ["weight@grad@v1"]
    assert versions[0].md5 == tracer.md5_of(model.weight.grad)


def _evaluate_then_train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                         seen: dict[str, torch.Tensor]) -> None:
    """What Lightning does by default: the validation loop under torch.inference_mode, here
    first in the block (so gradtrace's first buffers are made inside it), then a training step."""
    with torch.inference_mode():
        val = model(x)  # the first tensor made in the block: an inference tensor
        big = val.repeat(1, 64)  # 2 MiB: fingerprinted on its own, not staged
        seen["val"], seen["big"] = val.clone(), big.clone()
    model(x.clone()).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("block", ["md5", "fast", "check_numerics"])
def test_inference_mode_evaluation_first_in_a_traced_training_block(block):
    """Tensors made under torch.inference_mode are recorded and checksummed like any other, also
    when they are the first a trace hashes (a buffer made then is an inference tensor, which
    refuses the in-place writes of a later pass outside that mode: hash="fast" failed so)."""
    import hashlib

    from tracer.record.checksums.fingerprint import fingerprint_reference

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters())
    with torch.inference_mode():
        x = torch.randn(64, 64)
    seen: dict[str, torch.Tensor] = {}
    block_cm = tracer.check_numerics() if block == "check_numerics" else tracer.trace(hash=block)
    with block_cm as t:
        _evaluate_then_train(model, opt, x, seen)
    assert t.status == "ok" and not t.notes
    val_name, big_name = t["linear1"].outputs[0], t["repeat0"].outputs[0]
    for name, value in ((val_name, seen["val"]), (big_name, seen["big"])):
        rec = t.tensors[name]
        data = value.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        if block == "md5":
            assert rec.md5 == hashlib.md5(data).hexdigest()
        elif block == "fast":
            assert rec.fingerprint == fingerprint_reference(data)
        flat = value.double().reshape(-1)
        assert rec.stats is not None and rec.stats.max == float(value.max()) and rec.stats.min == float(value.min())
        assert rec.stats.mean == pytest.approx(float(flat.mean()), rel=1e-6)
    # the training step after it is recorded in full, every value with its checksum and stats
    if block != "check_numerics":
        field = "md5" if block == "md5" else "fingerprint"
        assert {n: r.hash_note for n, r in t.tensors.items() if getattr(r, field) is None} == {}
    assert all(r.stats is not None for r in t.tensors.values())
    assert t.backward_runs[0].status == "ok"
    assert all(p.grad is not None for p in model.parameters())
    assert {"0.weight@v1", "2.bias@v1"} <= set(t.tensors)


def test_a_fault_of_the_checksums_at_the_end_keeps_the_rest_of_the_trace(monkeypatch, tmp_trace):
    """A failure inside gradtrace's own checksumming when the block ends is not the user's error:
    the trace is finished (calls, names, links, stacks, the streamed file), the records whose
    checksum could not be finished say so, and a note and a warning say what happened."""
    from tracer.record.checksums import host_batch

    def fail(self: object) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(host_batch.HostFingerprints, "flush", fail)
    model = MLP()
    with pytest.warns(RuntimeWarning, match="checksums and stats could not be finished.*injected fault"), \
            tracer.trace(hash="fast", out=tmp_trace) as t:
        model(torch.randn(16, 8)).sum().backward()  # the traced line
    assert t.status == "ok"
    unfinished = {n for n, r in t.tensors.items() if r.fingerprint is None}
    assert "layers.0.weight" in unfinished and "layers.0.weight@grad" in unfinished
    assert all(t.tensors[n].hash_note.startswith("checksum not finished: gradtrace failed at the end of the block "
                                                 "(RuntimeError: injected fault)") for n in unfinished)
    assert all(r.stats is not None for n, r in t.tensors.items() if n not in unfinished)
    assert len(t.notes) == 1 and f"{len(unfinished)} tensors have no checksum" in t.notes[0]
    assert t["linear0"].stack[-2].code == "model(torch.randn(16, 8)).sum().backward()  # the traced line"
    back = tracer.load(tmp_trace)
    assert [c.name for c in back.calls] == [c.name for c in t.calls]
    assert back.notes == t.notes
    assert {n: r.hash_note for n, r in back.tensors.items()} == {n: r.hash_note for n, r in t.tensors.items()}


_FORKING_BLOCKS = r'''
import os, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import tracer

def collate(batch):
    return torch.stack([x * 2.0 for x, _ in batch]), torch.stack([y for _, y in batch])

torch.manual_seed(0)
data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
out = sys.argv[1]
with tracer.trace(out=out, flush_every=1) as t:
    for epoch in range(2):  # a new iterator each epoch: its workers are forked inside the block
        for x, y in DataLoader(data, batch_size=8, num_workers=2, collate_fn=collate):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    pid = os.fork()
    if pid == 0:  # a child that goes on to the end of the block and exits through it
        model(torch.randn(3, 8)).sum()
        sys.exit(0)
    os.waitpid(pid, 0)
print(" ".join(c.name for c in t.calls))
'''


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("suffix", [".gtrace", ".gtrace.gz"])
def test_processes_forked_inside_a_streamed_block_record_nothing_and_leave_its_file_alone(tmp_path, suffix):
    """DataLoader workers forked inside a traced block (a new iterator each epoch) run the
    collate's torch ops, and a child forked with ``os.fork`` runs to the end of the block: none
    of it is recorded, and none of it reaches the block's file (the workers' records wrote into
    it before: "two calls named 'empty0'"; a child's gzip trailer would end the stream)."""
    import subprocess

    out = tmp_path / f"t{suffix}"
    proc = subprocess.run([sys.executable, "-c", _FORKING_BLOCKS, str(out)], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = proc.stdout.split()
    back = tracer.load(out)
    assert back.status == "ok" and [c.name for c in back.calls] == recorded
    assert not any(c.api == "torch.stack" for c in back.calls)  # the collate ran in the workers only
    assert sum(c.api == "torch.nn.functional.linear" for c in back.calls) == 8  # 2 epochs x 4 batches
    assert len(back.backward_runs) == 8


def test_a_program_that_wraps_tensor_backward_runs_its_wrapper_once():
    # torch's Tensor.backward hands its call to a torch-function mode through the class
    # attribute, i.e. through the program's wrapper again: a loss-scaling wrapper scaled twice.
    real = torch.Tensor.backward
    calls = []

    def scaled_backward(self, *args, **kwargs):
        calls.append(1)
        return real(self * 2, *args, **kwargs)

    model = torch.nn.Linear(4, 1)
    torch.Tensor.backward = scaled_backward
    try:
        model(torch.ones(1, 4)).sum().backward()
        want, calls[:] = model.bias.grad.clone(), []
        model.zero_grad()
        with tracer.trace(hash="md5") as t:
            model(torch.ones(1, 4)).sum().backward()
    finally:
        torch.Tensor.backward = real
    assert torch.equal(model.bias.grad, want) and want.item() == 2.0 and calls == [1]
    assert [(r.name, r.api) for r in t.backward_runs] == [("backward0", "Tensor.backward")]
