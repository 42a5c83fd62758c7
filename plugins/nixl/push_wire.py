"""What P and D say to each other over NIXL notifications in push mode: typed msgpack, every
field bounded, sealed with the shared secret when there is one (never pickle).

D -> P: `Register` (here are my blocks for your request: write them, then tell me),
`Heartbeat` (keep holding these requests) and `Release` (I will not register these: free
them). P -> D: `Pushed` (your blocks for this request are written, or why they are not). In
push mode every notification is one of these, so nothing is guessed from a message's bytes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kvx.plugins.nixl.handshake import (
    MAX_IDS_PER_NOTIFICATION,
    MAX_NOTIF_BYTES,
    MAX_NOTIFIERS,
    Name,
    Rank,
    Size,
)
from kvx.wire import decode_sealed, encode, seal

if TYPE_CHECKING:
    from kvx.plugins.nixl.stats import NixlKVConnectorStats

logger = logging.getLogger(__name__)

PUSH_DOMAIN = b"kvx-nixl-push"
MAX_PUSH_BLOCKS = 1 << 20
"""Most blocks one registration may name."""
MAX_REASON = 512

BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
Ids = Annotated[list[Name], msgspec.Meta(max_length=MAX_IDS_PER_NOTIFICATION)]


class Register(msgspec.Struct, tag="register", array_like=True, forbid_unknown_fields=True):
    """D worker (`pp_rank`, `tp_rank`) of engine `engine_id`, whose scheduler serves its
    handshake at `host:port`, asks P to write P's request `request_id` (blocks from the
    `first_block`-th of the prompt on) into `block_ids`, and to answer `Pushed` for D's
    `decode_request_id`. `count`: how many D workers register with this P worker (P frees its
    blocks after that many)."""

    request_id: Name
    decode_request_id: Name
    block_ids: Annotated[list[BlockId], msgspec.Meta(min_length=1, max_length=MAX_PUSH_BLOCKS)]
    first_block: BlockId
    engine_id: Name
    host: Annotated[str, msgspec.Meta(max_length=256)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    pp_rank: Rank
    tp_rank: Rank
    pp_size: Size
    tp_size: Size
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_NOTIFIERS)] = 1


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True, forbid_unknown_fields=True):
    request_ids: Ids


class Release(msgspec.Struct, tag="release", array_like=True, forbid_unknown_fields=True):
    """D will not register these requests with this P worker (it reads nothing from it, or it
    aborted): they count as `count` of the registrations P waits for."""

    request_ids: Ids
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_NOTIFIERS)] = 1


class Pushed(msgspec.Struct, tag="pushed", array_like=True, forbid_unknown_fields=True):
    """P to D: D's request's blocks are written (`error` empty), or why they are not.
    `digests` (with `verify_transfers`, where P wrote whole blocks): XXH3-64 of each block P
    wrote, taken when P handed the request off, in D's registered order."""

    decode_request_id: Name
    error: Annotated[str, msgspec.Meta(max_length=MAX_REASON)] = ""
    digests: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]],
        msgspec.Meta(max_length=MAX_PUSH_BLOCKS),
    ] = msgspec.field(default_factory=list)


PushMessage = Register | Heartbeat | Release | Pushed


def seal_push(secret: str | None, message: PushMessage) -> bytes:
    return seal(secret, PUSH_DOMAIN, encode(message))


def send_push(
    agent: Any, target: str, secret: str | None, message: PushMessage, stats: NixlKVConnectorStats
) -> bool:
    """Send `message` sealed to the NIXL agent named `target`; False (logged and counted as a
    failed notification) if the agent could not send it."""
    try:
        agent.send_notif(target, seal_push(secret, message))
    except Exception as exc:
        logger.warning("push: notifying %s failed: %s", target, exc)
        stats.count("num_failed_notifications")
        return False
    return True


def open_push(secret: str | None, data: bytes) -> PushMessage:
    """Authenticate (with a secret) then decode; `kvx.wire.WireError` if either fails."""
    return decode_sealed(data, PushMessage, secret, PUSH_DOMAIN, max_bytes=MAX_NOTIF_BYTES)  # type: ignore[arg-type]


def reason(text: str) -> str:
    """`text` cut to what a `Pushed` carries."""
    return text[:MAX_REASON]
