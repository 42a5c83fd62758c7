"""The stored value of one (block, PP stage, head shard): a fixed header, then the payload.

One value holds every layer of a stage for one block and head shard. Engine-neutral: the
payload is `[layers, block_size, kv_parts, heads, head_size]`, each layer token-major (kv_parts
is 2, K then V, or 1 for an MLA latent), raw little-endian elements of `dtype`. The header
(little-endian, `HEADER.size` = 64 bytes, so the payload is aligned for every dtype) says
what the payload is:

| field | type | meaning |
|---|---|---|
| magic | 4 bytes | `KVXB` |
| version | u16 | `FORMAT_VERSION` (2; version 1 values, one per layer, are refused) |
| header_len | u16 | bytes before the payload |
| dtype | u8 | `DTYPE_CODES` |
| kv_parts | u8 | 2 (K, V) or 1 (MLA) |
| layout | u8 | payload order; 1 = token-major `[tokens, kv, heads, head_size]` per layer |
| flags | u8 | bit 0: MLA |
| block_size | u32 | tokens |
| total_heads | u32 | the model's KV heads |
| head_start, head_end | u32, u32 | global heads of this shard |
| head_size | u32 | elements per head |
| layer_start, layer_end | u32, u32 | global layer indices of this stage |
| total_layers | u32 | the model's layers |
| layer_set | 8 bytes | hash of the stage's layer names (`keys.layer_set_hash`) |
| payload_len | u64 | bytes |
| checksum | u32 | CRC-32 of (storage key, header before the checksum, payload) |

The checksum detects corruption (it is not a MAC against a writer who means harm) and binds a
value to its key, so a value under the wrong name is refused too. Data read back is
untrusted: every field is checked against what the reader expects before the payload is
touched; nothing is ever unpickled.
"""

from __future__ import annotations

import struct
import sys
import warnings
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"KVXB"
FORMAT_VERSION = 2
LAYOUT_TOKEN_MAJOR = 1
FLAG_MLA = 1
HEADER = struct.Struct("<4sHHBBBBIIIIIIII8sQI")
CHECKSUM = struct.Struct("<I")
MAX_VALUE_BYTES = 512 << 20  # a Redis value's limit
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
_NAMES = (
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
    "layer_start",
    "layer_end",
    "total_layers",
    "layer_set",
    "payload_len",
)

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
    layers: range = range(0, 1)
    total_layers: int = 1
    layer_set: bytes = bytes(8)

    @property
    def itemsize(self) -> int:
        return int(getattr(torch, self.dtype).itemsize)

    @property
    def layer_bytes(self) -> int:
        return self.block_size * self.kv_parts * len(self.heads) * self.head_size * self.itemsize

    @property
    def payload_bytes(self) -> int:
        return len(self.layers) * self.layer_bytes

    @property
    def value_bytes(self) -> int:
        return HEADER.size + self.payload_bytes

    @property
    def tensor_shape(self) -> tuple[int, int, int, int, int]:
        return (len(self.layers), self.block_size, self.kv_parts, len(self.heads), self.head_size)


def checksum_start(key: str, shape: BlockShape) -> int:
    """The CRC state before the payload; continue it with `zlib.crc32(chunk, state)` over the
    payload in order to build a value's checksum piece by piece."""
    return zlib.crc32(_prefix(shape), zlib.crc32(key.encode()))


def seal(key: str, shape: BlockShape, value: memoryview, checksum: int | None = None) -> None:
    """Write the header and checksum into `value[:HEADER.size]`; the payload must be in place
    after it (`value` is exactly `shape.value_bytes` long). `checksum`: the running CRC from
    `checksum_start` over the whole payload, if the caller computed it as the payload came in."""
    if len(value) != shape.value_bytes:
        raise ValueError(f"{key}: value buffer is {len(value)} bytes, expected {shape.value_bytes}")
    prefix = _prefix(shape)
    value[: len(prefix)] = prefix
    if checksum is None:
        checksum = zlib.crc32(value[HEADER.size :], checksum_start(key, shape))
    CHECKSUM.pack_into(value, len(prefix), checksum)


def check_value(
    key: str, data: bytes | bytearray | memoryview | None, expect: BlockShape, *, verify: bool
) -> memoryview:
    """The payload of a value (a view into `data`); raise `BlockFormatError` if it is absent,
    torn, corrupt or of another shape, dtype, head range or layer set."""
    if data is None:
        raise BlockFormatError(f"{key}: not stored")
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise BlockFormatError(f"{key}: {len(view)} bytes is shorter than the header")
    *fields, checksum = HEADER.unpack_from(view)
    for name, got, wanted in zip(_NAMES, fields, _fields(expect), strict=True):
        if got != wanted:
            raise BlockFormatError(f"{key}: header {name} is {got!r}, expected {wanted!r}")
    if len(view) != expect.value_bytes:
        raise BlockFormatError(
            f"{key}: value is {len(view)} bytes, expected {expect.value_bytes} (torn or padded)"
        )
    payload = view[HEADER.size :]
    if verify:
        prefix = view[: HEADER.size - CHECKSUM.size]
        if zlib.crc32(payload, zlib.crc32(prefix, zlib.crc32(key.encode()))) != checksum:
            raise BlockFormatError(f"{key}: checksum mismatch (corrupt value)")
    return payload


def encode_block(key: str, shape: BlockShape, tensor: torch.Tensor) -> bytes:
    """Header + payload of `tensor` (`shape.tensor_shape`, `shape.dtype`) stored under `key`."""
    if tuple(tensor.shape) != shape.tensor_shape or str(tensor.dtype) != f"torch.{shape.dtype}":
        raise ValueError(
            f"block tensor {tuple(tensor.shape)} {tensor.dtype} does not match "
            f"{shape.tensor_shape} {shape.dtype}"
        )
    payload = tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().data
    value = bytearray(HEADER.size + len(payload))
    value[HEADER.size :] = payload
    seal(key, shape, memoryview(value))
    return bytes(value)


def decode_block(
    key: str, data: bytes | bytearray | memoryview | None, expect: BlockShape, *, verify: bool
) -> torch.Tensor:
    """The payload of a value as a tensor of `expect.tensor_shape` (a view of `data`; read it
    only); raise `BlockFormatError` as `check_value` does."""
    payload = check_value(key, data, expect, verify=verify)
    with warnings.catch_warnings():  # a read-only buffer: the tensor is only ever read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=getattr(torch, expect.dtype))
    return flat.view(expect.tensor_shape)


def _prefix(shape: BlockShape) -> bytes:
    """The header before the checksum."""
    return HEADER.pack(*_fields(shape), 0)[: -CHECKSUM.size]


def _fields(shape: BlockShape) -> tuple[object, ...]:
    if shape.dtype not in DTYPE_CODES:
        raise ValueError(
            f"dtype {shape.dtype!r} cannot be stored; supported: {', '.join(DTYPE_CODES)}"
        )
    if shape.value_bytes > MAX_VALUE_BYTES:
        raise ValueError(
            f"a stored value of {shape.value_bytes} bytes exceeds {MAX_VALUE_BYTES} bytes"
        )
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
        shape.layers.start,
        shape.layers.stop,
        shape.total_layers,
        shape.layer_set,
        shape.payload_bytes,
    )
