"""Checksums equal hashlib on the same bytes, for every dtype and layout the tracer meets."""

from __future__ import annotations

import hashlib

import pytest
import torch

import tracer
from tracer.model import TensorRecord
from tracer.record.checksums.hasher import Hasher
from tracer.record.checksums.stats import stats_tensor


def reference_md5(t: torch.Tensor) -> str:
    """Independent of the tracer: numpy bytes of the contiguous tensor in its own dtype."""
    x = t.detach().resolve_conj().resolve_neg().contiguous().cpu().reshape(-1)
    return hashlib.md5(x.view(torch.uint8).numpy().tobytes()).hexdigest()


CASES = {
    "float32": lambda: torch.randn(5, 7),
    "view_slice": lambda: torch.randn(6, 6)[1:4, ::2],
    "transposed": lambda: torch.randn(3, 5).t(),
    "expanded": lambda: torch.randn(3, 1).expand(3, 4),
    "zero_dim": lambda: torch.tensor(3.25),
    "empty": lambda: torch.empty(0, 4),
    "bool": lambda: torch.randn(9) > 0,
    "int64": lambda: torch.arange(-5, 5),
    "uint8": lambda: torch.randint(0, 255, (17,), dtype=torch.uint8),
    "complex64": lambda: torch.randn(4, dtype=torch.complex64),
    "conj_view": lambda: torch.randn(4, dtype=torch.complex64).conj(),
    "bfloat16": lambda: torch.randn(8).to(torch.bfloat16),
    "float16": lambda: torch.randn(8).half(),
    "float8_e4m3fn": lambda: torch.randn(8).to(torch.float8_e4m3fn),
    "float64_large": lambda: torch.randn(300, 300, dtype=torch.float64),  # > inline size: worker threads
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_md5_equals_hashlib(case):
    src = CASES[case]()
    with tracer.trace() as t:
        out = src.clone()
        view = out[..., :] if out.dim() else out * 1
    for tensor, name in ((out, t.calls[0].outputs[0]), (view, t.calls[1].outputs[0])):
        rec = t.tensors[name]
        assert rec.md5 == reference_md5(tensor), (case, name)
        assert rec.shape == tuple(tensor.shape) and rec.dtype == str(tensor.dtype).replace("torch.", "")
    # the input, seen from outside the block, is hashed as it was on entry
    assert t.tensors["input0"].md5 == reference_md5(src)



def test_md5_of_inside_a_traced_block_records_nothing_of_its_own():
    lin = torch.nn.Linear(4, 4)
    calls = []

    class Counting(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with Counting(), tracer.trace() as t:
        y = lin(torch.randn(2, 4)).sum()
        before = len(calls)
        digest = tracer.md5_of(lin.weight)  # a user comparing a live tensor with the trace
        seen = calls[before:]
        z = y * 2
    assert [c.api for c in t.calls] == ["torch.randn", "torch.nn.functional.linear", "Tensor.sum", "Tensor.mul"]
    assert digest == reference_md5(lin.weight) == t.tensors["weight"].md5
    assert t.tensors["mul0:out"].md5 == reference_md5(z)
    assert seen == []  # nor does the program's own mode see its detach, reshape and view


def test_stats_of_a_value_with_a_tangent_ask_no_forward_derivative_of_the_reductions(monkeypatch):
    """Under ``forward_ad.dual_level`` a value may carry a tangent: its stats are read from the
    primal (torch 2.11 has no forward derivative for ``aminmax``: the read failed and the value
    had no checksum)."""
    import torch.autograd.forward_ad as fwAD

    from tracer.record.checksums import stats

    real, seen = torch.aminmax, []

    def aminmax(x, *args, **kwargs):
        seen.append(fwAD.unpack_dual(x).tangent is None)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(stats.torch, "aminmax", aminmax)
    x, v = torch.randn(4), torch.randn(4)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, v)
        got = stats.cpu_stats(dual)
    assert seen == [True]
    assert got is not None and (got.min, got.max) == (x.min().item(), x.max().item())

def test_snapshot_taken_before_a_later_in_place_change():
    big = torch.randn(512, 512)  # large: hashed on a worker thread from a snapshot
    with tracer.trace() as t:
        y = big * 2
        expected = reference_md5(y)
        y.add_(1)  # must not leak into the hash of mul0:out
    assert t.tensors["mul0:out"].md5 == expected
    assert t.tensors["mul0:out@v1"].md5 == reference_md5(y)


def test_unhashable_tensors_are_recorded_with_a_reason():
    rec = TensorRecord("x", (2,), "float32", "meta", "input")
    h = Hasher("md5")
    h.submit(rec, torch.empty(2, device="meta"))
    assert rec.md5 is None and rec.hash_note == "not hashed: meta tensor (no data)"
    sparse = TensorRecord("s", (3, 3), "float32", "cpu", "input")
    h.submit(sparse, torch.eye(3).to_sparse())
    assert sparse.hash_note == "not hashed: sparse_coo layout"
    q = TensorRecord("q", (4,), "quint8", "cpu", "input")
    h.submit(q, torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8))
    assert q.hash_note == "not hashed: quantized tensor"

    class Routed(torch.Tensor):  # takes over dispatch: its bytes need not be its data
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    sub = TensorRecord("m", (2,), "float32", "cpu", "input")
    h.submit(sub, torch.randn(2).as_subclass(Routed))
    assert sub.hash_note == "not hashed: tensor subclass Routed"
    h.close()


def test_a_subclass_that_only_tags_a_tensor_is_hashed_and_checked_by_its_bytes():
    """A subclass with no dispatch of its own (units, a tag: made with ``as_subclass``) holds a
    plain tensor's bytes: its checksum is hashlib's of them and its NaN is found where it is made
    (before, 'not hashed: tensor subclass', and check_numerics called the step clean)."""

    class Tagged(torch.Tensor):
        pass

    torch.manual_seed(0)
    m = torch.nn.Linear(6, 2)
    x = torch.randn(4, 6).as_subclass(Tagged)
    with tracer.trace(hash="md5") as t:
        y = m(x)
    rec = t.tensors[t["linear0"].outputs[0]]
    assert type(y) is Tagged and rec.hash_note is None
    assert rec.md5 == hashlib.md5(y.detach().as_subclass(torch.Tensor).contiguous().numpy().tobytes()).hexdigest()
    assert t.tensors[t["linear0"].inputs[0]].md5 == tracer.md5_of(x.as_subclass(torch.Tensor))
    with tracer.check_numerics() as t:
        (m(x) * float("nan")).sum()
    assert t.anomalies.headline is not None and t.anomalies.headline.producer == "mul0"


def test_meta_and_sparse_inside_a_trace():
    with tracer.trace() as t:
        m = torch.empty(3, 3, device="meta") + 1
        s = torch.eye(3).to_sparse() * 2
    assert t.tensors["add0:out"].hash_note == "not hashed: meta tensor (no data)"
    assert t.tensors["mul0:out"].hash_note == "not hashed: sparse_coo layout"
    del m, s


def test_stats_over_finite_values_count_nan_and_inf():
    x = torch.tensor([1.0, -3.0, float("nan"), float("inf"), 2.0, float("-inf")])
    lo, hi, mean, absmax, nan, inf, n_fin = stats_tensor(x).tolist()
    assert (lo, hi, mean, absmax, nan, inf, n_fin) == (-3.0, 2.0, 0.0, 3.0, 1.0, 2.0, 3.0)
    with tracer.trace() as t:
        y = torch.log(torch.tensor([1.0, -1.0, 0.0]))
    st = t.tensors["log0:out"].stats
    assert (st.nan, st.inf, st.min, st.max) == (1, 1, 0.0, 0.0)
    assert not st.finite
    del y


def test_hash_none_records_no_checksums():
    with tracer.trace(hash="none") as t:
        torch.randn(3).exp()
    assert all(r.md5 is None and r.stats is None for r in t.tensors.values())
    assert t.hash_algorithm == "none"


def test_cpu_stats_equal_the_masked_reduction():
    """The CPU fast path (min/max first, masked reduction only when something is not finite)
    against the plain per-tensor reduction the CUDA fallback path uses."""
    from tracer.record.checksums.stats import cpu_stats, reduce_one

    xs = [torch.randn(n) for n in (1, 3, 100, 70_000, 5, 64, 65, 4096)]
    xs[2][4] = float("nan")
    xs[3][7] = float("inf")
    xs[5][0] = float("-inf")
    xs[6][:] = float("nan")  # nothing finite at all
    rows = torch.stack([reduce_one(x) for x in xs])
    assert rows[:, 4].tolist() == [0, 0, 1, 0, 0, 0, 65, 0] and rows[:, 5].tolist() == [0, 0, 0, 1, 0, 1, 0, 0]
    for x in xs:
        fast, full = cpu_stats(x), reduce_one(x).tolist()
        assert (fast.nan, fast.inf) == (int(full[4]), int(full[5]))
        if fast.min is not None:
            assert fast.min == full[0] and fast.max == full[1] and abs(fast.mean - full[2]) < 1e-6


SCALAR_CASES = [(dt, v) for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                                   torch.uint8, torch.int16, torch.int32, torch.int64)
                for v in (0.0, -0.0, 1.0, -1.5, 3.0, 100.0, 2.0**40, float("nan"), float("inf"))] + \
               [(torch.bool, True), (torch.bool, False), (torch.int64, 2**53 + 1), (torch.complex64, 1 + 2j),
                (torch.uint16, 40000), (torch.float32, 1e-40)]


@pytest.mark.parametrize("algorithm", ["md5", "fast"])
def test_one_element_cpu_tensors_equal_the_general_path(algorithm):
    """Scalars (an optimizer's step counts) take a shortcut from their value and bytes: the same
    checksums, fingerprints and stats as the general CPU path, -0.0, NaN/Inf and the dtypes it
    does not take (complex, unsigned 16-bit) included."""
    from tracer.record.checksums import fingerprint as fp
    from tracer.record.checksums.bytes import as_bytes, host_bytes
    from tracer.record.checksums.stats import cpu_stats

    values = []
    for dt, v in SCALAR_CASES:
        x = torch.tensor(v)
        if dt.is_floating_point or dt.is_complex or dt == torch.bool or x.isfinite().all():
            values.append(x.to(dt))
    values.append(torch.arange(6, dtype=torch.float32)[4])  # a view at an offset into its storage
    values.append(torch.tensor([[2.5]]))  # one element, two dimensions
    values.append(torch.tensor(1.0 + 1.0j).conj())  # lazily conjugated: the general path resolves it
    with tracer.trace(hash=algorithm) as t:
        for x in values:
            x.clone()
    recs = [t.tensors[f"clone{i}:out"] for i in range(len(values))]
    for x, rec in zip(values, recs):
        b = as_bytes(x)  # kept alive while host_bytes' view of it is read
        data = bytes(host_bytes(b))
        if algorithm == "md5":
            assert rec.md5 == hashlib.md5(data).hexdigest(), (x.dtype, x)
        else:
            assert rec.fingerprint == fp.fingerprint_reference(data), (x.dtype, x)
        assert repr(rec.stats) == repr(cpu_stats(x.resolve_conj())), (x.dtype, x)
    # NaN and Inf are counted, as by the general path.
    nan = next(r for x, r in zip(values, recs) if x.dtype == torch.float32 and x.isnan().all())
    assert (nan.stats.nan, nan.stats.min) == (1, None)


def test_cpu_stats_equal_the_torch_reduction():
    """``cpu_stats`` (min/max/mean/absmax and NaN/Inf counts now, from the tensor itself) against
    the reference reduction ``stats_tensor``: every dtype it takes, strided and transposed views,
    non-finite values and a tensor with nothing finite. A small float32 tensor is summed in
    float64: a one-ulp change of one value moves its mean (a diff by stats relies on it)."""
    from tracer.record.checksums.stats import PRECISE_SUM_ELEMS, cpu_stats, stats_from_row, stats_tensor

    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 30, generator=g)
    cases = [x, x.t(), x[::3, 1::2], x.bfloat16(), x.half().t(), x.double(), torch.tensor(-0.0),
             torch.arange(-5, 9), torch.arange(7, dtype=torch.int8), x[0] > 0, torch.randn(6, dtype=torch.complex64),
             torch.tensor([1.0, float("nan"), float("-inf"), 4.0]), torch.full((5,), float("inf")),
             torch.randn(PRECISE_SUM_ELEMS + 1, generator=g)]
    for t in cases:
        got, row = cpu_stats(t), stats_tensor(t.to(torch.uint8) if t.dtype == torch.bool else t)
        assert got is not None and row is not None
        want = stats_from_row(row.tolist())
        assert (got.min, got.max, got.absmax, got.nan, got.inf) == (want.min, want.max, want.absmax, want.nan,
                                                                    want.inf), (t.dtype, t.shape)
        assert (got.mean is None) == (want.mean is None)
        if want.mean is not None:
            assert got.mean == pytest.approx(want.mean, rel=1e-6, abs=1e-7), (t.dtype, t.shape)
    assert cpu_stats(torch.ones(0)) is None
    small = torch.full((1000,), 1.0)
    nudged = small.clone()
    nudged[500] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert float(small.sum()) == float(nudged.sum())  # in float32 the change is lost
    assert cpu_stats(small).mean != cpu_stats(nudged).mean  # in float64 it is not


def test_check_numerics_on_the_cpu_names_the_nan_of_a_small_tensor():
    """A NaN made in a small tensor is found at its op."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with tracer.check_numerics(raise_on_nonfinite=False) as t:
        h = model(x)
        y = torch.sqrt(h - 100.0)  # NaN: negative under the root
        y.sum().backward()
    first = t.anomalies.forward
    assert first is not None and first.producer_kind == "torch.sqrt" and first.origin
    assert first.nan == int(torch.isnan(y).sum())
