"""Every tensor kind torch ships, through ops inside ``trace(hash="md5")``, ``trace(hash="fast")``
and ``check_numerics()``: the user's result unchanged, never an error in user code, every tensor
recorded (hashed exactly, or not hashed with a note saying why), the trace saved, streamed and
loaded back."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

import tracer


class FunctionSubclass(torch.Tensor):
    """A ``__torch_function__`` subclass (``as_subclass``), as libraries make them."""


class DispatchWrapper(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass holding a plain tensor (no storage of its own)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> DispatchWrapper:
        out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        out.elem = elem
        return out  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x.elem if isinstance(x, DispatchWrapper) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: DispatchWrapper(x) if isinstance(x, torch.Tensor) else x, out)


def _inference_tensor() -> torch.Tensor:
    with torch.inference_mode():
        return torch.randn(3, 4)


def _fake_case() -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def op(f: Any) -> Any:
        with mode:
            return (f * 2).sum(0)
    return (lambda: mode.from_tensor(torch.randn(3, 4))), op


Case = tuple[Callable[[], Any], Callable[[Any], Any], bool]  # make, op, whether records get checksums


def _cases() -> Iterator[tuple[str, Case]]:
    dense = torch.randn(4, 6)
    two = [torch.randn(2, 3), torch.randn(4, 3)]
    yield "nested_strided", (lambda: torch.nested.nested_tensor(two), lambda n: (n * 2).sin() + 1, False)
    yield "nested_jagged", (lambda: torch.nested.nested_tensor(two, layout=torch.jagged),
                            lambda n: (n * 2).sin() + 1, False)
    yield "sparse_coo", (lambda: dense.to_sparse(), lambda s: (s * 2).coalesce().to_dense() + 1, False)
    yield "sparse_csr", (lambda: dense.to_sparse_csr(), lambda s: (s * 2).to_dense() + 1, False)
    yield "sparse_csc", (lambda: dense.to_sparse_csc(), lambda s: s.to_dense() * 2, False)
    yield "sparse_bsr", (lambda: dense.to_sparse_bsr((2, 2)), lambda s: s.to_dense() + 1, False)
    yield "sparse_bsc", (lambda: dense.to_sparse_bsc((2, 3)), lambda s: s.to_dense() + 1, False)
    if torch.backends.mkldnn.is_available():
        yield "mkldnn", (lambda: dense.to_mkldnn(), lambda m: m.to_dense() * 2, False)
    yield "quantized", (lambda: torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8),
                        lambda q: q.dequantize() + 1, False)
    yield "meta", (lambda: torch.randn(3, 3, device="meta"), lambda m: m @ m + 1, False)
    yield "complex", (lambda: torch.randn(5, dtype=torch.complex64), lambda c: c * c.conj() + 1, True)
    yield "conj_view", (lambda: torch.randn(5, dtype=torch.complex64).conj(), lambda c: c + 1, True)
    yield "neg_view", (lambda: torch.randn(5, dtype=torch.complex64).conj().imag, lambda c: c * 2, True)
    yield "zero_size", (lambda: torch.empty(0, 3), lambda z: (z + 1).sum(0), True)
    yield "inference", (_inference_tensor, lambda i: i * 2 + 1, True)
    yield "function_subclass", (lambda: torch.randn(3).as_subclass(FunctionSubclass), lambda s: s * 2, False)
    yield "dispatch_wrapper", (lambda: DispatchWrapper(torch.randn(3)), lambda w: w * 2 + 1, False)
    make_fake, fake_op = _fake_case()
    yield "fake", (make_fake, fake_op, False)
    yield "float8", (lambda: torch.randn(5).to(torch.float8_e4m3fn), lambda f: f.float() + 1, True)
    yield "bool", (lambda: torch.randn(5) > 0, lambda b: b & ~b, True)


CASES = dict(_cases())
BLOCKS = ["md5", "fast", "check_numerics"]


def _comparable(x: Any) -> Any:
    """What the user got, as plain values (or a description where there are none)."""
    if isinstance(x, DispatchWrapper):
        return _comparable(x.elem)
    if type(x).__name__ == "FakeTensor" or (isinstance(x, torch.Tensor) and x.is_meta):
        return ("no data", tuple(x.shape), x.dtype)
    if isinstance(x, torch.Tensor) and x.is_nested:
        return [_comparable(c) for c in x.unbind()]
    if isinstance(x, torch.Tensor):
        return x.as_subclass(torch.Tensor).resolve_conj().resolve_neg().tolist()
    return x


def _block(kind: str, out: str) -> Any:
    if kind == "check_numerics":
        return tracer.check_numerics(out=out)
    return tracer.trace(hash=kind, out=out)  # type: ignore[arg-type]


def reference_md5(t: torch.Tensor) -> str:
    x = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return hashlib.md5(x.view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("kind", sorted(CASES))
def test_tensor_kind_is_recorded_or_noted(kind: str, block: str, tmp_path: Any) -> None:
    make, op, hashed = CASES[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own prototype warnings (nested, sparse)
        x = make()
        expected = _comparable(op(x))  # (no op here changes its input)
        streamed = str(tmp_path / "s.gtrace")
        with _block(block, streamed) as t:
            got = op(x)
    assert _comparable(got) == expected
    assert t.status == "ok" and t.calls
    assert all(c.error is None for c in t.calls)
    assert "input0" in t.tensors
    for rec in t.tensors.values():
        assert all(type(v) is int and v >= 0 for v in rec.shape), rec
        assert rec.stride is None or all(type(v) is int for v in rec.stride), rec
        if block == "check_numerics":
            continue
        checksum = rec.md5 if block == "md5" else rec.fingerprint
        if checksum is None:
            assert rec.hash_note is not None and rec.hash_note.startswith("not hashed: "), rec
            assert not hashed or rec.uninitialized, f"{kind}: {rec.name} should have been hashed: {rec.hash_note}"
    if block == "md5" and hashed:
        assert t["input0"].md5 == reference_md5(x.as_subclass(torch.Tensor))
    saved = tmp_path / "t.gtrace"
    t.save(saved)
    for path in (saved, streamed):
        back = tracer.load(path)
        assert back.status == "ok"
        assert [c.name for c in back.calls] == [c.name for c in t.calls]
        assert {n: r.hash_note for n, r in back.tensors.items()} == {n: r.hash_note for n, r in t.tensors.items()}


def test_nested_tensor_records_say_their_ragged_size_is_zero() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
        j = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
        with tracer.trace() as t:
            n * 2
            j * 2
    assert t["input0"].shape == (2, 0, 3) and t["input0"].stride is None
    assert t["input1"].shape == (2, 0, 3) and t["input1"].stride is None
    assert t["input0"].hash_note == t["input1"].hash_note == (
        "not hashed: nested tensor (a size that varies between its components is recorded as 0)")


def test_dtensor_is_recorded_through_its_local_shard(tmp_path: Any) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    tensor_mod = pytest.importorskip("torch.distributed.tensor")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = tensor_mod.DeviceMesh("cpu", [0])
        local = torch.randn(4, 4)
        d = tensor_mod.distribute_tensor(local, mesh, [tensor_mod.Shard(0)])
        expected = (d * 2 + 1).full_tensor()
        for block in BLOCKS:
            with _block(block, str(tmp_path / f"{block}.gtrace")) as t:
                got = d * 2 + 1
            assert torch.equal(got.full_tensor(), expected)
            # Hashed through its local shard (the whole tensor on one rank), its layout beside it.
            rec = t["input0"]
            assert rec.hash_note is None and rec.sharding is not None
            assert (rec.sharding.placements, rec.sharding.local_shape) == (("Shard(0)",), (4, 4))
            if block == "md5":
                assert rec.md5 == reference_md5(local)
            else:
                assert rec.md5 is None and (rec.fingerprint is not None) == (block == "fast")
            assert len(tracer.load(tmp_path / f"{block}.rank0.gtrace").calls) == len(t.calls)  # a file per rank
    finally:
        dist.destroy_process_group()
