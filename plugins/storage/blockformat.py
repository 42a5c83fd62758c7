"""The stored value of one (block, layer, head shard): a fixed header, then the payload.

Engine-neutral: the payload is `[block_size, kv_parts, heads, head_size]` in token-major order
(kv_parts is 2, K then V, or 1 for an MLA latent), raw little-endian elements of `dtype`. The
header (little-endian, `HEADER.size` bytes) says what the payload is:

| field | type | meaning |
|---|---|---|
| magic | 4 bytes | `KVXB` |
| version | u16 | `FORMAT_VERSION` |
| header_len | u16 | bytes before the payload |
| dtype | u8 | `DTYPE_CODES` |
| kv_parts | u8 | 2 (K, V) or 1 (MLA) |
| layout | u8 | payload order; 1 = token-major `[tokens, kv, heads, head_size]` |
| flags | u8 | bit 0: MLA |
| block_size | u32 | tokens |
| total_heads | u32 | the model's KV heads |
| head_start, head_end | u32, u32 | global heads of this shard |
| head_size | u32 | elements per head |
| payload_len | u64 | bytes |
| checksum | 16 bytes | blake2b of (storage key, header before the checksum, payload) |

The checksum binds a value to its key, so a value under the wrong name is refused too. Data read
back is untrusted: every field is checked against what the reader expects before the payload is
touched; nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import warnings
from dataclasses import dataclass

import torch

MAGIC = b"KVXB"
FORMAT_VERSION = 1
LAYOUT_TOKEN_MAJOR = 1
FLAG_MLA = 1
HEADER = struct.Struct("<4sHHBBBBIIIIIQ16s")
MAX_VALUE_BYTES = 512 << 20  # a Redis value's limit; one shard of one block is far smaller
DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float64": 4,
    "int8": 5,
    "uint8": 6,
    "float8_e4m3fn": 7,
    "float8_e5m2": 8,
}
_DTYPES = {code: name for name, code in DTYPE_CODES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("the kvx storage block format needs a little-endian machine")


class BlockFormatError(ValueError):
    """A stored value is missing, torn, corrupt or not what the reader expects."""


@dataclass(frozen=True)
class BlockShape:
    """What one stored value holds (and what a reader expects)."""

    dtype: str
    block_size: int
    kv_parts: int
    total_heads: int
    heads: range
    head_size: int
    mla: bool = False

    @property
    def payload_bytes(self) -> int:
        item = getattr(torch, self.dtype).itemsize
        return self.block_size * self.kv_parts * len(self.heads) * self.head_size * item

    @property
    def value_bytes(self) -> int:
        return HEADER.size + self.payload_bytes

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        return (self.block_size, self.kv_parts, len(self.heads), self.head_size)


def _digest(key: str, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(key.encode(), digest_size=16)
    h.update(header)
    h.update(payload)
    return h.digest()


def encode_block(key: str, shape: BlockShape, tensor: torch.Tensor) -> bytes:
    """Header + payload of `tensor` (`shape.tensor_shape`, `shape.dtype`) stored under `key`."""
    if tuple(tensor.shape) != shape.tensor_shape or str(tensor.dtype) != f"torch.{shape.dtype}":
        raise ValueError(
            f"block tensor {tuple(tensor.shape)} {tensor.dtype} does not match "
            f"{shape.tensor_shape} {shape.dtype}"
        )
    payload = tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().data
    fields = _fields(shape, len(payload))
    prefix = HEADER.pack(*fields, b"\0" * 16)[:-16]
    return b"".join((prefix, _digest(key, prefix, payload), payload))  # one copy of the payload


def decode_block(
    key: str, data: bytes | bytearray | memoryview | None, expect: BlockShape, *, verify: bool
) -> torch.Tensor:
    """The payload of a value as a read-only tensor of `expect.tensor_shape`; raise
    `BlockFormatError` if it is absent, torn, corrupt or of another shape, dtype or head range."""
    if data is None:
        raise BlockFormatError(f"{key}: not stored")
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise BlockFormatError(f"{key}: {len(view)} bytes is shorter than the header")
    *fields, digest = HEADER.unpack_from(view)
    want = _fields(expect, expect.payload_bytes)
    names = (
        "magic",
        "version",
        "header_len",
        "dtype",
        "kv_parts",
        "layout",
        "flags",
        "block_size",
        "total_heads",
        "head_start",
        "head_end",
        "head_size",
        "payload_len",
    )
    for name, got, wanted in zip(names, fields, want, strict=True):
        if got != wanted:
            raise BlockFormatError(f"{key}: header {name} is {got!r}, expected {wanted!r}")
    if len(view) != expect.value_bytes:
        raise BlockFormatError(
            f"{key}: value is {len(view)} bytes, expected {expect.value_bytes} (torn or padded)"
        )
    payload = view[HEADER.size :]
    if verify and _digest(key, view[: HEADER.size - 16], payload) != digest:
        raise BlockFormatError(f"{key}: checksum mismatch (corrupt value)")
    with warnings.catch_warnings():  # read-only buffer: the tensor is only ever read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=getattr(torch, expect.dtype))
    return flat.view(expect.tensor_shape)


def _fields(shape: BlockShape, payload_len: int) -> tuple[object, ...]:
    if shape.dtype not in DTYPE_CODES:
        raise ValueError(
            f"dtype {shape.dtype!r} cannot be stored; supported: {', '.join(DTYPE_CODES)}"
        )
    if payload_len + HEADER.size > MAX_VALUE_BYTES:
        raise ValueError(f"a stored block of {payload_len} bytes exceeds {MAX_VALUE_BYTES} bytes")
    return (
        MAGIC,
        FORMAT_VERSION,
        HEADER.size,
        DTYPE_CODES[shape.dtype],
        shape.kv_parts,
        LAYOUT_TOKEN_MAJOR,
        FLAG_MLA if shape.mla else 0,
        shape.block_size,
        shape.total_heads,
        shape.heads.start,
        shape.heads.stop,
        shape.head_size,
        payload_len,
    )
