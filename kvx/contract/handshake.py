"""Handshake types: what a worker publishes for its peers, and how the scheduler side gets it.

After `register_kv_caches` the engine asks every worker for `get_handshake_metadata()` and hands
the answers to the scheduler side, keyed by `(pp_rank, tp_rank)`
(`set_xfer_handshake_metadata_pp_aware`; `set_xfer_handshake_metadata` is the TP-only form). The
scheduler side serves them to peers out of band (NIXL's side channel) or advertises them in a
finished request's params (P2P's ports). Connectors publish one of the kinds below instead of a
type of their own, so this module is the one place that says what crosses that seam:

- `AgentPayload`: bytes the connector encoded itself (NIXL: its agent and registered regions),
  served as they are. What a transfer mode needs more goes inside that encoding, not here.
- `WorkerAddress`: where the worker listens for peers (P2P: the port the OS picked).

Both are frozen dataclasses of plain fields: the metadata may cross a process boundary (vLLM
gathers it from its worker processes) and kvx never pickles on its own wires.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

Ranks = tuple[int, int]
"""`(pp_rank, tp_rank)` of the worker a handshake metadata came from."""


class KVConnectorHandshakeMetadata:
    """Marker base of what a worker publishes for peers to connect to it (e.g. agent metadata)."""


@dataclass(frozen=True)
class AgentPayload(KVConnectorHandshakeMetadata):
    """A worker's self-encoded description for peers (NIXL: `AgentMetadata` as msgpack)."""

    payload: bytes


@dataclass(frozen=True)
class WorkerAddress(KVConnectorHandshakeMetadata):
    """Where a worker listens for peers: `port`, on `host` ("": the engine's own address)."""

    port: int
    host: str = ""


H = TypeVar("H", bound=KVConnectorHandshakeMetadata)


def with_pp_ranks(metadata: Mapping[int, H]) -> dict[Ranks, H]:
    """TP-rank keyed metadata (`set_xfer_handshake_metadata`'s) keyed by `(0, tp_rank)`."""
    return {(0, tp_rank): meta for tp_rank, meta in metadata.items()}


def split_by_type(
    metadata: Mapping[Ranks, KVConnectorHandshakeMetadata], kind: type[H]
) -> tuple[dict[Ranks, H], dict[Ranks, str]]:
    """The entries that are `kind`, and the type names of the others (by rank).

    A MultiConnector hands every child the first child's metadata (as vLLM does), so a child
    may receive another connector's kind: its own entries are the first dict."""
    own: dict[Ranks, H] = {}
    other: dict[Ranks, str] = {}
    for ranks, meta in metadata.items():
        if isinstance(meta, kind):
            own[ranks] = meta
        else:
            other[ranks] = type(meta).__name__
    return own, other
