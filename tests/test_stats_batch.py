"""Stats of many small CPU tensors computed together (an optimizer step's parameters and state)
equal the stats, checksums and fingerprints of the one-tensor path, record for record."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

import tracer
from tracer.model import Stats, TensorRecord
from tracer.record.checksums import hasher as hasher_module
from tracer.record.checksums.fingerprint import fingerprint_reference
from tracer.record.checksums.hasher import BATCH_MAX_ELEMS, BATCH_MIN, BATCH_MIN_GROUP, Hasher
from tracer.record.checksums.stats import PRECISE_SUM_ELEMS, cpu_stats, cpu_stats_same_size


def _record(name: str, t: torch.Tensor) -> TensorRecord:
    return TensorRecord(name, tuple(t.shape), str(t.dtype), "cpu", "output", None, tuple(t.stride()),
                        t.is_contiguous(), False, 0, 0)


@pytest.mark.parametrize("n", [2, 3, 16, 17, 255, 256, 1000, 1024, 4097, PRECISE_SUM_ELEMS])
def test_rows_of_a_stack_reduce_as_each_tensor_alone(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    ts = [torch.randn(n, generator=gen) * scale for scale in (1e-6, 1e-3, 1.0, 3.0, 1e4, 1e30)]
    ts.append(torch.full((n,), -0.0))
    got = cpu_stats_same_size(ts)
    assert [repr(s) for s in got] == [repr(cpu_stats(t)) for t in ts]


def test_a_row_with_nan_or_inf_gets_the_counting_path() -> None:
    ts = [torch.randn(64) for _ in range(5)]
    ts[1][3] = math.nan
    ts[2][0] = math.inf
    ts[3][:] = math.nan  # no finite value at all
    got = cpu_stats_same_size(ts)
    assert [repr(s) for s in got] == [repr(cpu_stats(t)) for t in ts]
    assert got[1].nan == 1 and got[2].inf == 1 and got[3].min is None


def _inputs() -> list[torch.Tensor]:
    """A step's worth of new values: groups of one size (batched), odd ones out, scalars (one
    a NaN), and what the batch leaves to the one-tensor path (other dtypes, views, big ones)."""
    gen = torch.Generator().manual_seed(0)
    ts: list[torch.Tensor] = []
    for n in (8, 64, 640, BATCH_MAX_ELEMS):
        ts += [torch.randn(n, generator=gen) for _ in range(BATCH_MIN_GROUP + 1)]
    ts += [torch.randn(3, 5, generator=gen) for _ in range(BATCH_MIN_GROUP)]  # 15 values, 2-D
    ts += [torch.tensor(float(k)) for k in range(6)]  # Adam's step counters
    ts += [torch.tensor(math.nan), torch.tensor(-0.0)]
    ts += [torch.randn(100, generator=gen)]  # alone of its size
    ts += [torch.randn(BATCH_MAX_ELEMS + 1, generator=gen) for _ in range(BATCH_MIN_GROUP)]
    ts += [torch.randn(64, generator=gen, dtype=torch.float64) for _ in range(BATCH_MIN_GROUP)]
    ts += [torch.randn(64, generator=gen).to(torch.bfloat16) for _ in range(BATCH_MIN_GROUP)]
    ts += [torch.randn(8, 8, generator=gen).t() for _ in range(BATCH_MIN_GROUP)]  # not contiguous
    ts += [torch.nn.Parameter(torch.randn(64, generator=gen)) for _ in range(2)]
    with_nan = torch.randn(64, generator=gen)
    with_nan[5] = math.nan
    ts.append(with_nan)
    return ts


@pytest.mark.parametrize("algorithm", ["none", "md5", "fast"])
def test_submit_many_equals_submit_for_every_record(algorithm: str) -> None:
    ts = _inputs()
    one, many = Hasher(algorithm, stats=True), Hasher(algorithm, stats=True)
    alone = [_record(f"t{i}", t) for i, t in enumerate(ts)]
    together = [_record(f"t{i}", t) for i, t in enumerate(ts)]
    for rec, t in zip(alone, ts):
        one.submit(rec, t)
    many.submit_many(list(zip(together, ts)))
    one.drain(wait=True)
    many.drain(wait=True)
    for a, b, t in zip(alone, together, ts):
        assert (repr(a.stats), a.md5, a.fingerprint, a.hash_note) == \
            (repr(b.stats), b.md5, b.fingerprint, b.hash_note), (a.name, t.dtype, t.shape)
        assert b.stats is not None
        data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        if algorithm == "md5":
            assert b.md5 == hashlib.md5(data).hexdigest()
        elif algorithm == "fast":
            assert b.fingerprint == fingerprint_reference(data)
    assert alone[-1].stats.nan == 1


def _spy_groups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the groups whose stats are computed together, from now on."""
    groups: list[int] = []
    real = hasher_module.cpu_stats_same_size

    def spy(ts: list[torch.Tensor]) -> list[Stats | None]:
        groups.append(len(ts))
        return real(ts)

    monkeypatch.setattr(hasher_module, "cpu_stats_same_size", spy)
    return groups


def test_submit_many_computes_groups_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups really take the batched path (one stack per size), the rest the usual one."""
    batched = _spy_groups(monkeypatch)
    ts = [torch.randn(32) for _ in range(BATCH_MIN_GROUP)] + [torch.randn(7) for _ in range(BATCH_MIN_GROUP - 1)]
    ts += [torch.randn(5) for _ in range(BATCH_MIN - len(ts))]
    Hasher("none", stats=True).submit_many([(_record(f"t{i}", t), t) for i, t in enumerate(ts)])
    assert batched == [BATCH_MIN_GROUP] + ([BATCH_MIN - 2 * BATCH_MIN_GROUP + 1]
                                           if BATCH_MIN - 2 * BATCH_MIN_GROUP + 1 >= BATCH_MIN_GROUP else [])



@pytest.mark.parametrize("shapes", [[()] * 12, [(1,)] * 12, [()] * 6 + [(1,), (1, 1)] * 3],
                         ids=["zero-dim", "one-dim", "mixed"])
def test_one_element_values_are_read_together_whatever_their_shape(
        monkeypatch: pytest.MonkeyPatch, shapes: list[tuple[int, ...]]) -> None:
    """An optimizer's step counters are zero-dim tensors, which ``torch.cat`` refuses: the group
    was read one tensor at a time after a failed concatenation (a process's first failure cost
    22 ms of a ResNet-50 step on the CPU). Now one stacked read, with equal results."""
    ts = [torch.full(shape, float(k) - 2.5) for k, shape in enumerate(shapes)]
    singles: list[str] = []
    real = Hasher._submit_scalar

    def spy(self: Hasher, rec: TensorRecord, t: torch.Tensor) -> bool:
        singles.append(rec.name)
        return real(self, rec, t)

    for algorithm in ("none", "md5", "fast"):
        alone = [_record(f"t{i}", t) for i, t in enumerate(ts)]
        together = [_record(f"t{i}", t) for i, t in enumerate(ts)]
        one, many = Hasher(algorithm, stats=True), Hasher(algorithm, stats=True)
        for rec, t in zip(alone, ts):
            one.submit(rec, t)
        monkeypatch.setattr(Hasher, "_submit_scalar", spy)
        many.submit_many(list(zip(together, ts)))
        monkeypatch.setattr(Hasher, "_submit_scalar", real)
        one.drain(wait=True)
        many.drain(wait=True)
        assert singles == []
        assert [(repr(a.stats), a.md5, a.fingerprint) for a in alone] == \
            [(repr(b.stats), b.md5, b.fingerprint) for b in together]
        assert [b.stats.min for b in together if b.stats is not None] == [float(k) - 2.5 for k in range(len(ts))]

def _adam_steps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[tracer.Trace]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    traces = []
    for _ in range(steps):
        with tracer.check_numerics(optimizer_state=True) as t:  # the state's stats batched too
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        traces.append(t)
    return traces


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))


def test_an_optimizer_step_records_the_same_stats_batched_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CNN with BatchNorm (many parameters and states of one size) under AdamW, three
    check_numerics steps from the same seed: every record of every trace alike."""
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([1, 2, 3, 4])
    groups = _spy_groups(monkeypatch)
    batched = _adam_steps(_cnn(), x, y, 3)
    assert sum(groups) >= 3 * 2 * 9  # each step: 9 parameters of 8 values and their state, at least
    monkeypatch.setattr(hasher_module, "BATCH_MIN", 10**9)  # every value through submit
    alone = _adam_steps(_cnn(), x, y, 3)
    for a, b in zip(alone, batched):
        assert list(a.tensors) == list(b.tensors)
        assert [repr(r.stats) for r in a.tensors.values()] == [repr(r.stats) for r in b.tensors.values()]
        assert all(r.stats is not None for r in b.tensors.values() if r.numel)
    step = [c for c in batched[-1].calls if c.kind == "optimizer"]
    assert len(step) == 1 and len(step[0].outputs) > 3 * 6  # parameters and their state
