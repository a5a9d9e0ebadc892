"""The batched Triton path of ``tracer.record.checksums.fused``, run on the CPU under Triton's interpreter.

Run by tests/test_fused.py in a subprocess, because ``TRITON_INTERPRET=1`` must be set before
triton is first imported. Prints one JSON object on stdout:

- ``kernel``: for many dtypes, sizes, views and non-finite values, the kernel's fingerprint
  next to the plain-Python reference of the same bytes, and its stats next to the torch path's;
- ``trace``: the same seeded training step traced twice with ``hash="fast"``, once through the
  immediate CPU path and once through the batches (``GRADTRACE_FUSED_INTERPRET=1``); every
  tensor's fingerprint and stats, by name. Equal results mean the recorder flushed or
  snapshotted the batches before every in-place change, including one made by a custom
  backward; and how many launches the batched step made;
  ``trace.recipe``: the same for a mixed-precision recipe over two blocks (gradient
  accumulation into an existing .grad, GradScaler, clipping, fused AdamW with existing state);
  ``trace.unseen_write``: a custom Function's forward writing a recorded value with no op seen;
  ``trace.inference_first``: an evaluation under ``torch.inference_mode`` first in the block;
  ``trace.tied_checkpointed``: GPT-2 with tied embeddings and gradient checkpointing, two
  micro-batches, with every parameter's and gradient's version counter, traced and untraced;
- ``protect``: ``Fused.protect`` before writes that do and do not reach a waiting tensor;
- ``ddp``: a two-rank DDP step (gloo) through the immediate path and through the batches;
- ``versions``: every version counter of a detection-style step's tensors (tests/version_recipes.py)
  untraced, and traced through the batches with ``hash="fast"`` and ``hash="md5"`` (stats).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from tracer.model import TensorRecord
from tracer.record.checksums import fused
from tracer.record.checksums.bytes import as_bytes, host_bytes, md5_of
from tracer.record.checksums.fingerprint import fingerprint, fingerprint_reference, hex_of
from tracer.record.checksums.stats import stats_tensor


def record_values(t: Any) -> dict[str, list[object]]:
    """Every tensor record's fingerprint and exact stats (min, max, NaN and Inf counts), by name:
    what the immediate and the batched paths must agree on."""
    return {name: [r.fingerprint, None if r.stats is None else [r.stats.min, r.stats.max, r.stats.nan, r.stats.inf]]
            for name, r in t.tensors.items()}


def flushed_rows(batcher: fused.Fused) -> dict[str, tuple[list[float], list[int]]]:
    """Launch what waits and fetch every row: each record's float row (min, max, mean or sum,
    absmax) and int row (NaN count, finite count, the fingerprint's two lanes), by name."""
    batcher.flush()
    rows = {}
    for slots, floats, ints in batcher.take(wait=True):
        for recs_of_row, frow, irow in zip(slots, floats, ints):
            for rec in recs_of_row:
                rows[rec.name] = (frow, irow)
    return rows


@contextlib.contextmanager
def counting_launches() -> Iterator[list[int]]:
    """Within: ``Fused._launch`` counts the batches it launches with anything in them, into the
    one-element list yielded."""
    launch, launches = fused.Fused._launch, [0]

    def counted(self: fused.Fused, key: tuple[int, int, torch.dtype]) -> None:
        launches[0] += bool(self._batches[key].slots)
        launch(self, key)

    fused.Fused._launch = counted  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        fused.Fused._launch = launch  # type: ignore[method-assign]


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 65, generator=g)
    cases = {
        "float32": x, "bfloat16": x.bfloat16(), "float16 odd": x.half()[:, :7],
        "float64": x.double()[:5], "int64": torch.arange(-7, 30), "int32": torch.arange(11, dtype=torch.int32),
        "int16 odd": torch.arange(5, dtype=torch.int16), "int8": torch.arange(-3, 6, dtype=torch.int8),
        "uint8 tail 3": torch.arange(7, dtype=torch.uint8), "bool": x[0] > 0,
        "transposed": x.t(), "strided": x[::3, 1::2], "offset view": x.view(-1)[1:100],
        "complex64": torch.randn(9, dtype=torch.complex64, generator=g),
        "nan and inf": torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -4.0]),
        "all nan": torch.full((6,), float("nan")), "one": torch.tensor(2.5),
        "several programs": torch.randn(70_000, generator=g),  # > 64 KiB: 4 programs, 17 chunks
    }
    return cases


def kernel_results() -> dict[str, dict[str, object]]:
    batcher = fused.Fused(stats=True, fingerprint=True, interpret=True)
    cases = _cases()
    recs = {}
    for name, t in cases.items():
        rec = TensorRecord(name=name, shape=tuple(t.shape), dtype=str(t.dtype), device="cpu", role="output",
                           producer=None)
        assert batcher.add(rec, t), name
        recs[name] = rec
    for name, (frow, irow) in flushed_rows(batcher).items():
        recs[name].fingerprint = hex_of(irow[2], irow[3])
        recs[name].stats = (frow, irow[:2])  # type: ignore[assignment]
    out: dict[str, dict[str, object]] = {}
    for name, t in cases.items():
        frow, counts = recs[name].stats  # type: ignore[misc]
        ref = stats_tensor(t)
        assert ref is not None
        lo, hi, mean, absmax, nan, inf, _ = ref.tolist()
        packed = as_bytes(t)  # alive while its bytes are read
        out[name] = {"fingerprint": recs[name].fingerprint,
                     "reference": fingerprint_reference(bytes(host_bytes(packed))),
                     "stats": list(frow) + list(counts), "reference_stats": [lo, hi, mean, absmax, nan, inf]}
    return out


class Halve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.mul_(0.5)  # in place, on a gradient the trace has recorded


def _step(optimizer_ops: bool) -> dict[str, list[object]]:
    import tracer

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    norm = torch.nn.BatchNorm1d(16)
    opt = torch.optim.AdamW([*lin.parameters(), *norm.parameters()], lr=0.1, foreach=True)
    x = torch.randn(8, 16)
    with tracer.trace(hash="fast", optimizer_ops=optimizer_ops) as t:
        for _ in range(2):
            h = lin(x)
            h.add_(1.0)  # in place on a recorded output
            h[0] = 3.0  # __setitem__
            h.view(-1)[:8].mul_(2.0)  # through a view: the write reaches h's bytes
            h = F.relu(h, inplace=True)
            h = norm(Halve.apply(h))  # running stats change in place
            # Views that copy the value they read (a view of a view; a view of a split chunk), and
            # a transpose, which is read on its own under a checksum.
            chunk = h.split(8, dim=1)[0].view(8, 2, 4).view(8, 8)
            (chunk.t() * 2.0).sum()
            loss = h.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return record_values(t)


class ScaleInPlace(torch.autograd.Function):
    """Scales its input in place the way an extension kernel would: no torch call the recorder
    sees (the mode is off inside), the write declared with ``mark_dirty``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            x.mul_(3.0)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3.0


def _unseen_write() -> dict[str, list[object]]:
    """A value recorded, then written by a custom Function's forward with no op seen."""
    import tracer

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    with tracer.trace(hash="fast") as t:
        h = x * 2
        ScaleInPlace.apply(h)
    return {name: [r.fingerprint, None if r.stats is None else [r.stats.min, r.stats.max]]
            for name, r in t.tensors.items()}


def _recipe() -> dict[str, list[object]]:
    """A mixed-precision recipe over two traced blocks of one step each: two micro-batches
    accumulated into gradients that exist before the block (``zero_grad(set_to_none=False)``),
    GradScaler's unscale, clipping, and a fused AdamW whose state exists before the second block.
    The engine adds into an existing .grad and the fused step writes its state with no op the
    recorder sees: their values from before must be read first."""
    import tracer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    xs, ys = torch.randn(4, 6, 8), torch.randint(0, 3, (4, 6))
    out: dict[str, list[object]] = {}
    for block in range(2):
        with tracer.trace(hash="fast") as t:
            for k in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(xs[2 * block + k]), ys[2 * block + k]) / 2
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=False)
        out.update({f"{block}/{name}": v for name, v in record_values(t).items()})
    return out


def _tied_checkpointed() -> dict[str, object]:
    """GPT-2 with its input and output embeddings tied (autograd sums the shared weight's
    gradient from two edges before its accumulator), gradient checkpointing (each block's
    forward runs again inside the backward), two micro-batches accumulated (the first one's
    gradients kept as .grad, which autograd does only with gradients nobody else holds),
    clipping and a foreach AdamW whose state exists before the block. Every value's fingerprint
    and stats, and every parameter's and gradient's version counter after the traced step and
    after the same step untraced."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import tracer

    def run(traced: bool) -> tuple[dict[str, list[object]], dict[str, list[int | None]]]:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                            eos_token_id=0, tie_word_embeddings=True, use_cache=False)
        model = GPT2LMHeadModel(config)
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

        def step() -> None:
            opt.zero_grad(set_to_none=True)  # the first micro-batch's gradients become .grad
            for _ in range(2):
                (model(input_ids=ids, labels=ids).loss / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        step()  # the optimizer state exists before the block
        values: dict[str, list[object]] = {}
        if traced:
            with tracer.trace(hash="fast") as t:
                step()
            values = record_values(t)
        else:
            step()
        versions = {name: [p._version, None if p.grad is None else p.grad._version]
                    for name, p in model.named_parameters()}
        return values, versions

    values, versions = run(traced=True)
    return {"values": values, "versions": versions, "untraced_versions": run(traced=False)[1]}


def _inference_first() -> dict[str, list[object]]:
    """An evaluation under torch.inference_mode first in the block (the batches' first tensors
    are inference tensors, and a batch may launch inside that mode), then a training step."""
    import tracer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.inference_mode():
        x = torch.randn(6, 8)
    with tracer.trace(hash="fast") as t:
        with torch.inference_mode():
            model(x).mul_(2.0)  # in place inside the mode: the batch is protected there
        model(x.clone()).pow(2).mean().backward()
        opt.step()
    return record_values(t)


def _ddp_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a two-process DDP step (gloo), a .grad existing before the block, then an
    all_reduce in place, through the immediate path and then through the batches (one process
    group for both: two launches of two processes cost more than the steps); rank 0 writes each
    mode's records to ``out`` (a JSON object by mode)."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, object] = {}
    try:
        for mode in ("immediate", "batched"):
            if mode == "batched":
                os.environ["GRADTRACE_FUSED_INTERPRET"] = "1"  # read by each trace's hasher
            try:
                results[mode] = _ddp_step(rank)
            finally:
                os.environ.pop("GRADTRACE_FUSED_INTERPRET", None)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _ddp_step(rank: int) -> dict[str, list[object]]:
    """A fresh DDP model, one untraced step, then the traced one; every record's fingerprint and
    stats by name."""
    import torch.distributed as dist

    import tracer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank + 1))
    ddp(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    with tracer.trace(hash="fast") as t:
        ddp(x).sum().backward()  # DDP copies the averaged gradients back into each .grad
        opt.step()
        total = x * (rank + 1)
        dist.all_reduce(total)  # a collective writes a recorded value in place
    return {name: [r.fingerprint, None if r.stats is None else [r.stats.min, r.stats.max]]
            for name, r in t.tensors.items()}


def ddp_results() -> dict[str, object]:
    """The DDP step through the immediate path and through the batches."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as sock:  # a free port
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        path = os.path.join(tmp, "ddp.json")
        mp.spawn(_ddp_rank, args=(2, port, path), nprocs=2)
        with open(path) as f:
            out: dict[str, object] = json.load(f)
    return out


class BatchNormNet(torch.nn.Module):
    """Six conv + batch norm + in-place ReLU blocks (24 parameters, 18 buffers: a list long
    enough to be read ahead) and a head. Before the head's first use, its forward writes the
    head's weight with no op the recorder sees (its version bumps: what was read ahead is
    stale) and its bias through ``.data`` (a traced write: the value before it is recorded)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[
            torch.nn.Sequential(torch.nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(inplace=True))
            for i in range(6)])
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x).mean(dim=(2, 3))
        with torch.no_grad(), torch._C.DisableTorchFunction():
            self.head.weight.mul_(0.5)  # unseen, version bumped
        self.head.bias.data.add_(1.0)  # seen through .data
        return self.head(h)


def _state_ahead(config: str) -> dict[str, object]:
    """Two steps of ``BatchNormNet`` in one block under ``config`` (``fast`` or ``check_numerics``):
    every value's fingerprint and stats, and the roles of the values the batches snapshotted."""
    import tracer

    torch.manual_seed(0)
    model = BatchNormNet()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    snapshotted: list[str] = []
    kept = fused.Fused.__dict__["_snapshot"]  # (the staticmethod itself, put back as it was)
    snapshot = fused.Fused._snapshot

    def counted(batch: Any, slot: int) -> None:
        snapshotted.extend(rec.role for rec in batch.slots[slot])
        snapshot(batch, slot)

    fused.Fused._snapshot = staticmethod(counted)  # type: ignore[method-assign]
    try:
        with (tracer.trace(hash="fast") if config == "fast" else tracer.check_numerics()) as t:
            for _ in range(2):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    finally:
        fused.Fused._snapshot = kept  # type: ignore[method-assign]
    return {"values": record_values(t), "snapshotted": snapshotted}


def trace_results() -> dict[str, object]:
    """Both optimizer recordings: the step as one call, and every foreach op inside it; with the
    batches' launches counted."""
    out: dict[str, object] = {}
    for mode, ops in (("step", False), ("ops", True)):
        immediate = _step(ops)
        os.environ["GRADTRACE_FUSED_INTERPRET"] = "1"
        try:
            with counting_launches() as launches:
                batched = _step(ops)
        finally:
            del os.environ["GRADTRACE_FUSED_INTERPRET"]
        out[mode] = {"immediate": immediate, "batched": batched, "launches": launches[0]}
    for label, run in (("recipe", _recipe), ("unseen_write", _unseen_write), ("inference_first", _inference_first),
                       ("tied_checkpointed", _tied_checkpointed),
                       ("state_ahead_fast", functools.partial(_state_ahead, "fast")),
                       ("state_ahead_numerics", functools.partial(_state_ahead, "check_numerics"))):
        immediate = run()
        os.environ["GRADTRACE_FUSED_INTERPRET"] = "1"
        try:
            batched = run()
        finally:
            del os.environ["GRADTRACE_FUSED_INTERPRET"]
        out[label] = {"immediate": immediate, "batched": batched}
    return out


def _record(name: str, t: torch.Tensor) -> TensorRecord:
    return TensorRecord(name=name, shape=tuple(t.shape), dtype=str(t.dtype), device="cpu", role="output",
                        producer=None)


def protect_results() -> dict[str, object]:
    """``Fused.protect`` before in-place writes: a write that cannot reach a waiting tensor
    launches nothing; one that can (through a view) snapshots that tensor, so the batch reads
    the bytes recorded, not the ones written."""
    batcher = fused.Fused(stats=True, fingerprint=True, interpret=True)
    g = torch.Generator().manual_seed(1)
    a, c, other = torch.randn(100, generator=g), torch.randn(50, generator=g), torch.randn(10, generator=g)
    recorded = {"a": bytes(host_bytes(as_bytes(a))), "c": bytes(host_bytes(as_bytes(c)))}
    recs = {"a": _record("a", a), "c": _record("c", c)}
    batcher.add(recs["a"], a)
    batcher.add(recs["c"], c)
    batcher.protect([other])
    after_unrelated = batcher.launches
    batcher.protect([a.view(-1)[10:20]])
    after_view = batcher.launches
    a.view(-1)[10:20].mul_(2.0)
    c.add_(1.0)  # c is never protected: the batch reads what it holds now
    for name, (_frow, irow) in flushed_rows(batcher).items():
        recs[name].fingerprint = hex_of(irow[2], irow[3])
    return {"launches": [after_unrelated, after_view, batcher.launches],
            "a": [recs["a"].fingerprint, fingerprint_reference(recorded["a"]),
                  fingerprint_reference(bytes(host_bytes(as_bytes(a))))],
            "c": [recs["c"].fingerprint, fingerprint_reference(bytes(host_bytes(as_bytes(c))))],
            "release": release_results(), "alias": alias_results()}


def release_results() -> dict[str, object]:
    """``Fused.release`` of tensors autograd takes next: each is snapshotted (the batch holds a
    copy, not the tensor: its reference count is the program's again) until the snapshots
    would pass ``SNAPSHOT_MAX_BYTES``; then the batch is launched instead."""
    batcher = fused.Fused(stats=True, fingerprint=True, interpret=True)
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randn(1000, generator=g) for _ in range(3))  # 4,000 bytes each
    counts = [sys.getrefcount(a)]
    for name, t in (("a", a), ("b", b), ("c", c)):
        batcher.add(_record(name, t), t)
    counts.append(sys.getrefcount(a))  # held by the batch
    saved, fused.SNAPSHOT_MAX_BYTES = fused.SNAPSHOT_MAX_BYTES, 6000
    try:
        batcher.release([a])
        counts.append(sys.getrefcount(a))  # a copy held instead
        after_a = batcher.launches
        batcher.release([b])  # 8,000 bytes of copies would pass the bound: launched
        after_b = batcher.launches
    finally:
        fused.SNAPSHOT_MAX_BYTES = saved
    return {"refcounts": counts, "launches": [after_a, after_b]}


def alias_results() -> dict[str, object]:
    """``Fused.hold_storage_only`` of a gradient a leaf's accumulator takes next: the batch
    holds an alias of its storage (not the tensor, nor a view's base: their reference counts
    are the program's again), makes no copy and launches nothing; a later write into those
    bytes, protected like any other, leaves the record with the bytes as added."""
    batcher = fused.Fused(stats=True, fingerprint=True, interpret=True)
    g = torch.Generator().manual_seed(3)
    grad, other = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    view = grad.view(10, 100).t()  # (packed when added: a fingerprint reads the logical order)
    base_view = grad[:500]  # contiguous: held as it is, with grad as its base
    recs = {name: _record(name, t) for name, t in (("grad", grad), ("view", view), ("base_view", base_view),
                                                   ("other", other))}
    before = sys.getrefcount(grad)
    for name, t in (("grad", grad), ("view", view), ("base_view", base_view), ("other", other)):
        batcher.add(recs[name], t)
    held_count = sys.getrefcount(grad)  # the batch holds grad itself, and base_view's base
    added = {"grad": bytes(host_bytes(as_bytes(grad))), "base_view": bytes(host_bytes(as_bytes(base_view)))}
    snapshots = [0]
    saved = fused.Fused.__dict__["_snapshot"]  # the staticmethod itself, put back as it was
    real = fused.Fused._snapshot

    def counted(batch: Any, slot: int) -> None:
        snapshots[0] += 1
        real(batch, slot)

    fused.Fused._snapshot = staticmethod(counted)  # type: ignore[method-assign]
    try:
        batcher.hold_storage_only([grad])
        after = sys.getrefcount(grad)
        aliases = snapshots[0]
        batcher.protect([grad])  # a write into grad's bytes is next (the next accumulation)
        after_protect = snapshots[0]
    finally:
        fused.Fused._snapshot = saved  # type: ignore[method-assign]
    grad.mul_(3.0)
    for name, (_frow, irow) in flushed_rows(batcher).items():
        recs[name].fingerprint = hex_of(irow[2], irow[3])
    return {"refcounts": [before, held_count, after], "snapshots": [aliases, after_protect],
            "launches": batcher.launches,
            "recorded": {name: recs[name].fingerprint for name in added},
            "expected": {name: fingerprint_reference(b) for name, b in added.items()}}


def list_tensors(seed: int, device: str = "cpu") -> list[torch.Tensor]:
    """A long list as an optimizer step hands over: float32 of many sizes (one with a NaN),
    bfloat16, int64, and two views reading the same bytes as tensors before them."""
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(17 + i, generator=g) for i in range(24)]
    ts += [torch.randn(5, 9, generator=g).to(torch.bfloat16) for _ in range(8)]
    ts += [torch.randint(-9, 9, (33,), generator=g) for _ in range(4)]
    ts[3][2] = float("nan")
    ts = [t.to(device) for t in ts]
    return [*ts, ts[0].view(17), ts[25][:]]


def _list_values(tensors: list[torch.Tensor], again_after_write: bool = False) -> list[list[object]]:
    """``Hasher.submit_many`` of ``tensors`` (fingerprints and stats), then each record's values.
    ``again_after_write``: the same list a second time in the same hasher after writing into
    every tensor (two optimizer steps in one trace: the same plan launched twice before the
    results are fetched), the records of both."""
    from tracer.record.checksums.hasher import Hasher

    hasher = Hasher(algorithm="fast", stats=True)
    recs = [_record(f"t{i}", t) for i, t in enumerate(tensors)]
    hasher.submit_many(list(zip(recs, tensors)))
    if again_after_write:
        with torch.no_grad():
            for t in tensors[:36]:
                t.add_(3)
        again = [_record(f"again{i}", t) for i, t in enumerate(tensors)]
        hasher.submit_many(list(zip(again, tensors)))
        recs += again
    hasher.drain(wait=True)
    return [[r.fingerprint, None if r.stats is None else [r.stats.min, r.stats.max, r.stats.nan, r.stats.inf]]
            for r in recs]


def list_results() -> dict[str, object]:
    """Long lists through ``Fused.read_now`` (one plan a list, nothing held), against the
    immediate path: a first list (a new plan); new tensors of the same dtypes and sizes (the
    plan followed, its addresses moved); the first list again after in-place writes (the plan
    followed where it was, reading the new bytes); a list with a transposed tensor, which no
    plan reads (every tensor added one by one). With the plans kept and the calls counted."""
    first, moved = list_tensors(4), list_tensors(5)
    transposed = [*list_tensors(6), torch.randn(6, 7).t()]
    out: dict[str, object] = {"immediate": {}, "batched": {}, "plans": [], "read": []}
    calls: list[bool] = []
    real = fused.Fused.read_now

    def counted(self: fused.Fused, recs: Any, tensors: Any) -> bool:
        calls.append(real(self, recs, tensors))
        return calls[-1]

    fused._LIST_PLANS.clear()
    fused.Fused.read_now = counted  # type: ignore[method-assign]
    try:
        for label, tensors, write in (("first", first, False), ("moved", moved, False), ("written", first, True),
                                      ("transposed", transposed, False), ("twice", moved, False)):
            if write:
                for t in first[:36]:
                    t.mul_(2) if t.dtype != torch.int64 else t.add_(1)
            tensors = [t.clone() for t in tensors] if label == "twice" else tensors  # written twice below
            before = [t.clone() for t in tensors]
            out["immediate"][label] = _list_values(tensors, label == "twice")  # type: ignore[index]
            if label == "twice":  # the same starting bytes for the batched run
                with torch.no_grad():
                    for t, b in zip(tensors, before):
                        t.copy_(b)
            os.environ["GRADTRACE_FUSED_INTERPRET"] = "1"
            try:
                out["batched"][label] = _list_values(tensors, label == "twice")  # type: ignore[index]
            finally:
                del os.environ["GRADTRACE_FUSED_INTERPRET"]
            out["plans"].append([id(plan) for _, plan in fused._LIST_PLANS])  # type: ignore[attr-defined]
    finally:
        fused.Fused.read_now = real  # type: ignore[method-assign]
    out["read"] = calls
    return out


def dense_results() -> dict[str, object]:
    """Stats alone (``check_numerics``' batches): tensors whose elements fill a span of memory in
    another order (transposed, permuted, channels-last, a Linear weight's gradient) are held as
    they are, not copied; a strided slice is packed. Then a write into their base, after
    ``protect`` (their snapshots keep their layout), and the rows: each against the tensor's
    stats as added. With the held tensors' identities (the original or a copy)."""
    batcher = fused.Fused(stats=True, fingerprint=False, interpret=True)
    g = torch.Generator().manual_seed(11)
    base = torch.randn(6, 7, 5, generator=g)
    base[2, 3, 1] = float("nan")
    base[0, 0, 0] = float("inf")
    cases = {"transposed": base.transpose(0, 2), "permuted": base.permute(1, 2, 0), "slice": base[:, ::2],
             "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
             "weight_grad": torch.randn(16, 8, generator=g).t()}
    expected = {}
    for name, t in cases.items():
        ref = stats_tensor(t)
        assert ref is not None
        expected[name] = ref.tolist()[:6]  # min, max, mean, absmax, NaN count, Inf count
    recs = {name: _record(name, t) for name, t in cases.items()}
    for name, t in cases.items():
        assert batcher.add(recs[name], t), name
    held = [h for b in batcher._batches.values() for h in b.held]
    held_as_is = {name: any(h is t for h in held) for name, t in cases.items()}
    batcher.protect([base])  # a write into base is next: what waits in its bytes is copied
    snapshots_dense = all(h.is_contiguous() or fused._fills_its_span(h)
                          for b in batcher._batches.values() for h in b.held)
    base.mul_(0)
    got = {name: [*frow, *irow[:2]] for name, (frow, irow) in flushed_rows(batcher).items()}
    return {"expected": expected, "got": got, "held_as_is": held_as_is, "rows": len(held),
            "snapshots_dense": snapshots_dense}


def versions_results() -> dict[str, object]:
    """The version counters of a detection-style step: untraced, and traced through the batches
    (which hold their tensors until launched: never past a grad node's hook)."""
    import tracer
    from tests.version_recipes import versions_after

    out: dict[str, object] = {"untraced": versions_after(None, 8), "slot_sum": {"untraced": slot_sum_versions(None)}}
    os.environ["GRADTRACE_FUSED_INTERPRET"] = "1"
    try:
        for hash in ("fast", "md5"):
            out[hash] = versions_after(functools.partial(tracer.trace, hash=hash), 8)
            out["slot_sum"][hash] = slot_sum_versions(functools.partial(tracer.trace, hash=hash))  # type: ignore[index]
    finally:
        del os.environ["GRADTRACE_FUSED_INTERPRET"]
    return out


def slot_sum_versions(traced: Any, device: str = "cpu") -> dict[str, object]:
    """A slot two edges feed, inside the graph: the engine sums the second gradient into the
    first in place (nobody else holds it), and ``clone``'s backward hands the sum on unchanged
    to the leaf's accumulator, which keeps it as ``.grad``: version 1 untraced. A gradient held
    by a waiting batch was summed out of place (version 0). Also the gradient's fingerprint and
    stats, as recorded and of its bytes."""
    p = torch.linspace(-1.0, 1.0, 64, device=device).requires_grad_()
    w = torch.linspace(0.5, 2.0, 64, device=device).requires_grad_()
    with traced() if traced is not None else contextlib.nullcontext() as t:
        q = p.clone()
        ((q * 2.0).sum() + (q * w).sum()).backward()
    assert p.grad is not None and w.grad is not None
    recorded = t.tensors["input0@grad"] if traced is not None else None  # p's gradient
    return {"p.grad": p.grad._version, "w.grad": w.grad._version,
            "fingerprint": None if recorded is None else recorded.fingerprint,
            "md5": None if recorded is None else recorded.md5,
            "max": None if recorded is None or recorded.stats is None else recorded.stats.max,
            # md5_of copies to the host first: host_bytes reads host memory only (a CUDA pointer
            # read from the host is a segmentation fault, which the first CUDA run of this found)
            "expected": [fingerprint(p.grad), md5_of(p.grad), p.grad.max().item()]}


def free_results() -> dict[str, object]:
    """A storage freed inside the block while a value in it waits in a batch: FSDP frees an
    unsharded parameter's memory with ``untyped_storage().resize_(0)`` after its layer, which no
    recorded op does. The value is read before the memory goes (a snapshot), so its record holds
    the bytes it had, not what the next allocation wrote there. (4 MiB: the allocation after the
    free takes the same memory, or the freed pages are unmapped; either way a read after the
    free would not see the value.) Also a resize of a storage the trace holds nothing in."""
    import tracer

    x = torch.linspace(-1.0, 1.0, 1 << 20)
    expected = fingerprint(x * 2.0)
    os.environ["GRADTRACE_FUSED_INTERPRET"] = "1"
    try:
        with tracer.trace(hash="fast") as t:
            y = x * 2.0
            z = torch.ones(8)  # not waiting in any batch with y's bytes: a resize reads nothing of it
            z.untyped_storage().resize_(0)
            y.untyped_storage().resize_(0)  # freed while waiting
            torch.full((1 << 20,), 7.0)  # the next allocation of that size
    finally:
        os.environ.pop("GRADTRACE_FUSED_INTERPRET", None)
    return {"recorded": t.tensors["mul0:out"].fingerprint, "expected": expected,
            "wrapped_after": "resize_" in torch.UntypedStorage.__dict__}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    json.dump({"kernel": kernel_results(), "trace": trace_results(), "protect": protect_results(),
               "ddp": ddp_results(), "versions": versions_results(), "lists": list_results(),
               "dense": dense_results(), "free": free_results()}, sys.stdout)


if __name__ == "__main__":
    main()
