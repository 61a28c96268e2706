"""One encoder output as one store value: a 64-byte header naming its dtype and shape, then
the tensor's bytes (row-major). Pure functions (struct and numpy only, no torch or vLLM).

    offset  size  field
         0     4  magic b"GCEC"
         4     1  version (1)
         5     1  ndim (1..4)
         6     2  reserved (0)
         8     8  payload bytes (prod(shape) * itemsize)
        16    16  dtype name, ASCII, NUL-padded ("float32", "bfloat16", ...)
        32    32  shape, 4 x u64 (unused dims 0)

The store checksums every value (the client's verify_checksums); the header is what makes a
value that passed its checksum but was written for another shape or dtype (another engine's
bug, a key reused for other content) a miss instead of a wrong embedding: `check_value`
answers None unless the header, the length and the expectation all agree. The payload starts
at byte 64, so a value read into an aligned buffer is an aligned tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

MAGIC = b"GCEC"
VERSION = 1
HEADER_BYTES = 64
NDIM_MAX = 4
_FMT = struct.Struct("<4sBBHQ16s4Q")
if _FMT.size != HEADER_BYTES:  # the format string and the documented size must agree
    raise RuntimeError(f"header format is {_FMT.size} bytes, not {HEADER_BYTES}")

# Encoder output dtypes the value can hold (torch's names without "torch.").
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class Header(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    payload_bytes: int


def payload_bytes(dtype: str, shape: Iterable[int]) -> int:
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= int(d)
    return n


def value_bytes(dtype: str, shape: Iterable[int]) -> int:
    """The stored value's size: header plus payload."""
    return HEADER_BYTES + payload_bytes(dtype, shape)


def encode_header(dtype: str, dims: Iterable[int]) -> bytes:
    shape = tuple(int(d) for d in dims)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} cannot be stored (one of {sorted(DTYPE_BYTES)})")
    if not 1 <= len(shape) <= NDIM_MAX or any(d < 0 for d in shape):
        raise ValueError(f"shape {shape} must have 1..{NDIM_MAX} dims >= 0")
    padded = shape + (0,) * (NDIM_MAX - len(shape))
    return _FMT.pack(MAGIC, VERSION, len(shape), 0, payload_bytes(dtype, shape), dtype.encode("ascii"), *padded)


def decode_header(buf: bytes | np.ndarray) -> Header:
    """The header at the start of `buf`; ValueError if it is not one this version wrote."""
    raw = bytes(buf[:HEADER_BYTES])  # buf: bytes or a 1-D uint8 array (the scheduler's read buffers)
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"value of {len(raw)} bytes is shorter than its header")
    magic, version, ndim, _, nbytes, dtype_raw, *dims = _FMT.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not an encoder-output value (magic {magic!r}, version {version})")
    dtype = dtype_raw.rstrip(b"\0").decode("ascii", "replace")
    if dtype not in DTYPE_BYTES or not 1 <= ndim <= NDIM_MAX or any(dims[ndim:]):
        raise ValueError(f"bad header: dtype {dtype!r}, ndim {ndim}, dims {dims}")
    shape = tuple(dims[:ndim])
    if payload_bytes(dtype, shape) != nbytes:
        raise ValueError(f"bad header: {nbytes} payload bytes for {dtype} {shape}")
    return Header(dtype, shape, nbytes)


def check_value(
    buf: bytes | np.ndarray, length: int | None, dtype: str, width: int, rows: int | None = None
) -> Header | None:
    """The header of a value read into `buf` (`length` bytes) when it holds `rows` x `width`
    of `dtype` (rows None: any), else None: a miss, never a wrong tensor."""
    if length is None or length < HEADER_BYTES:
        return None
    try:
        header = decode_header(buf)
    except ValueError:
        return None
    if (
        header.dtype != dtype
        or length != HEADER_BYTES + header.payload_bytes
        or len(header.shape) < 2
        or header.shape[-1] != width
        or (rows is not None and header.shape[0] != rows)
    ):
        return None
    return header
