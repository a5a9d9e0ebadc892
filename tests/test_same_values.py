"""Outputs that read exactly as one of their call's inputs (a reshaping view of a contiguous
tensor, a detached alias) copy that input's checksum and stats instead of computing them again;
every other output, and every input the call wrote, is computed from its own bytes."""

from __future__ import annotations

import hashlib

import pytest
import torch

import tracer
from tests.conftest import requires_cuda
from tracer.model import TensorRecord
from tracer.record.checksums import fingerprint as fp
from tracer.record.checksums.bytes import as_bytes, host_bytes
from tracer.record.checksums.hasher import Hasher
from tracer.record.checksums.stats import cpu_stats
from tracer.record.tensors import same_multiset, same_values


def _bytes(t: torch.Tensor) -> bytes:
    b = as_bytes(t)
    return bytes(host_bytes(b))


def test_same_values_only_for_the_same_bytes_read_the_same_way():
    x = torch.randn(4, 6)
    assert same_values(x, x.view(-1)) and same_values(x, x.reshape(2, 12)) and same_values(x, x.unsqueeze(0))
    assert same_values(x, x.detach()) and same_values(x, x[:])
    assert not same_values(x, x.t())  # the same bytes, another order
    assert not same_values(x, x[:2])  # part of them
    assert not same_values(x, x.view(torch.int32))  # another dtype
    assert not same_values(x, x.clone())  # other bytes
    z = torch.randn(5, dtype=torch.complex64)
    assert not same_values(z, z.conj())  # the same bytes, conjugated when read
    assert not same_values(torch.randn(3).to_sparse(), torch.randn(3).to_sparse())


@pytest.mark.parametrize("algorithm", ["md5", "fast", "none"])
def test_views_of_a_contiguous_input_get_its_checksum_and_stats(algorithm):
    g = torch.Generator().manual_seed(0)
    with tracer.trace(hash=algorithm, stats=True) as t:
        x = torch.randn(64, 96, generator=g) * 3  # 24 KiB: the MD5 of a large one goes to the pool
        big = torch.randn(512, 256, generator=g) + 1  # 512 KiB
        a = x.view(-1)
        b = a.view(96, 64)  # a view of a view
        c = big.reshape(256, 512).unsqueeze(0)
        d = x.detach()
        e = x.t()  # another order: its own checksum
        f = x[1:]  # part of the bytes
    recs = {n: t.tensors[n] for n in ("mul0:out", "add0:out", "view0:out", "view1:out", "reshape0:out",
                                      "unsqueeze0:out", "detach0:out", "t0:out", "getitem0:out")}
    for name, value in (("mul0:out", x), ("view0:out", a), ("view1:out", b), ("detach0:out", d),
                        ("add0:out", big), ("reshape0:out", big), ("unsqueeze0:out", c),
                        ("t0:out", e), ("getitem0:out", f)):
        rec = recs[name]
        data = _bytes(value)
        if algorithm == "md5":
            assert rec.md5 == hashlib.md5(data).hexdigest(), name
        elif algorithm == "fast":
            assert rec.fingerprint == fp.fingerprint_reference(data), name
        else:
            assert rec.md5 is None and rec.fingerprint is None
        assert rec.stats is not None
        want = cpu_stats(value)
        assert (rec.stats.min, rec.stats.max, rec.stats.absmax, rec.stats.nan, rec.stats.inf) == \
            (want.min, want.max, want.absmax, want.nan, want.inf), name
        assert rec.stats.mean == pytest.approx(want.mean, rel=1e-12), name
    # The copies are the very same objects as their inputs' (one Stats per value).
    assert recs["view0:out"].stats is recs["mul0:out"].stats and recs["view1:out"].stats is recs["mul0:out"].stats
    assert recs["unsqueeze0:out"].stats is recs["add0:out"].stats
    assert recs["detach0:out"].stats is recs["mul0:out"].stats
    assert recs["getitem0:out"].stats is not recs["mul0:out"].stats
    # A transpose holds the same values in another order: with stats alone it shares them too.
    assert (recs["t0:out"].stats is recs["mul0:out"].stats) == (algorithm == "none")


def test_a_view_made_after_an_in_place_write_reads_the_new_version():
    with tracer.trace(hash="md5") as t:
        x = torch.zeros(8, 8)
        before = x.view(-1)
        x.add_(1)
        after = x.view(64)
    assert t.tensors["view0:out"].md5 == hashlib.md5(bytes(32 * 8)).hexdigest()  # zeros: before the write
    assert t.tensors["view1:out"].md5 == hashlib.md5(_bytes(torch.ones(64))).hexdigest()
    assert t.tensors["view1:out"].stats.min == 1.0 and t.tensors["view0:out"].stats.max == 0.0
    assert before is not after


def test_a_copy_of_a_waiting_copy_waits_with_it(monkeypatch):
    """A view of a view, drained while the first value's checksum is still being computed: both
    copies wait for it, neither is filled with the nothing its middle link holds yet."""
    h = Hasher("md5", stats=False)
    x = torch.randn(100_000)  # 400 KB: hashed on the worker pool
    originals = [TensorRecord(name=n, shape=(), dtype="", device="cpu", role="output", producer=None)
                 for n in ("x", "v1", "v2")]
    rx, r1, r2 = originals
    h.submit(rx, x)
    h.same_as(r1, rx)
    h.same_as(r2, r1)
    monkeypatch.setattr(h, "_pending_originals", lambda: {id(rx)})  # as if the job were still running
    h.drain(wait=False)
    assert r1.md5 is None and r2.md5 is None
    assert h.pending() >= {id(r1), id(r2)}
    monkeypatch.undo()
    h.close()
    want = hashlib.md5(_bytes(x)).hexdigest()
    assert rx.md5 == r1.md5 == r2.md5 == want


def test_kept_values_still_see_every_view(tmp_path):
    """With keep_values a stand-in hasher sees each tensor: views are handed to it as before."""
    with tracer.trace(hash="md5", keep_values="view*") as t:
        x = torch.arange(12, dtype=torch.float32)
        x.view(3, 4)
    rec = t.tensors["view0:out"]
    assert rec.md5 == hashlib.md5(_bytes(torch.arange(12, dtype=torch.float32))).hexdigest()
    assert rec.values == _bytes(torch.arange(12, dtype=torch.float32))


def test_a_gradient_reshaped_by_a_view_node_copies_the_gradient_it_received():
    """``ViewBackward0`` hands back its incoming gradient reshaped: the same bytes, the same
    values. Its checksum and stats are the received gradient's; a transposing node's are its own."""
    x = torch.randn(6, 4, requires_grad=True)
    y = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(24)
    with tracer.trace(hash="md5") as t:
        ((x.view(-1) * w).sum() + (y.t() * w.view(6, 4)).sum()).backward()
    steps = {s.node: s for run in t.backward_runs for s in run.steps}
    view_step = steps["view0/ViewBackward0"]
    received, made = t.tensors[view_step.grads_in[0]], t.tensors[view_step.grads_out[0]]
    assert made.md5 == received.md5 == hashlib.md5(_bytes(x.grad)).hexdigest()
    assert made.stats is received.stats
    t_step = steps["t0/TBackward0"]
    received, made = t.tensors[t_step.grads_in[0]], t.tensors[t_step.grads_out[0]]
    assert made.md5 == hashlib.md5(_bytes(y.grad)).hexdigest() != received.md5
    assert made.stats is not received.stats


def test_same_multiset_only_for_a_reordering_of_the_same_bytes():
    x = torch.randn(4, 6)
    cube = torch.randn(2, 3, 5)
    assert same_multiset(x, x.t()) and same_multiset(x, x.view(-1)) and same_multiset(cube, cube.permute(2, 0, 1))
    assert same_multiset(x.view(1, 4, 6), x.view(1, 4, 6).transpose(1, 2))  # a size-1 dim, any stride
    assert not same_multiset(x, x[:, ::2])  # every other value
    assert not same_multiset(x[:1], x[:1].expand(4, 6))  # each value four times
    assert not same_multiset(x.t(), x)  # the first must be contiguous
    assert not same_multiset(x, x.t().view(torch.int32))
    assert not same_multiset(torch.randn(3).to_sparse(), torch.randn(3).to_sparse())


def test_check_numerics_gives_a_transpose_the_stats_of_what_it_transposes():
    """With stats alone (no checksum reads the order), a transposed view and a gradient a
    transposing node made share the stats of the values they reorder; equal to computing them."""
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(4, 6)
    with tracer.check_numerics() as t:
        xt = x.t()
        (xt * w).sum().backward()
    made, original = t.tensors["t0:out"], t.tensors["input0"]
    assert made.stats is original.stats
    want = cpu_stats(xt.detach())
    assert (made.stats.min, made.stats.max, made.stats.absmax, made.stats.nan, made.stats.inf) == \
        (want.min, want.max, want.absmax, want.nan, want.inf)
    assert made.stats.mean == pytest.approx(want.mean, rel=1e-12)
    step = next(s for run in t.backward_runs for s in run.steps if s.node == "t0/TBackward0")
    received, grad = t.tensors[step.grads_in[0]], t.tensors[step.grads_out[0]]
    assert grad.stats is received.stats
    assert grad.stats.min == x.grad.min().item() and grad.stats.max == x.grad.max().item()


@pytest.mark.parametrize("algorithm", ["md5", "none"])
def test_views_of_non_contiguous_values_follow_what_their_op_does(algorithm):
    """A reshaping view keeps its input's order even when neither is contiguous (a view of one
    chunk of ``split``, as attention splits q, k and v): the same checksum and stats. A
    transpose of it reorders: with stats alone the same stats, with a checksum its own."""
    g = torch.Generator().manual_seed(1)
    with tracer.trace(hash=algorithm, stats=True) as t:
        qkv = torch.randn(2, 5, 12, generator=g) * 2
        q, _k, _v = qkv.split(4, dim=2)
        heads = q.view(2, 5, 2, 2)  # non-contiguous, the order of q
        swapped = heads.transpose(1, 2)  # non-contiguous, another order
        part = swapped.reshape(4, 10)  # not viewable: a copy, its own value
    recs = {n: t.tensors[n] for n in ("split0:out0", "view0:out", "transpose0:out", "reshape0:out")}
    assert not heads.is_contiguous() and not swapped.is_contiguous()
    assert recs["view0:out"].stats is recs["split0:out0"].stats
    assert (recs["transpose0:out"].stats is recs["view0:out"].stats) == (algorithm == "none")
    assert part.data_ptr() != swapped.data_ptr() and recs["reshape0:out"].stats is not recs["transpose0:out"].stats
    for name, value in (("split0:out0", q), ("view0:out", heads), ("transpose0:out", swapped), ("reshape0:out", part)):
        rec = recs[name]
        if algorithm == "md5":
            assert rec.md5 == hashlib.md5(_bytes(value)).hexdigest(), name
        want = cpu_stats(value)
        assert (rec.stats.min, rec.stats.max, rec.stats.absmax) == (want.min, want.max, want.absmax), name
        assert rec.stats.mean == pytest.approx(want.mean, rel=1e-12), name


def test_a_view_node_reshaping_a_non_contiguous_gradient_copies_it():
    """``ViewBackward0`` receives a transposed (non-contiguous) gradient and reshapes it without a
    copy: the gradient it makes reads as the one it received."""
    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(4, 6)
    with tracer.trace(hash="md5") as t:
        (x.view(6, 4).t() * w).sum().backward()
    steps = {s.node: s for run in t.backward_runs for s in run.steps}
    view_step = steps["view0/ViewBackward0"]
    received, made = t.tensors[view_step.grads_in[0]], t.tensors[view_step.grads_out[0]]
    assert made.md5 == received.md5 == hashlib.md5(_bytes(x.grad)).hexdigest()
    assert made.stats is received.stats


def _gpt2_step(device: str) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(device).train()
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, 128, (2, 32), device=device)
    return model, ids


def _stats_key(rec: TensorRecord) -> tuple[object, ...]:
    s = rec.stats
    return (rec.md5, rec.fingerprint, None if s is None else (s.min, s.max, s.absmax, s.nan, s.inf))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])])
@pytest.mark.parametrize("mode", ["md5", "fast", "check_numerics"])
def test_a_transformer_step_records_the_same_values_with_and_without_the_copies(device, mode, monkeypatch):
    """A GPT-2 step (attention splits q, k and v, views them into heads and transposes them) and
    its AdamW step, traced twice from the same state: once as shipped, once with every value read
    from its own bytes. Every record's checksum and stats agree; on CUDA through the batched kernels."""
    from tracer.record.autograd import Graph
    from tracer.record.tensor_names import TensorNames

    model, ids = _gpt2_step(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start_model = {k: v.clone() for k, v in model.state_dict().items()}

    def traced():
        model.load_state_dict(start_model)
        opt.state.clear()
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks
        with (tracer.check_numerics() if mode == "check_numerics" else tracer.trace(hash=mode, stats=True)) as t:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        return t

    copied = traced()
    monkeypatch.setattr(TensorNames, "same_values_input", lambda self, *a: None)
    monkeypatch.setattr(Graph, "_received_as", lambda self, *a: None)
    computed = traced()
    assert list(copied.tensors) == list(computed.tensors)
    differing = [n for n in copied.tensors if _stats_key(copied.tensors[n]) != _stats_key(computed.tensors[n])]
    assert differing == []
    for n, rec in copied.tensors.items():
        if rec.stats is not None and rec.stats.mean is not None:
            assert rec.stats.mean == pytest.approx(computed.tensors[n].stats.mean, rel=1e-5, abs=1e-6), n
    # The copies were taken in the first trace only: there forward view outputs share their input's
    # Stats. (Gradients that are one tensor under two names share theirs in both; on CUDA the batched
    # kernels also give contiguous views of one waiting value its row, in both.)
    def shared_views(t) -> int:
        owners = {}
        for n, r in t.tensors.items():
            if r.stats is not None:
                owners.setdefault(id(r.stats), []).append(n)
        return sum(1 for names in owners.values() if len(names) > 1 for n in names
                   if n.startswith("view") and n.endswith(":out"))

    assert shared_views(copied) > shared_views(computed)
    if device == "cpu":
        assert shared_views(copied) > 10 and shared_views(computed) == 0
