"""What crosses the side channel and NIXL notifications: typed msgpack, bounded, never pickle.

D asks P's scheduler for one worker's payload (`HandshakeRequest`); the reply
(`HandshakePayload`) is decoded in two phases, as vLLM does: first the envelope with the
compatibility hash, and only if that matches, the agent metadata inside it (`AgentMetadata`).
Every field a peer sends has a bound in its type, so `kvx.wire.decode` refuses what is out of
range. With a shared secret every message is sealed (`kvx.wire.seal`): its tag is checked
before anything is decoded, a reply is bound to the nonce of its request, and requests carry a
timestamp so P refuses replays (`kvx.wire.ReplayGuard`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal

import msgspec

from kvx import CONTRACT_VERSION, EngineContext
from kvx.wire import decode_sealed, encode, seal

NIXL_CONNECTOR_VERSION = 2
"""Bumped whenever the handshake or notification format changes (part of the compat hash)."""
MAX_REQUEST_BYTES = 4096
MAX_NOTIF_BYTES = 1 << 20
NONCE_BYTES = 16
MAX_RANK = 1 << 12
"""Largest TP or PP size (and rank + 1) a peer may claim."""
MAX_REGIONS = 1 << 14
MAX_NAME = 1024
"""Longest engine id, layer name or request id a peer may send."""
MAX_NOTIFIERS = 1 << 12
"""Largest number of `done` notifications a peer may say P should wait for."""
MAX_IDS_PER_NOTIFICATION = 1 << 13
REQUEST_DOMAIN = b"kvx-nixl-handshake-request"
REPLY_DOMAIN = b"kvx-nixl-handshake-reply"
NOTIFICATION_DOMAIN = b"kvx-nixl-notification"
REPLY_OK, REPLY_REFUSED = b"K", b"E"
"""First byte of a side-channel reply: a (sealed) `HandshakePayload`, or a refusal as text."""

MAX_HEADS = 1 << 16
"""KV heads a worker may hold (a bound on what a peer names)."""
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANK)]
Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANK)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]


class HandshakeError(RuntimeError):
    """A handshake with a remote engine failed; the message says which check and why."""


class HandshakeRequest(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """D asks for worker (`pp_rank`, `tp_rank`)'s payload; `timestamp` is D's wall clock."""

    kind: Annotated[str, msgspec.Meta(max_length=64)]
    pp_rank: Rank
    tp_rank: Rank
    nonce: Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
    timestamp: float


class DigestRequest(HandshakeRequest, array_like=True, forbid_unknown_fields=True):
    """D asks (`get_digests`) for worker (`pp_rank`, `tp_rank`)'s block digests of P's request
    `request_id` (`verify_transfers`), of the heads `first_head`.. of that worker's own that D
    holds (`num_heads` of them); a P without it refuses it as a bad request, a P whose worker
    has not those heads refuses the range."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    first_head: Annotated[int, msgspec.Meta(ge=0, lt=MAX_HEADS)]
    num_heads: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEADS)]


class Region(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One registered memory region: a layer's K or V slice (`kv` 0/1), or its whole
    blocks-first tensor (`kv` -1); blocks are `block_len` bytes apart from `base_addr`."""

    layer: Name
    kv: Literal[-1, 0, 1]
    base_addr: Annotated[int, msgspec.Meta(ge=0)]
    block_len: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=1 << 32)]


class AgentMetadata(msgspec.Struct, forbid_unknown_fields=True):
    """One worker's NIXL agent and KV geometry (vLLM's `NixlAgentMetadata`, engine-neutral)."""

    engine_id: Name
    agent_metadata: bytes
    pp_rank: Rank
    tp_rank: Rank
    tp_size: Size
    pp_size: Size
    num_kv_heads: Positive
    head_size: Positive
    block_size: Positive
    layout: Annotated[str, msgspec.Meta(max_length=64)]
    dtype: Annotated[str, msgspec.Meta(max_length=64)]
    is_mla: bool
    regions: Annotated[list[Region], msgspec.Meta(min_length=1, max_length=MAX_REGIONS)]
    device_id: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"


class HandshakePayload(msgspec.Struct, forbid_unknown_fields=True):
    """The reply envelope; `agent_metadata_bytes` is only decoded after the hash matched."""

    compatibility_hash: Annotated[str, msgspec.Meta(max_length=128)]
    factors: Annotated[
        dict[Annotated[str, msgspec.Meta(max_length=64)], Name], msgspec.Meta(max_length=64)
    ]
    agent_metadata_bytes: bytes


class Notification(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """D to P over NIXL: `done` (read finished; P frees after `count` of them, one per reader)
    or `heartbeat` (D still intends to read: extend the lease)."""

    kind: Literal["done", "heartbeat"]
    request_ids: Annotated[list[Name], msgspec.Meta(max_length=MAX_IDS_PER_NOTIFICATION)]
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_NOTIFIERS)] = 1


def seal_notification(secret: str | None, note: Notification) -> bytes:
    return seal(secret, NOTIFICATION_DOMAIN, encode(note))


def open_notification(secret: str | None, data: bytes) -> Notification:
    """Authenticate (with a secret) then decode a notification; `WireError` if either fails."""
    return decode_sealed(data, Notification, secret, NOTIFICATION_DOMAIN, max_bytes=MAX_NOTIF_BYTES)


def compatibility_factors(ctx: EngineContext, transfer_mode: str = "pull") -> dict[str, str]:
    """What must be equal on P and D for KV bytes to be interchangeable. TP size, block size
    and layout are not in it: they may differ and are validated against the plan instead
    (matches vLLM's compatibility hash). An engine with several KV-cache groups adds their
    layer assignment: its P hands D one table per group."""
    cache = ctx.cache
    factors = {
        "model": ctx.model_name,
        "dtype": cache.dtype,
        "num_kv_heads": str(cache.num_kv_heads),
        "head_size": str(cache.head_size),
        "num_layers": str(cache.num_layers),
        "use_mla": str(cache.use_mla),
        "kvx_contract": ".".join(map(str, CONTRACT_VERSION)),
        "connector_version": str(NIXL_CONNECTOR_VERSION),
        "transfer_mode": transfer_mode,
    }
    if cache.num_groups > 1:
        factors["kv_groups"] = ",".join(map(str, cache.layer_groups))
    return factors


def compatibility_hash(factors: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def differing_factors(local: dict[str, str], remote: dict[str, str]) -> str:
    """`dtype (local 'float32', remote 'bfloat16')`-style list of what differs."""
    names = sorted(set(local) | set(remote))
    return ", ".join(
        f"{n} (local {local.get(n)!r}, remote {remote.get(n)!r})"
        for n in names
        if local.get(n) != remote.get(n)
    )


def rank_bytes(pp_rank: int, tp_rank: int) -> bytes:
    return f"{pp_rank}/{tp_rank}".encode()
