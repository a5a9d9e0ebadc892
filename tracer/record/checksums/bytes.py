"""A tensor's logical contents as bytes: what is hashed, and why some tensors cannot be.

MD5 is of the tensor's logical contents in its own dtype, row-major, as bytes: equal to
``hashlib.md5(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()).hexdigest()``.
Shape and dtype are recorded beside the hash, not in it.
"""

from __future__ import annotations

import ctypes
import hashlib

import torch

from tracer.record.own_work import own_work

ALLOWED_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
# A lazy module's parameters and buffers before their first call (no data yet: not hashed).
_UNINITIALIZED: type = getattr(torch.nn.parameter, "UninitializedTensorMixin", type(None))


def plain_data(t: torch.Tensor) -> torch.Tensor | None:
    """For an instance of a tensor subclass that keeps its data as a plain tensor does (it
    overrides no ``__torch_dispatch__``: a class that tags a tensor with units or metadata, made
    with ``as_subclass``), a plain tensor on the same bytes, read the same way: what is hashed
    and summarised for it. None for any other tensor: a plain one, a wrapper subclass (DTensor,
    a fake or functional tensor: their bytes are elsewhere or nowhere), a lazy module's
    uninitialised parameter."""
    cls = type(t)
    if cls in ALLOWED_TYPES or getattr(cls, "__torch_dispatch__", None) is not _PLAIN_DISPATCH \
            or isinstance(t, _UNINITIALIZED):
        return None
    try:
        with torch._C.DisableTorchFunction():
            return t.as_subclass(torch.Tensor)
    except (RuntimeError, TypeError):
        return None


def unhashable_reason(t: torch.Tensor) -> str | None:
    """Why a tensor's bytes cannot be hashed, or None when they can."""
    if type(t) not in ALLOWED_TYPES:
        name = type(t).__name__
        if name == "FakeTensor":
            return "fake tensor (no data)"
        if name == "FunctionalTensor":
            return "functional tensor (no data)"
        return f"tensor subclass {name}"
    if t.is_meta:
        return "meta tensor (no data)"
    if t.layout != torch.strided:
        return f"{str(t.layout).replace('torch.', '')} layout"
    if t.is_quantized:
        return "quantized tensor"
    if getattr(t, "is_nested", False):
        return "nested tensor"
    if t.device.type not in ("cpu", "cuda"):
        return f"device {t.device.type} not supported for hashing"
    return None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical contents as a flat contiguous uint8 tensor on its own device."""
    x = t.detach()
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    x = x.contiguous().reshape(-1)
    if x.numel() == 1 and x.stride(0) != 1:
        # One element with a stride other than 1 (``randn(3, 2)[:1, 0]``) counts as contiguous,
        # so neither call above gives it stride 1, and a byte view of it is refused.
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(torch.uint8)


def host_bytes(b: torch.Tensor) -> memoryview:
    """A zero-copy read-only view of a contiguous CPU uint8 tensor's bytes, for hashlib.

    Not ``.numpy()``: that marks the storage non-resizable, and code such as FSDP2 resizes the
    storages of tensors the trace hashes (it failed with "Trying to resize storage that is not
    resizable"). The view is valid while ``b`` is alive, which callers guarantee.
    """
    n = b.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(b.data_ptr())).cast("B")


@own_work
def md5_of(t: torch.Tensor) -> str:
    """Synchronous reference MD5 of a tensor (copies to host). Its torch calls are gradtrace's
    own: called inside a traced block (to compare a live tensor with the trace), it records
    nothing and no mode of the program's sees them."""
    b = as_bytes(t)
    if b.device.type != "cpu":
        b = b.cpu()
    return hashlib.md5(host_bytes(b)).hexdigest()
