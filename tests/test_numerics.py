"""First NaN/Inf in forward and backward; backward errors explained, nested Functions included."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer
from export.diff import diff


class PaddedAttention(torch.autograd.Function):
    """Attention whose backward pollutes dQ rows of padded positions with NaN (the FlashAttention bug class)."""

    @staticmethod
    def forward(ctx, q, k, v, pad_mask):
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(pad_mask[:, None, :], float("-inf"))
        p = scores.softmax(-1)
        ctx.save_for_backward(q, k, v, p, pad_mask)
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, p, pad_mask = ctx.saved_tensors
        dv = p.transpose(-1, -2) @ g
        dp = g @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = ds @ k / q.shape[-1] ** 0.5
        dk = ds.transpose(-1, -2) @ q / q.shape[-1] ** 0.5
        dq = dq.masked_fill(pad_mask[:, :, None], float("nan"))  # the bug: padded rows get NaN
        return dq, dk, dv, None


class AttnModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x, pad_mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = PaddedAttention.apply(q, k, v, pad_mask)
        return self.out(h)


def test_nan_written_by_a_custom_backward_is_its_origin():
    model = AttnModel()
    x = torch.randn(2, 5, 8)
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    with pytest.warns(tracer.NumericsWarning, match=r"NaN made by masked_fill1 \(Tensor.masked_fill\) in backward"), \
            tracer.trace(hash="none", check_numerics=True) as t:
        line = sys._getframe().f_lineno + 1
        loss = model(x, pad).sum()
        loss.backward()
    report = t.anomalies
    # The -inf of the padding mask stays inside the Function's forward: not an anomaly.
    assert report.forward is None, "forward is clean"
    bwd = report.backward
    # The op inside the custom backward that wrote the NaN, on its own line inside backward().
    assert (bwd.producer, bwd.node, bwd.producer_kind) == (
        "masked_fill1", "PaddedAttention0/PaddedAttentionBackward", "Tensor.masked_fill")
    assert bwd.origin and bwd.nan > 0 and bwd.inf == 0 and not bwd.from_forward
    assert bwd.stack[-1].function == "PaddedAttention.backward"
    assert bwd.stack[-1].code.startswith("dq = dq.masked_fill(pad_mask[:, :, None], float(\"nan\"))")
    assert t["masked_fill1"].phase == "backward" and t["masked_fill1"].parent == bwd.node
    assert t["PaddedAttention0"].stack[-2].line == line  # the user's line that ran the model
    assert bwd.contaminated > 0 and "qkv" in bwd.contaminated_by_module
    assert "in the backward of PaddedAttention0/PaddedAttentionBackward" in str(report)


class Block(nn.Module):
    def __init__(self, index: int, poison: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.poison = poison

    def forward(self, x):
        h = self.fc(x)
        if self.poison:
            h = torch.log(h - 10)  # log of a negative number: NaN
        return torch.tanh(h) + x


def test_forward_nan_from_log_in_layer_3_is_the_origin():
    model = nn.Sequential(*[Block(i, poison=(i == 3)) for i in range(5)])
    with warnings.catch_warnings(record=True), tracer.check_numerics() as t:
        out = model(torch.randn(4, 8))
        out.sum().backward()
    fwd = t.anomalies.forward
    assert (fwd.tensor, fwd.producer, fwd.producer_kind, fwd.module) == ("log0:out", "log0", "torch.log", "3")
    assert fwd.origin and fwd.bad_inputs == [] and fwd.nan == 32
    assert fwd.stack[-1].code == "h = torch.log(h - 10)  # log of a negative number: NaN"
    # everything after it in forward is contaminated: tanh, add in layer 3, then layer 4
    assert fwd.contaminated_by_module == {"3": 2, "4.fc": 1, "4": 2, "": 1}  # ...and the sum at the root
    bwd = t.anomalies.backward
    assert bwd.producer == "tanh4/TanhBackward0" and bwd.from_forward  # a consequence, not a new fault


def test_a_clean_step_reports_clean_with_every_tensor_counted():
    """No NaN or Inf anywhere: the report is clean (found without walking the calls), and it
    counts the tensors with and without stats exactly."""
    model = nn.Sequential(*[Block(i, poison=False) for i in range(3)])
    with warnings.catch_warnings(record=True) as caught, tracer.check_numerics() as t:
        model(torch.randn(4, 8)).sum().backward()
        empty = torch.empty(3)  # recorded, never hashed: no stats
    report = t.anomalies
    assert report.clean and report.anomalies() == [] and report.intended_inf == 0
    with_stats = sum(1 for r in t.tensors.values() if r.stats is not None)
    assert (report.checked, report.unchecked) == (with_stats, len(t.tensors) - with_stats)
    uninitialised = [r for r in t.tensors.values() if r.uninitialized]
    assert [r.shape for r in uninitialised] == [tuple(empty.shape)] and uninitialised[0].stats is None
    assert report.unchecked >= 1
    assert not [w for w in caught if issubclass(w.category, tracer.NumericsWarning)]


def _grown_buffer_step(stale: float, numerics: bool) -> tracer.Trace:
    """What torch.ao's per-channel observers do: an empty buffer grown by ``resize_`` (its new
    elements uninitialised memory: here, deterministically, stale bytes of ``stale``), then
    overwritten whole before anything reads it."""
    buf = torch.full((64,), stale).resize_(0)
    with tracer.check_numerics() if numerics else tracer.trace(hash="md5") as t:
        buf.resize_(8, 8)
        buf.copy_(torch.arange(64.0).view(8, 8))
        (buf * 2).sum()
    return t


def test_what_a_resize_grows_is_uninitialised_not_a_nan_the_program_made():
    """Stale NaN bytes in what ``resize_`` grew are no NaN the program made (no read sees them),
    and two runs of the same program do not differ there: the grown value is recorded
    uninitialised, as ``torch.empty``'s output is; what the program writes next is checked."""

    t = _grown_buffer_step(float("nan"), numerics=True)
    grown = t.tensors[t["resize_0"].mutated[0]]
    assert grown.uninitialized and grown.stats is None and grown.md5 is None
    assert grown.hash_note == ("not hashed: resize_0 grew it from 0 to 64 elements, the new ones uninitialised "
                               "memory; its first write is a new version")
    assert t.anomalies.clean
    written = t.tensors[t["copy_0"].mutated[0]]
    assert written.previous == grown.name and written.stats is not None and not written.uninitialized
    a, b = _grown_buffer_step(float("nan"), numerics=False), _grown_buffer_step(7.0, numerics=False)
    assert diff(a, b).verdict().startswith("EQUAL")
    # A resize that does not grow keeps the value's bytes: checked as usual.
    with tracer.trace(hash="md5") as t:
        torch.arange(6.0).resize_(2, 3).sum()
    assert t.tensors[t["resize_0"].mutated[0]].md5 is not None


def test_a_partial_write_into_uninitialised_memory_leaves_the_rest_unhashed():
    """What FSDP2's all-gather copy-in does: ``torch.empty`` for every rank, this rank's slice
    written. The buffer's new version still holds leftover bytes: not hashed, so two identical
    runs do not differ there (they diverged before) and stale NaN bytes are no NaN the program
    made. A write of every element (a copy through views that cover it, ``out=``, a fill) is
    hashed as usual, the bytes' MD5."""
    pytest.importorskip("torch.distributed.fsdp")
    import hashlib

    def run(stale: float) -> tuple[tracer.Trace, torch.Tensor]:
        torch.full((144,), stale)  # (freed: its bytes are what the next empty() may hold)
        with tracer.check_numerics() as t:
            buf = torch.empty(144)
            inp, buf = torch.ops.fsdp.all_gather_copy_in([torch.arange(64.0), torch.arange(8.0)], buf, [64, 8], 72, 0)
            (inp * 2).sum()
            whole = torch.empty(6)
            torch._foreach_copy_([whole[:3], whole[3:]], [torch.ones(3), torch.full((3,), 2.0)])
            (whole * 1).sum()
        return t, whole

    a, whole = run(float("nan"))
    b, _ = run(7.0)
    partial = a.tensors["empty0:out@v1"]
    assert partial.uninitialized and partial.stats is None
    assert partial.hash_note == ("not hashed: it still holds uninitialised memory (all_gather_copy_in0 wrote part "
                                 "of it, or wrote it from what it held); its first whole write is a new version")
    assert a.tensors["all_gather_copy_in0:out0"].stats is not None  # (the slice it wrote: read as usual)
    assert a.anomalies.clean and diff(a, b, rtol=0.0, atol=0.0).verdict().startswith("EQUAL")
    covered = a.tensors["empty1:out@v1"]
    assert not covered.uninitialized and covered.stats is not None and covered.stats.max == 2.0
    with tracer.trace(hash="md5") as t:
        out = torch.empty(3)
        torch.add(torch.ones(3), 1, out=out)
        garbage = torch.empty(3)
        garbage.add_(1)  # (every element written, from what it held: still uninitialised)
        chunks = torch.empty(2, 3)  # (FSDP2's reduce-scatter input: out= a view that covers it whole)
        torch.cat([torch.ones(3), torch.zeros(3)], out=chunks.view(6))
    assert t.tensors["empty0:out@v1"].md5 == hashlib.md5(out.numpy().tobytes()).hexdigest()
    assert t.tensors["empty1:out@v1"].uninitialized and t.tensors["empty1:out@v1"].md5 is None
    assert t.tensors["empty2:out@v1"].md5 == hashlib.md5(chunks.numpy().tobytes()).hexdigest()
    assert whole.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]


class InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g / torch.zeros_like(g)  # +Inf, not NaN


def test_inf_returned_by_a_backward_is_caught_where_detect_anomaly_is_silent():
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.detect_anomaly(check_nan=True):
        InfGrad.apply(x).sum().backward()  # PyTorch checks NaN only: no error
    assert torch.isinf(x.grad).all()
    x.grad = None
    with pytest.warns(tracer.NumericsWarning), tracer.check_numerics() as t:
        InfGrad.apply(x).sum().backward()
    bwd = t.anomalies.backward
    assert (bwd.producer, bwd.node) == ("div0", "InfGrad0/InfGradBackward")  # the op in its backward()
    assert bwd.kind == "inf" and bwd.inf == 3 and bwd.nan == 0 and bwd.origin
    assert bwd.stack[-1].code == "return g / torch.zeros_like(g)  # +Inf, not NaN"


def test_raise_on_nonfinite_stops_at_the_first_one():
    x = torch.tensor([1.0, -1.0])
    with pytest.raises(tracer.NonFiniteError, match=r"^NaN made by sqrt0 \(torch.sqrt\) in forward") as info, \
            tracer.trace(raise_on_nonfinite=True) as t:
        y = torch.sqrt(x)
        y * 2  # never reached
    assert info.value.anomaly.producer == "sqrt0" and info.value.anomaly.origin
    assert [c.name for c in t.calls] == ["sqrt0"]
    assert t.status == "failed"


# ---- backward errors -----------------------------------------------------------------------------
class Innermost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        raise ValueError("innermost backward failed")


class Middle(torch.autograd.Function):
    """Builds a sub-graph with Innermost in forward; runs it with autograd.grad in backward."""

    @staticmethod
    def forward(ctx, x):
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            y = Innermost.apply(xd)
        ctx.xd, ctx.y = xd, y
        return y.detach()

    @staticmethod
    def backward(ctx, g):
        (gx,) = torch.autograd.grad(ctx.y, ctx.xd, g)
        return gx


class Outer(torch.autograd.Function):
    """The same pattern one level up, around Middle."""

    @staticmethod
    def forward(ctx, x):
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            y = Middle.apply(xd)
        ctx.xd, ctx.y = xd, y
        return y.detach()

    @staticmethod
    def backward(ctx, g):
        (gx,) = torch.autograd.grad(ctx.y, ctx.xd, g)
        return gx


def test_three_nested_functions_explained_level_by_level():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="innermost backward failed") as info, tracer.explain_errors() as t:
        y = Outer.apply(x)  # the user's line
        y.sum().backward()
    assert type(info.value) is ValueError
    (note,) = info.value.__notes__
    lines = note.splitlines()
    assert lines[0].startswith("gradtrace: backward0 (called at File") and "y.sum().backward()" in lines[0]
    assert lines[0].endswith("failed in grad node Innermost0/InnermostBackward [InnermostBackward].")
    heads = [ln for ln in lines if "Error in backward of" in ln]
    assert heads == [
        "Error in backward of Outer0/OuterBackward [OuterBackward], created by Outer0 (tests.test_numerics.Outer.apply) in module '<root>':",
        "    Error in backward of Middle0/MiddleBackward [MiddleBackward], created by Middle0 (tests.test_numerics.Middle.apply) in module '<root>':",
        "        Error in backward of Innermost0/InnermostBackward [InnermostBackward], created by Innermost0 (tests.test_numerics.Innermost.apply) in module '<root>':",
    ]
    i0, i1, i2 = (lines.index(h) for h in heads)
    assert lines[i0 + 2] == "        y = Outer.apply(x)  # the user's line"
    assert lines[i1 + 2] == "            y = Middle.apply(xd)"
    assert lines[i2 + 2] == "                y = Innermost.apply(xd)"
    assert lines[-1] == "            ValueError: innermost backward failed"
    assert t.backward_runs[0].status == "failed" and "Innermost0/InnermostBackward" in t.backward_runs[0].error


def test_plain_node_error_names_the_call_and_line():
    class BadShape(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sum()

        @staticmethod
        def backward(ctx, g):
            return torch.ones(7)  # wrong shape: PyTorch's engine rejects it

    model = nn.Linear(3, 3)
    with pytest.raises(RuntimeError, match="invalid gradient") as info, tracer.trace(hash="none") as t:
        h = model(torch.randn(2, 3))
        BadShape.apply(h).backward()
    note = info.value.__notes__[0]
    assert "failed in grad node BadShape0/BadShapeBackward [BadShapeBackward]" in note
    assert "        BadShape.apply(h).backward()" in note
    assert t.status == "failed"


def test_inplace_error_names_the_saving_and_the_modifying_call():
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info, tracer.explain_errors():
        y = torch.sigmoid(x)  # saves its output for backward
        z = y * 2
        y.add_(1)  # modifies it
        z.sum().backward()
        y.sum().backward()
    note = info.value.__notes__[0]
    assert "sigmoid0:out, saved for backward by sigmoid0 (torch.sigmoid), was modified in place by add_0" in note
    assert "failed in grad node sigmoid0/SigmoidBackward0" in note


def test_failing_builtin_node_is_found_among_several_ready_ones():
    # Built-in nodes get no pre-hook (one hook per node is cheaper), so the node that failed is
    # inferred from the graph: when sigmoid's backward fails, exp's is ready too; the engine
    # runs the higher sequence number first, and the note must name sigmoid's node, not exp's.
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info, \
            tracer.trace(hash="none", node_runs=True) as t:
        a = torch.exp(x)
        b = torch.sigmoid(x)  # saves its output
        c = torch.tanh(x)
        b.add_(1)
        (a.sum() + b.sum() + c.sum()).backward()
    note = info.value.__notes__[0]
    assert "failed in grad node sigmoid0/SigmoidBackward0 [SigmoidBackward0]" in note
    ran = t.backward_runs[0].order
    assert "tanh0/TanhBackward0" in ran and "exp0/ExpBackward0" not in ran
    assert "sigmoid0/SigmoidBackward0" not in ran


def test_f_linear_error_in_module_reports_module_path():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return F.relu(self.proj(x))

    net = Net()
    h = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError) as info, tracer.explain_errors():
        out = net(h)
        out.relu_()  # relu saved its result; modifying it in place breaks backward
        out.sum().backward()
    note = info.value.__notes__[0]
    assert "created by relu0 (torch.nn.functional.relu) in module '<root>'" in note
    assert "relu0:out, saved for backward by relu0" in note and "relu_0" in note


def test_summary_and_diff_show_the_first_nonfinite(capsys):
    from rich.console import Console

    from export.summary import render_summary

    def run(poison: bool) -> tracer.Trace:
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(i, poison=poison and i == 3) for i in range(5)])
        with warnings.catch_warnings(record=True), tracer.trace(check_numerics=True) as t:
            model(torch.randn(4, 8)).sum().backward()
        return t

    clean, bad = run(False), run(True)
    console = Console(width=200, force_terminal=False)
    render_summary(bad, console)
    out = capsys.readouterr().out
    assert "NaN made by log0 (torch.log) in forward, module 3 — test_numerics.py:" in out
    result = diff(clean, bad)
    result.render(console)
    out = capsys.readouterr().out
    assert "B: NaN made by log0 (torch.log) in forward, module 3" in out and "A: NaN" not in out
    assert result.to_json()["numerics"]["B"]["forward"]["producer"] == "log0"


def test_raise_on_nonfinite_in_backward_names_the_node():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(tracer.NonFiniteError, match=r"^Inf made by div0 \(Tensor.div\) in backward, in the backward "
                       r"of InfGrad0/InfGradBackward") as info, \
            tracer.trace(raise_on_nonfinite=True):
        InfGrad.apply(x).sum().backward()
    assert (info.value.anomaly.producer, info.value.anomaly.node) == ("div0", "InfGrad0/InfGradBackward")
    assert info.value.anomaly.stack[-1].code == "return g / torch.zeros_like(g)  # +Inf, not NaN"
    # One message: the error's own says where; no note repeats it.
    assert not getattr(info.value, "__notes__", None)


def _adamw_after_one_step() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 4)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt, x


def _nan_state_step(**options) -> tracer.Trace:
    model, opt, x = _adamw_after_one_step()
    opt.state[model[0].weight]["exp_avg_sq"][0, 0] = float("nan")  # a NaN in the state, from before the block
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracer.NumericsWarning)
        with tracer.check_numerics(**options) as t:
            model(x).pow(2).mean().backward()
            opt.step()
    return t


def test_check_numerics_leaves_the_optimizer_state_out_and_says_so():
    """A NaN in AdamW's state reaches the parameter the same step updates: found there, the
    anomaly says the state was not checked and how to check it."""
    t = _nan_state_step()
    assert t.header["optimizer_state"] is False and t.header["stats"] is True
    assert not any(n.startswith("0.weight.exp_avg") for n in t["AdamW0"].inputs)
    a = t.anomalies.optimizer
    assert t.anomalies.headline is a and t.anomalies.forward is None
    assert (a.tensor, a.producer, a.origin, a.nan, a.state_unchecked) == ("0.weight@v1", "AdamW0", True, 1, True)
    assert "the optimizer's state was not checked" in a.describe()
    assert "check_numerics(optimizer_state=True)" in a.describe()
    assert a.to_json()["state_unchecked"] is True
    from export.html.data import _anomaly
    assert _anomaly(a)["state_unchecked"] is True


def test_check_numerics_with_the_state_finds_the_nan_in_it():
    t = _nan_state_step(optimizer_state=True)
    assert t.header["optimizer_state"] is True
    a = t.anomalies.optimizer
    assert (a.producer, a.origin, a.bad_inputs, a.state_unchecked) == ("AdamW0", False, ["0.weight.exp_avg_sq"], False)
    assert "not checked" not in a.describe()


def test_a_nan_from_a_layer_says_nothing_of_the_state():
    model, opt, x = _adamw_after_one_step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracer.NumericsWarning)
        with tracer.check_numerics() as t:
            model(x).log().sum().backward()  # log of negative outputs: NaN in forward
            opt.step()
    a = t.anomalies.forward
    assert a.producer == "log0" and a.origin and not a.state_unchecked


def _scaled_step(init_scale: float) -> tuple[tracer.Trace, torch.amp.GradScaler, nn.Module, list[str]]:
    """One bf16-autocast step under a GradScaler, checked for NaN/Inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    x = torch.randn(32, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.check_numerics() as t:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean() * 1e4
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return t, scaler, model, [str(w.message) for w in caught if "gradtrace" in str(w.message)]


def test_a_grad_scaler_overflow_is_said_to_be_one_and_what_it_explains():
    """Dynamic loss scaling overflows by design: the scaled gradients go Inf/NaN, the scaler
    finds it, skips the optimizer step and halves the scale. The anomalies are still listed (a
    real NaN looks the same from inside one step), and the report says the scaler found them,
    skipped the step, and from what scale to what."""
    t, scaler, model, warned = _scaled_step(2.0 ** 127)
    report = t.anomalies
    assert scaler.get_scale() == 2.0 ** 126 and all(bool(p.isfinite().all()) for p in model.parameters())
    assert not report.clean and report.forward is not None
    [overflow] = report.scaler_overflows
    # The story: a skipped step, not a fault (the headline is the scaling of the loss, which read the scale).
    assert report.skipped_step is overflow and report.headline is report.forward
    assert report.forward.producer == "mul1" and report.forward.stack[-1].code == "scaler.scale(loss).backward()"
    assert overflow.check == "_amp_foreach_non_finite_check_and_unscale_0"
    assert overflow.update == "_amp_update_scale_0"
    assert (overflow.scale_before, overflow.scale_after) == (2.0 ** 127, 2.0 ** 126)
    text = str(report)
    assert text.startswith("GradScaler skipped the optimizer step: the scaled gradients overflowed, found at "
                           "_amp_foreach_non_finite_check_and_unscale_0 (loss scale 1.701e+38 -> 8.507e+37). Not a bug")
    assert report.headline_text() == overflow.headline()
    assert warned == []  # not a fault: no warning
    assert report.to_json()["scaler_overflows"] == [{"check": overflow.check, "update": overflow.update,
                                                      "scale_before": 2.0 ** 127, "scale_after": 2.0 ** 126}]
    assert "GradScaler" in report._repr_html_()
    # A step the scaler took: nothing found, nothing said.
    t, scaler, _, warned = _scaled_step(2.0 ** 8)
    assert t.anomalies.clean and t.anomalies.scaler_overflows == [] and warned == []
    assert scaler.get_scale() == 2.0 ** 8


@contextlib.contextmanager
def _checked_quietly(**options: Any) -> Iterator[tracer.Trace]:
    """A ``check_numerics`` trace without checksums whose ``NumericsWarning`` is not shown (the
    tests read the story from the trace)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracer.NumericsWarning)
        with tracer.trace(hash="none", check_numerics=True, **options) as t:
            yield t


def _steps_with_a_nan(steps: int, micro_batches: int, bad: tuple[int, int]) -> tracer.Trace:
    """``steps`` optimizer steps of ``micro_batches`` backward runs each, in one block; the
    forward of micro-batch ``bad`` = (step, micro-batch), both 1-based, takes the log of a
    negative."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # (lr 0: the NaN never reaches the weights)
    with _checked_quietly() as t:
        for step in range(1, steps + 1):
            for micro in range(1, micro_batches + 1):
                shift = -100.0 if (step, micro) == bad else 1.0
                loss = torch.log(model(torch.ones(2, 4)).pow(2).mean() + shift)
                loss.backward()
            opt.step()
            opt.zero_grad()
    return t


def test_two_optimizer_steps_in_one_block_are_steps_not_micro_batches() -> None:
    t = _steps_with_a_nan(steps=2, micro_batches=1, bad=(2, 1))
    first = t.anomalies.headline
    assert first is not None and first.phase == "forward" and first.producer == "log1"
    assert (first.step, first.steps) == (2, 2)
    assert first.micro_batch is None
    assert "forward (step 2 of 2), module <root>" in first.headline()
    assert "micro-batch" not in first.headline()
    assert first.to_json()["step"] == 2 and first.to_json()["steps"] == 2


def test_micro_batches_are_counted_within_their_optimizer_step() -> None:
    t = _steps_with_a_nan(steps=2, micro_batches=2, bad=(2, 2))
    first = t.anomalies.headline
    assert first is not None and first.producer == "log3"
    assert (first.step, first.steps, first.micro_batch, first.micro_batches) == (2, 2, 2, 2)
    assert "forward (step 2 of 2, micro-batch 2 of 2)" in first.headline()
    one_step = _steps_with_a_nan(steps=1, micro_batches=2, bad=(1, 2)).anomalies.headline
    assert one_step is not None and one_step.step is None and (one_step.micro_batch, one_step.micro_batches) == (2, 2)


class _NanBackward(torch.autograd.Function):
    """A custom backward with the model's bug: a NaN made from gradients of everyday size."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * float("nan")  # the line the story must name


def test_a_nan_the_model_makes_under_a_grad_scaler_is_the_model_s_not_a_skipped_step() -> None:
    """The scaler finds the NaN, skips the step and halves the scale, as for an overflow; but an
    overflow needs values near the dtype's range, and these gradients are ~2e4 in float32: the
    headline is the model's NaN, with a warning, and the skipped step is a note."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.check_numerics() as t:
            loss = _NanBackward.apply(model(torch.randn(4, 8))).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    report = t.anomalies
    assert scaler.get_scale() == 2.0 ** 15  # the scaler did skip the step
    [overflow] = report.scaler_overflows
    assert report.skipped_step is None
    h = report.headline
    assert h is not None and (h.phase, h.kind, h.producer, h.origin) == ("backward", "nan", "mul2", True)
    assert h.stack[-1].code == 'return g * float("nan")  # the line the story must name'
    assert report.headline_text() == h.headline() and report.headline_text().startswith(
        "NaN made by mul2 (Tensor.mul) in backward, in the backward of _NanBackward0/_NanBackwardBackward")
    assert overflow.describe() in report.describe().splitlines()  # the skipped step, as a note
    [warned] = [str(w.message) for w in caught if issubclass(w.category, tracer.NumericsWarning)]
    assert warned.startswith("gradtrace: NaN made by mul2 (Tensor.mul) in backward")


class _GradOfInner(torch.autograd.Function):
    """A custom backward that runs ``torch.autograd.grad`` over a graph its forward kept, and
    makes a NaN before (``spoil="before"``: passed in as the inner run's gradient) or after it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spoil: str) -> torch.Tensor:
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            y = xd.exp()
        ctx.save_for_backward(xd, y)
        ctx.spoil = spoil
        return y.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        xd, y = ctx.saved_tensors
        if ctx.spoil == "before":
            g = g * float("nan")  # spoiled before the inner run
        (grad,) = torch.autograd.grad(y, xd, g)
        if ctx.spoil == "after":
            grad = grad * float("nan")  # spoiled after it
        return grad, None


@pytest.mark.parametrize("spoil", ["before", "after"])
def test_a_nan_made_around_a_custom_backward_s_own_autograd_grad_is_found_where_it_was_made(spoil: str) -> None:
    """The run a custom backward starts is met where it ran among that backward's own calls, not
    before all of them: a NaN made before it is the origin, not the inner node it reached."""
    x = torch.randn(3, requires_grad=True)
    with _checked_quietly(raise_on_nonfinite=False) as t:
        _GradOfInner.apply(x, spoil).sum().backward()
    h = t.anomalies.headline
    assert h is not None and (h.phase, h.kind, h.origin) == ("backward", "nan", True)
    assert h.producer == "mul0"  # (the inner run's ExpBackward0 is a built-in node: no call of its own)
    assert h.node == "_GradOfInner0/_GradOfInnerBackward"
    assert h.stack[-1].code.startswith("g = g * float" if spoil == "before" else "grad = grad * float")
    assert t.anomalies.headline_text() == h.headline()


def _raised_where(steps: int, micro_batches: int, bad: tuple[int, int]) -> str:
    """Where ``raise_on_nonfinite`` says the NaN of _steps_with_a_nan's loop was met: it stops the
    block at the value, so it knows the step and micro-batch so far, not how many will come."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(tracer.NonFiniteError) as info, \
            tracer.trace(hash="none", check_numerics=True, raise_on_nonfinite=True):
        for step in range(1, steps + 1):
            for micro in range(1, micro_batches + 1):
                shift = -100.0 if (step, micro) == bad else 1.0
                torch.log(model(torch.ones(2, 4)).pow(2).mean() + shift).backward()
            opt.step()
            opt.zero_grad()
    return info.value.anomaly.where()


@pytest.mark.parametrize(("steps", "micro_batches", "bad", "raised", "reported"), [
    (4, 1, (3, 1), "forward (step 3)", "forward (step 3 of 4)"),
    (2, 2, (1, 2), "forward (micro-batch 2)", "forward (step 1 of 2, micro-batch 2 of 2)"),
    (2, 2, (2, 1), "forward (step 2, micro-batch 1)", "forward (step 2 of 2, micro-batch 1 of 2)"),
    (1, 1, (1, 1), "forward", "forward"),
])
def test_raise_on_nonfinite_counts_the_step_so_far_and_the_report_of_the_whole_block(
        steps: int, micro_batches: int, bad: tuple[int, int], raised: str, reported: str) -> None:
    assert _raised_where(steps, micro_batches, bad) == f"{raised}, module <root>"
    headline = _steps_with_a_nan(steps, micro_batches, bad).anomalies.headline
    assert headline is not None and headline.where() == f"{reported}, module <root>"


def test_a_nan_after_the_last_step_is_after_it_not_in_it() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with _checked_quietly() as t:
        for _ in range(2):
            model(torch.ones(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            torch.log(model(torch.ones(2, 4)).mean() - 100.0)  # an evaluation after step 2
    h = t.anomalies.headline
    assert h is not None and h.producer == "log0"
    assert (h.step, h.steps, h.after_step, h.micro_batch) == (2, 2, True, None)
    assert h.where() == "forward (after step 2 of 2), module <root>"
    assert h.to_json()["after_step"] is True


def test_a_nan_left_in_grad_from_before_the_block_arrived_there() -> None:
    """A ``.grad`` with a NaN from before the block (no ``zero_grad``): the accumulator adds the
    step's finite gradient into it. The NaN arrived, with the ``.grad`` there was; it is not the
    optimizer's, and the line is the backward that read it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model.weight.grad = torch.zeros_like(model.weight)
    model.weight.grad[0, 0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _checked_quietly() as t:
        model(torch.randn(3, 4)).pow(2).mean().backward()  # the line that reads it
        opt.step()
    h = t.anomalies.headline
    assert h is not None and (h.phase, h.producer, h.arrived, h.origin) == ("backward", "weight/AccumulateGrad",
                                                                           True, False)
    assert h.bad_inputs == ["weight@grad@v0"] and h.tensor == "weight@grad@v1"
    assert t.tensors["weight@grad@v0"].producer is None  # (the .grad as the block found it)
    assert h.stack[-1].code == "model(torch.randn(3, 4)).pow(2).mean().backward()  # the line that reads it"
    assert t.anomalies.headline_text().startswith(
        "NaN arrived from outside the step in weight@grad@v0, first read by weight/AccumulateGrad (AccumulateGrad) "
        "in backward")
    # A NaN the step's own gradient brings into a clean .grad is carried there, as before.
    model = nn.Linear(4, 2)  # (the step above wrote the NaN into the weight)
    with _checked_quietly() as t:
        (model(torch.randn(3, 4)) * float("nan")).sum().backward()
    h = t.anomalies.headline
    assert h is not None and h.phase == "forward" and h.producer == "mul0"


def test_accumulated_grads_are_checked_in_the_run_that_made_them() -> None:
    """Two steps of two micro-batches: each second micro-batch adds into the .grad the first
    made. The NaN enters the gradients in step 2's second micro-batch; the .grad version that
    run made holds it, and no earlier accumulator run may be said to have made it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with _checked_quietly() as t:
        for step in (1, 2):
            for micro in (1, 2):
                scale = float("nan") if (step, micro) == (2, 2) else 1.0
                (model(torch.ones(2, 4)) * scale).sum().backward()
            opt.step()
            opt.zero_grad()
    h = t.anomalies.headline
    assert h is not None and (h.phase, h.producer, h.origin) == ("forward", "mul3", True)
    assert (h.step, h.steps, h.micro_batch, h.micro_batches) == (2, 2, 2, 2)
    assert t.tensors["weight@grad#2@v1"].stats.nan and not t.tensors["weight@grad@v1"].stats.nan
