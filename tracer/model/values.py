"""Kept tensor values (``trace(keep_values=...)``) as data: how they are written, checked and read.

A kept value is the tensor's logical contents in its own dtype, row-major, as raw little-endian
bytes (what the MD5 checksum covers). In the file it is base64 text in the tensor record's
``values`` field; in memory, ``TensorRecord.values`` holds the bytes. Nothing here executes what
it reads: the text is decoded as base64 and its length checked against the record's dtype and
shape, nothing else.

``as_floats`` reads the bytes back as Python floats (no torch, no numpy: ``gradtrace diff`` runs
where neither is installed), for element-wise differences.
"""

from __future__ import annotations

import base64
import binascii
import struct
import sys
from array import array

# Bytes per element of every dtype whose values may be kept. A dtype not here is never kept
# (the recorder leaves a note) and a file that keeps one is refused.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}

# ``array`` type codes of the dtypes read as numbers by ``as_floats`` (complex: real and
# imaginary parts as two floats, like the stats); float8 is compared byte for byte only.
_ARRAY_CODES: dict[str, str] = {
    "float64": "d", "float32": "f", "complex128": "d", "complex64": "f",
    "int64": "q", "int32": "i", "int16": "h", "int8": "b",
    "uint64": "Q", "uint32": "I", "uint16": "H", "uint8": "B", "bool": "B",
}


def expected_bytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """The byte length of a value of ``dtype`` and ``shape``, or None for a dtype never kept."""
    size = DTYPE_SIZES.get(dtype)
    if size is None:
        return None
    n = size
    for s in shape:
        n *= s
    return n


def encode_values(data: bytes) -> str:
    """The file form of kept bytes: standard base64 with padding."""
    return base64.b64encode(data).decode("ascii")


def decode_values(text: object, dtype: str, shape: tuple[int, ...]) -> bytes:
    """The bytes of a ``values`` field, checked: base64 text whose decoded length is exactly
    ``itemsize(dtype) * numel(shape)``. Raises ``ValueError`` saying what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"'values' must be base64 text, got {type(text).__name__}")
    want = expected_bytes(dtype, shape)
    if want is None:
        raise ValueError(f"'values' of dtype {dtype[:40]!r} cannot be checked (no known element size)")
    # Checked before decoding: a hostile length costs nothing to refuse.
    if len(text) != 4 * ((want + 2) // 3):
        raise ValueError(f"'values' holds {len(text)} base64 characters, but {dtype} {list(shape)} "
                         f"needs {want} bytes ({4 * ((want + 2) // 3)} characters)")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("'values' is not valid base64") from None
    if len(data) != want:
        raise ValueError(f"'values' decodes to {len(data)} bytes, but {dtype} {list(shape)} needs {want}")
    return data


def _bfloat16(data: bytes) -> array[float]:
    halves = array("H")
    halves.frombytes(data)
    if sys.byteorder == "big":
        halves.byteswap()
    words = array("I", (h << 16 for h in halves))  # a bfloat16 is the top half of a float32
    out = array("f")
    out.frombytes(words.tobytes())
    return out


def as_floats(data: bytes, dtype: str) -> array[float] | array[int] | tuple[float, ...] | None:
    """The elements of kept bytes as numbers (complex: real and imaginary parts in turn), or None
    for a dtype read only as bytes (float8)."""
    if dtype == "bfloat16":
        return _bfloat16(data)
    if dtype == "float16":
        return struct.unpack(f"<{len(data) // 2}e", data)
    code = _ARRAY_CODES.get(dtype)
    if code is None:
        return None
    out = array(code)
    out.frombytes(data)
    if sys.byteorder == "big" and out.itemsize > 1:
        out.byteswap()
    return out


__all__ = ["DTYPE_SIZES", "as_floats", "decode_values", "encode_values", "expected_bytes"]
