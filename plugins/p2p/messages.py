"""The P2P control messages: typed msgpack (never pickle), every field bounded, sealed with
the shared secret when one is set (kvx.wire). A request travels in an `Envelope` (nonce and
timestamp for the replay guard); a reply is sealed over the nonce of the request it answers.

Multipart frames on the wire: `[sealed envelope, *data frames]` from the DEALER, and
`[sealed reply, *data frames]` back. Data frames exist only on the CPU plane and only where the
header announced them, with exactly the announced size. On the CPU plane P pushes a (peer,
layer)'s slices as one `PutBatch` (up to `MAX_BATCH` slices, their frames one after another)
answered by one reply naming the slices refused.
"""

from __future__ import annotations

import os
import time
from typing import Annotated

import msgspec

from kvx.wire import WireError, decode_sealed, encode, seal

REQUEST_DOMAIN = b"kvx-p2p-request-v1"
REPLY_DOMAIN = b"kvx-p2p-reply-v1"
MAX_CONTROL_BYTES = 64 << 10
"""Largest control frame either side decodes."""
NONCE_BYTES = 16
MAX_BATCH = 256
"""Slices one `PutBatch` announces."""
MAX_SEGMENTS = 256
"""Data frames one slice may travel in (tensors.MAX_SEGMENTS)."""
REFUSAL_CHARS = 200
"""Length of one slice's refusal in a batch reply, in UTF-8 bytes as the listener cuts it (all
of them fit MAX_CONTROL_BYTES)."""
MAX_DIGESTS = 6144
"""Block digests one slice's meta may carry (6144 of them fit a control frame)."""
DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "float8_e4m3fn")

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Small = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Digest = Annotated[int, msgspec.Meta(ge=0)]  # msgpack holds at most a uint64


class Geometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine's KV shape, as a worker tells its peers in the HELLO reply."""

    tp_size: Positive
    pp_size: Positive
    num_kv_heads: Positive
    head_size: Positive
    block_size: Positive
    layout: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    dtype: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    is_mla: bool
    num_layers: Positive


class TensorMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One (request, layer) slice of KV: `num_blocks` blocks in `layout` with `block_size`
    tokens, `num_heads` heads starting at global head `first_head`, of which the first
    `num_tokens` tokens count. `src_rank` is the sender's TP rank. The slice's first block is
    the request's block `first_block`: the blocks before it were outside P's sliding window
    (null in its table) and are not sent. `digests`: XXH3-64 of each block's bytes as sent
    (P's `verify_transfers`; empty when off), one per block: D checks what landed against
    them."""

    request_id: Name
    layer: Name
    src_rank: Small
    first_head: Small
    num_heads: Small
    head_size: Positive
    block_size: Positive
    num_blocks: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]
    num_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
    layout: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    dtype: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
    first_block: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 0
    digests: Annotated[list[Digest], msgspec.Meta(max_length=MAX_DIGESTS)] = []

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.digests and len(self.digests) != self.num_blocks:
            raise ValueError(
                f"digests: {len(self.digests)} for {self.num_blocks} blocks (one per block)"
            )
        blocks = self.first_block + self.num_blocks
        if self.num_tokens > blocks * self.block_size:
            raise ValueError(
                f"{self.num_tokens} tokens do not fit blocks {self.first_block}..{blocks} "
                f"of {self.block_size}"
            )
        if self.first_block and self.num_tokens <= self.first_block * self.block_size:
            raise ValueError(
                f"first_block {self.first_block}: the slice's {self.num_tokens} tokens end "
                "before its first block"
            )


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """First contact from a DEALER: which data plane it speaks, and (NCCL) the unique id of the
    two-rank communicator, in which the sender is rank 0 and the receiver rank 1."""

    plane: Annotated[str, msgspec.Meta(max_length=16)]
    unique_id: Annotated[bytes, msgspec.Meta(max_length=128)] = b""


class Put(msgspec.Struct, tag="put", forbid_unknown_fields=True):
    """P pushes one tensor (its bytes follow as one frame, or over NCCL after the reply)."""

    meta: TensorMeta


class PutBatch(msgspec.Struct, tag="put_batch", forbid_unknown_fields=True):
    """P pushes several tensors (CPU plane): slice i's bytes are the next `frames[i]` data
    frames, in order, behind the envelope."""

    metas: Annotated[list[TensorMeta], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]
    frames: Annotated[
        list[Annotated[int, msgspec.Meta(ge=1, le=MAX_SEGMENTS)]],
        msgspec.Meta(min_length=1, max_length=MAX_BATCH),
    ]

    def __post_init__(self) -> None:
        if len(self.frames) != len(self.metas):
            raise ValueError(
                f"frames: {len(self.frames)} counts for {len(self.metas)} slices announced"
            )


class Refusal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Slice `index` of a `PutBatch` did not land, and why."""

    index: Annotated[int, msgspec.Meta(ge=0, lt=MAX_BATCH)]
    why: Annotated[str, msgspec.Meta(max_length=REFUSAL_CHARS)]


class Get(msgspec.Struct, tag="get", forbid_unknown_fields=True):
    """D pulls heads `first_head..+num_heads` (global ids) of a (request, layer) P stored;
    `readers`: how many D workers read this P worker's copy (P drops it after that many)."""

    request_id: Name
    layer: Name
    first_head: Small
    num_heads: Small
    readers: Positive


Request = Hello | Put | PutBatch | Get
"""What a DEALER asks a listener."""


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    nonce: Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
    timestamp: float
    message: Request


class Reply(msgspec.Struct, forbid_unknown_fields=True):
    """`ok` or why not (`error`); a HELLO reply carries the receiver's geometry, a GET reply
    the meta of the tensor that follows, a `PutBatch` reply (ok: the batch was read) the slices
    that did not land."""

    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    geometry: Geometry | None = None
    meta: TensorMeta | None = None
    refused: Annotated[list[Refusal], msgspec.Meta(max_length=MAX_BATCH)] = []


def seal_request(secret: str | None, message: Request) -> tuple[bytes, bytes]:
    """(sealed envelope, its nonce)."""
    nonce = os.urandom(NONCE_BYTES)
    body = encode(Envelope(nonce, time.time(), message))
    return seal(secret, REQUEST_DOMAIN, body), nonce


def open_request(secret: str | None, frame: bytes | memoryview) -> Envelope:
    """Authenticate then decode a request; `WireError` on anything else."""
    return decode_sealed(frame, Envelope, secret, REQUEST_DOMAIN, max_bytes=MAX_CONTROL_BYTES)


def seal_reply(secret: str | None, nonce: bytes, reply: Reply) -> bytes:
    return seal(secret, REPLY_DOMAIN, encode(reply), nonce)


def open_reply(secret: str | None, nonce: bytes, frame: bytes | memoryview) -> Reply:
    return decode_sealed(frame, Reply, secret, REPLY_DOMAIN, nonce, max_bytes=MAX_CONTROL_BYTES)


__all__ = [
    "MAX_BATCH",
    "MAX_CONTROL_BYTES",
    "MAX_DIGESTS",
    "Envelope",
    "Geometry",
    "Get",
    "Hello",
    "Put",
    "PutBatch",
    "Refusal",
    "Reply",
    "TensorMeta",
    "WireError",
    "open_reply",
    "open_request",
    "seal_reply",
    "seal_request",
]
