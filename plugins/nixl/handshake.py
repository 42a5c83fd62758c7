"""What crosses the side channel and NIXL notifications: typed msgpack, bounded, never pickle.

D asks P's scheduler for one worker's payload (`HandshakeRequest`); the reply
(`HandshakePayload`) is decoded in two phases, as vLLM does: first the envelope with the
compatibility hash, and only if that matches, the agent metadata inside it (`AgentMetadata`).
With a shared secret both directions carry an HMAC-SHA256 over a fresh nonce, so neither side
accepts a peer that does not know the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Literal

import msgspec

from kvx import CONTRACT_VERSION, EngineContext

NIXL_CONNECTOR_VERSION = 1
"""Bumped whenever the handshake or notification format changes (part of the compat hash)."""
MAX_REQUEST_BYTES = 4096
MAX_NOTIF_BYTES = 1 << 20


class HandshakeError(RuntimeError):
    """A handshake with a remote engine failed; the message says which check and why."""


class HandshakeRequest(msgspec.Struct, array_like=True):
    kind: str
    pp_rank: int
    tp_rank: int
    nonce: bytes
    auth: bytes = b""


class Region(msgspec.Struct, array_like=True):
    """One registered memory region: a layer's K or V slice (`kv` 0/1), or its whole
    blocks-first tensor (`kv` -1); blocks are `block_len` bytes apart from `base_addr`."""

    layer: str
    kv: int
    base_addr: int
    block_len: int
    num_blocks: int


class AgentMetadata(msgspec.Struct):
    """One worker's NIXL agent and KV geometry (vLLM's `NixlAgentMetadata`, engine-neutral)."""

    engine_id: str
    agent_metadata: bytes
    pp_rank: int
    tp_rank: int
    tp_size: int
    pp_size: int
    num_kv_heads: int
    head_size: int
    block_size: int
    layout: str
    dtype: str
    is_mla: bool
    regions: list[Region]
    device_id: int = 0
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"


class HandshakePayload(msgspec.Struct):
    """The reply envelope; `agent_metadata_bytes` is only decoded after the hash matched."""

    compatibility_hash: str = ""
    factors: dict[str, str] = msgspec.field(default_factory=dict)
    agent_metadata_bytes: bytes = b""
    auth: bytes = b""
    error: str = ""


class Notification(msgspec.Struct, array_like=True):
    """D to P over NIXL: `done` (read finished; P frees after `count` of them) or `heartbeat`
    (D still intends to read: extend the lease)."""

    kind: Literal["done", "heartbeat"]
    request_ids: list[str]
    count: int = 1


def compatibility_factors(ctx: EngineContext) -> dict[str, str]:
    """What must be equal on P and D for KV bytes to be interchangeable. TP size, block size
    and layout are not in it: they may differ and are validated against the plan instead
    (matches vLLM's compatibility hash)."""
    cache = ctx.cache
    return {
        "model": ctx.model_name,
        "dtype": cache.dtype,
        "num_kv_heads": str(cache.num_kv_heads),
        "head_size": str(cache.head_size),
        "num_layers": str(cache.num_layers),
        "use_mla": str(cache.use_mla),
        "kvx_contract": ".".join(map(str, CONTRACT_VERSION)),
        "connector_version": str(NIXL_CONNECTOR_VERSION),
        "transfer_mode": "pull",
    }


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


def sign(secret: str | None, *parts: bytes) -> bytes:
    """HMAC-SHA256 over `parts` (empty without a secret)."""
    if secret is None:
        return b""
    mac = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()


def verify(secret: str | None, auth: bytes, *parts: bytes) -> bool:
    return secret is None or hmac.compare_digest(auth, sign(secret, *parts))


def rank_bytes(pp_rank: int, tp_rank: int) -> bytes:
    return f"{pp_rank}/{tp_rank}".encode()
