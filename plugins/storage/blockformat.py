"""The stored value of one (block, PP stage, head shard): a fixed header, then the payload.

One value holds every layer of a stage for one block and head shard. The payload is, for each
layer in order, the block's elements in the *writer's* per-block memory order, named in the
header (`order`: `k` K/V, `t` tokens, `h` heads, `d` head_size; e.g. `kthd` for vLLM's
FlashAttention NHD, `khtd` for HND, `td` for an MLA latent), raw little-endian `dtype`. So
an engine writes and reads its own blocks without reordering a byte (the IO goes straight
between the KV cache and the store), and a reader with another layout, TP shard or block size
converts from the order the header names. A layout that keeps K in another order than V
(vLLM-CPU) names K's in `k_order`. The header (little-endian, `HEADER.size` = 64 bytes, so a
payload read into one buffer is aligned for every dtype):

| field | type | meaning |
|---|---|---|
| magic | 4 bytes | `KVXB` |
| version | u16 | `FORMAT_VERSION` (3; values of versions 1 and 2 are refused) |
| header_len | u16 | bytes before the payload |
| dtype | u8 | `DTYPE_CODES` |
| kv_parts | u8 | 2 (K, V) or 1 (MLA) |
| flags | u16 | bit 0: MLA |
| order | 4 bytes | per-layer element order of the payload (V's if K differs), NUL-padded |
| k_order | 4 bytes | K's order, the same as `order` unless the writer keeps K differently |
| block_size | u32 | tokens |
| head_size | u32 | elements per head |
| total_heads | u16 | the model's KV heads |
| head_start, head_end | u16, u16 | global heads of this shard |
| layer_start, layer_end | u16, u16 | global layer indices of this stage |
| total_layers | u16 | the model's layers |
| layer_set | 8 bytes | hash of the stage's layer names (`keys.layer_set_hash`) |
| payload_len | u64 | bytes |
| checksum | u64 | XXH3-64 of (storage key, header before the checksum, payload) |

The checksum detects corruption (it is not a MAC against a writer who means harm) and binds a
value to its key, so a value under the wrong name is refused too. With `integrity: "mac"` the
same field holds a keyed BLAKE2b-64 of the same bytes instead (`mac_key`, from the config's
`mac_secret`), so a value written without the key is refused as well. Data read back is
untrusted: every field is checked against what the reader expects before the payload is
touched; nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cache

import torch
import xxhash

from kvx.layouts import Layout

_hash_buffers: Callable[[Sequence[bytes | memoryview]], int] | None
try:  # XXH3 over many buffers without the GIL (built when the system has xxhash.h)
    from kvx.plugins.storage._fileio import hash_buffers as _hash_buffers
except ImportError:  # pragma: no cover - every `make` install builds it
    _hash_buffers = None

MAGIC = b"KVXB"
FORMAT_VERSION = 3
FLAG_MLA = 1
HEADER = struct.Struct("<4sHHBBH4s4sIIHHHHHH8sQQ")
CHECKSUM = struct.Struct("<Q")
MAX_VALUE_BYTES = 512 << 20  # a Redis value's limit
MAX_FIELD = 0xFFFF  # heads and layers are u16 in the header
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
ORDER_CODES = {"kv": "k", "tokens": "t", "heads": "h", "head_size": "d"}  # kvx.layouts dims
_DIMS = {code: dim for dim, code in ORDER_CODES.items()}
KV_ORDER = "kthd"  # what an NHD writer stores (token-major per K/V half)
MLA_ORDER = "td"
_NAMES = (
    "magic",
    "version",
    "header_len",
    "dtype",
    "kv_parts",
    "flags",
    "order",
    "k_order",
    "block_size",
    "head_size",
    "total_heads",
    "head_start",
    "head_end",
    "layer_start",
    "layer_end",
    "total_layers",
    "layer_set",
    "payload_len",
)
_ORDER_FIELDS = (_NAMES.index("order"), _NAMES.index("k_order"))

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("the kvx storage block format needs a little-endian machine")


class BlockFormatError(ValueError):
    """A stored value is missing, torn, corrupt or not what the reader expects."""


class NotStoredError(BlockFormatError):
    """A stored value is missing (counted as a store miss, not as corruption)."""


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
    order: str = KV_ORDER
    k_order: str = ""  # "" = the same as `order`

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
    def tensor_shape(self) -> tuple[int, ...]:
        """`[layers, *the order's dims]` (for a split order, each half's bytes fit it too)."""
        sizes = {"k": self.kv_parts, "t": self.block_size, "h": len(self.heads)}
        return (len(self.layers), *(sizes.get(c, self.head_size) for c in self.order))

    @property
    def layout(self) -> Layout:
        """The payload of one layer, as a layout of `[blocks, *order]` (for `convert_blocks`)."""
        return stored_layout(self.order, self.k_order or self.order)


def block_order(layout: Layout) -> tuple[str, str]:
    """`(order, k_order)` of one block of `layout`: its memory order without `blocks` (the
    bytes of a block read front to back), and K's when the layout keeps K differently."""
    if layout.is_cross_layer:
        raise ValueError(f"layout {layout.name!r} holds every layer; stored values are per layer")
    order = "".join(ORDER_CODES[d] for d in layout.memory if d != "blocks")
    k_memory = layout.k_memory or layout.memory
    return order, "".join(ORDER_CODES[d] for d in k_memory if d != "blocks")


@cache
def stored_layout(order: str, k_order: str) -> Layout:
    """The layout of a stack of stored blocks: `[blocks, *order]`, K as `k_order`."""
    memory = ("blocks", *(_DIMS[c] for c in order))
    k_memory = ("blocks", *(_DIMS[c] for c in k_order)) if k_order != order else ()
    return Layout(
        f"KVX_STORED_{order}" + (f"_K{k_order}" if k_memory else ""),
        shape=memory,
        memory=memory,
        k_memory=k_memory,
        tp_dim="heads" if "heads" in memory else None,
        summary=f"stored KV blocks, per block {order}" + (f" (K {k_order})" if k_memory else ""),
    )


def checksum_seed(key: str, shape: BlockShape) -> bytes:
    """What a value's checksum covers before the payload: XXH3-64 of this, then the payload,
    is the checksum (for writers that hash as they write; see `header_prefix`)."""
    return key.encode() + header_prefix(shape)


def header_from(shape: BlockShape, checksum: int) -> bytes:
    """The header of a value of `shape` whose checksum is known."""
    return header_prefix(shape) + CHECKSUM.pack(checksum)


def header(
    key: str,
    shape: BlockShape,
    payload: Iterable[memoryview | bytes],
    mac_key: bytes | None = None,
) -> bytes:
    """The header of the value of `shape` under `key` whose payload is the concatenation of
    `payload` (its checksum keyed with `mac_key` when given)."""
    return header_from(shape, _digest(key, header_prefix(shape), payload, mac_key))


def seal(key: str, shape: BlockShape, value: memoryview, mac_key: bytes | None = None) -> None:
    """Write the header into `value[:HEADER.size]`; the payload must be in place after it
    (`value` is exactly `shape.value_bytes` long)."""
    if len(value) != shape.value_bytes:
        raise ValueError(f"{key}: value buffer is {len(value)} bytes, expected {shape.value_bytes}")
    value[: HEADER.size] = header(key, shape, [value[HEADER.size :]], mac_key)


def read_header(key: str, data: bytes | bytearray | memoryview, expect: BlockShape) -> BlockShape:
    """The shape the header at the start of `data` describes: `expect` with the stored order.
    Raise `BlockFormatError` if any other field differs from `expect`, or the order is not one
    of `expect`'s dims."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise BlockFormatError(f"{key}: {len(view)} bytes is shorter than the header")
    *fields, _ = HEADER.unpack_from(view)
    if tuple(fields) == _fields(expect):
        return expect  # the common case, checked at once
    orders = [fields[i].rstrip(b"\0").decode("ascii", "replace") for i in _ORDER_FIELDS]
    wanted = list(_fields(expect))
    for i, order in zip(_ORDER_FIELDS, orders, strict=True):
        if sorted(order) != sorted(expect.order):
            raise BlockFormatError(
                f"{key}: header {_NAMES[i]} is {order!r}; expected an order of {expect.order!r}"
            )
        wanted[i] = fields[i]
    for name, got, want in zip(_NAMES, fields, wanted, strict=True):
        if got != want:
            raise BlockFormatError(f"{key}: header {name} is {got!r}, expected {want!r}")
    order, k_order = orders
    try:
        stored_layout(order, k_order)
    except ValueError:
        raise BlockFormatError(
            f"{key}: header k_order {k_order!r} does not fit order {order!r}"
        ) from None
    return replace(expect, order=order, k_order="" if k_order == order else k_order)


CHECKSUM_SPAN = (HEADER.size - CHECKSUM.size, HEADER.size)
"""Where a value keeps its checksum (the checksum covers the key, then every other byte)."""


def stored_checksum(head: bytes | bytearray | memoryview) -> int:
    """The checksum in a value's header."""
    (stored,) = CHECKSUM.unpack_from(memoryview(head).cast("B"), CHECKSUM_SPAN[0])
    return int(stored)


def checksum_ok(
    key: str,
    head: bytes | bytearray | memoryview,
    payload: Iterable[memoryview],
    mac_key: bytes | None = None,
) -> bool:
    """True if the checksum in `head` (a value's header) matches `key`, the header and the
    concatenation of `payload` (keyed with `mac_key` when given)."""
    view = memoryview(head).cast("B")[: HEADER.size]
    digest = _digest(key, view[: CHECKSUM_SPAN[0]], payload, mac_key)
    if mac_key is not None:
        return hmac.compare_digest(CHECKSUM.pack(digest), CHECKSUM.pack(stored_checksum(view)))
    return digest == stored_checksum(view)


def check_value(
    key: str,
    data: bytes | bytearray | memoryview | None,
    expect: BlockShape,
    *,
    verify: bool,
    mac_key: bytes | None = None,
) -> tuple[BlockShape, memoryview]:
    """The stored shape and payload (a view into `data`) of a whole value; raise
    `BlockFormatError` if it is absent, torn, corrupt or of another shape, dtype, head range or
    layer set (only the element order may differ from `expect`)."""
    if data is None:
        raise NotStoredError(f"{key}: not stored")
    view = memoryview(data).cast("B")
    shape = read_header(key, view, expect)
    if len(view) != expect.value_bytes:
        raise BlockFormatError(
            f"{key}: value is {len(view)} bytes, expected {expect.value_bytes} (torn or padded)"
        )
    payload = view[HEADER.size :]
    if verify and not checksum_ok(key, view, [payload], mac_key):
        raise BlockFormatError(mismatch(key, mac_key))
    return shape, payload


def mismatch(key: str, mac_key: bytes | None) -> str:
    """What a value whose checksum (or MAC) does not verify is."""
    if mac_key is None:
        return f"{key}: checksum mismatch (corrupt value)"
    return f"{key}: MAC mismatch (corrupt, or not written with this store's mac_secret)"


def encode_block(key: str, shape: BlockShape, tensor: torch.Tensor) -> bytes:
    """Header + payload of `tensor` (`shape.tensor_shape`, `shape.dtype`) stored under `key`."""
    if tuple(tensor.shape) != shape.tensor_shape or str(tensor.dtype) != f"torch.{shape.dtype}":
        raise ValueError(
            f"block tensor {tuple(tensor.shape)} {tensor.dtype} does not match "
            f"{shape.tensor_shape} {shape.dtype}"
        )
    payload = tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().data
    return header(key, shape, [payload]) + bytes(payload)


def decode_block(
    key: str, data: bytes | bytearray | memoryview | None, expect: BlockShape, *, verify: bool
) -> torch.Tensor:
    """The payload of a value as a tensor of the stored shape's `tensor_shape` (a view of
    `data`; read it only); raise `BlockFormatError` as `check_value` does."""
    shape, payload = check_value(key, data, expect, verify=verify)
    with warnings.catch_warnings():  # a read-only buffer: the tensor is only ever read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=getattr(torch, expect.dtype))
    return flat.view(shape.tensor_shape)


def _digest(
    key: str,
    prefix: bytes | memoryview,
    payload: Iterable[memoryview | bytes],
    mac_key: bytes | None = None,
) -> int:
    if mac_key is not None:  # keyed: only holders of the key make a value that verifies
        mac = hashlib.blake2b(key.encode(), digest_size=CHECKSUM.size, key=mac_key)
        mac.update(prefix)
        for chunk in payload:
            mac.update(chunk)
        return int.from_bytes(mac.digest(), "little")
    if _hash_buffers is not None:  # one call, without the GIL: IO threads hash side by side
        return int(_hash_buffers([key.encode(), prefix, *payload]))
    hasher = xxhash.xxh3_64(key.encode())
    hasher.update(prefix)
    for chunk in payload:
        hasher.update(chunk)
    return int(hasher.intdigest())


@cache
def header_prefix(shape: BlockShape) -> bytes:
    """A value's header up to its checksum, which follows as 8 little-endian bytes."""
    return HEADER.pack(*_fields(shape), 0)[: -CHECKSUM.size]


@cache
def _fields(shape: BlockShape) -> tuple[object, ...]:
    if shape.dtype not in DTYPE_CODES:
        raise ValueError(
            f"dtype {shape.dtype!r} cannot be stored; supported: {', '.join(DTYPE_CODES)}"
        )
    if shape.value_bytes > MAX_VALUE_BYTES:
        raise ValueError(
            f"a stored value of {shape.value_bytes} bytes exceeds {MAX_VALUE_BYTES} bytes"
        )
    if max(shape.total_heads, shape.total_layers) > MAX_FIELD:
        raise ValueError(
            f"{shape.total_heads} KV heads / {shape.total_layers} layers: the storage format "
            f"holds at most {MAX_FIELD} of each"
        )
    return (
        MAGIC,
        FORMAT_VERSION,
        HEADER.size,
        DTYPE_CODES[shape.dtype],
        shape.kv_parts,
        FLAG_MLA if shape.mla else 0,
        shape.order.encode(),
        (shape.k_order or shape.order).encode(),
        shape.block_size,
        shape.head_size,
        shape.total_heads,
        shape.heads.start,
        shape.heads.stop,
        shape.layers.start,
        shape.layers.stop,
        shape.total_layers,
        shape.layer_set,
        shape.payload_bytes,
    )
