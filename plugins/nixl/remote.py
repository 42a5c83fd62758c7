"""A remote (P) engine as one D worker sees it after the handshake: agents, geometry, the
transfer plan, which P ranks this worker notifies, and the descriptor lists prepared once."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvx.layouts import get_layout
from kvx.plugins.nixl.handshake import (
    MAX_IDS_PER_NOTIFICATION,
    AgentMetadata,
    HandshakeError,
    Notification,
    compatibility_hash,
    differing_factors,
    seal_notification,
)
from kvx.plugins.nixl.metadata import RemoteRead
from kvx.plugins.nixl.regions import heads_outermost_in_block
from kvx.plugins.nixl.side_channel import fetch_payload
from kvx.topology import KVGeometry, TopologyError, TransferPlan, check_layout, plan_reads
from kvx.wire import WireError, decode

logger = logging.getLogger(__name__)

RankKey = tuple[int, int]
"""(pp_rank, tp_rank) of a remote worker."""


@dataclass(frozen=True)
class LocalView:
    """What a D worker knows of itself when it plans reads."""

    engine_id: str
    tp_rank: int
    tp_size: int
    pp_size: int
    geometry: KVGeometry
    layers: tuple[str, ...]
    factors: dict[str, str]
    dtype: str
    head_size: int
    num_blocks: int | None = None
    """Blocks per registered region here; bounds what a peer may claim (None: unknown)."""


REMOTE_CAPACITY_RATIO = 16
"""A peer may claim at most this many times our KV capacity in tokens per region (it decides
how many descriptors we build)."""
MAX_REMOTE_BLOCKS = 1 << 22
"""Blocks per region a peer may claim when our own count is unknown."""


def notify_counts(local: LocalView, remote: KVGeometry, remote_pp: int) -> dict[RankKey, int]:
    """Remote workers this local rank notifies when a read is done, and how many
    notifications each of them waits for.

    Every local rank that reads a remote TP rank notifies it; a remote rank nobody reads
    (its heads are replicated and read elsewhere) is notified by local rank
    `p * local_tp // remote_tp`, so it still frees early. Each local PP stage notifies every
    remote PP stage.
    """
    readers: dict[int, set[int]] = {p: set() for p in range(remote.tp_size)}
    for rank in range(local.tp_size):
        for p in plan_reads(local.geometry, remote, rank).remote_ranks:
            readers[p].add(rank)
    counts = {}
    for p, ranks in readers.items():
        notifiers = ranks or {p * local.tp_size // remote.tp_size}
        if local.tp_rank in notifiers:
            for stage in range(remote_pp):
                counts[(stage, p)] = len(notifiers) * local.pp_size
    return counts


def fetch_remote(
    local: LocalView,
    spec: RemoteRead,
    *,
    timeout_s: float,
    max_bytes: int,
    secret: str | None,
    enforce_compat: bool,
) -> dict[RankKey, AgentMetadata]:
    """Handshake (runs in a background thread, no NIXL calls): fetch and check the payload of
    every remote worker this rank reads from or notifies."""
    guess = KVGeometry(
        spec.remote_tp_size,
        local.geometry.num_kv_heads,
        local.geometry.block_size,
        local.geometry.layout,
        local.geometry.is_mla,
    )
    try:
        ranks = set(plan_reads(local.geometry, guess, local.tp_rank).remote_ranks)
        ranks |= {p for _, p in notify_counts(local, guess, 1)}
    except TopologyError as exc:
        raise HandshakeError(f"cannot read from engine {spec.remote_engine_id}: {exc}") from None
    metas = {}
    for stage in range(spec.remote_pp_size):
        for p in sorted(ranks):
            metas[(stage, p)] = fetch_checked(
                local,
                spec.remote_engine_id,
                spec.remote_host,
                spec.remote_port,
                spec.remote_tp_size,
                (stage, p),
                timeout_s=timeout_s,
                max_bytes=max_bytes,
                secret=secret,
                enforce_compat=enforce_compat,
            )
    check_consistent(metas)
    return metas


def fetch_checked(
    local: LocalView,
    engine_id: str,
    host: str,
    port: int,
    tp_size: int,
    key: RankKey,
    *,
    timeout_s: float,
    max_bytes: int,
    secret: str | None,
    enforce_compat: bool,
) -> AgentMetadata:
    """Fetch remote worker `key`'s payload from the side channel at `host:port` and check it
    (compatibility hash, engine id, rank, dtype, regions); `HandshakeError` otherwise."""
    stage, p = key
    reply = fetch_payload(
        host, port, stage, p, timeout_s=timeout_s, max_bytes=max_bytes, secret=secret
    )
    if reply.compatibility_hash != compatibility_hash(local.factors):
        why = differing_factors(local.factors, reply.factors) or "the factors agree"
        message = f"NIXL compatibility hash mismatch with engine {engine_id}: differs in {why}"
        if enforce_compat:
            raise HandshakeError(message)
        logger.warning("%s (enforce_handshake_compat is off: continuing)", message)
    try:
        meta = decode(reply.agent_metadata_bytes, AgentMetadata, max_bytes=max_bytes)
    except WireError as exc:
        raise HandshakeError(f"engine {engine_id}: agent metadata: {exc}") from None
    if meta.engine_id != engine_id:
        raise HandshakeError(
            f"engine id mismatch: the request names remote_engine_id {engine_id!r} but "
            f"{host}:{port} serves engine {meta.engine_id!r}"
        )
    if (meta.pp_rank, meta.tp_rank) != (stage, p) or meta.tp_size != tp_size:
        raise HandshakeError(
            f"engine {meta.engine_id}: asked for pp_rank={stage} tp_rank={p} of TP "
            f"{tp_size}, got pp_rank={meta.pp_rank} tp_rank={meta.tp_rank} of TP {meta.tp_size}"
        )
    if meta.dtype != local.dtype or meta.head_size != local.head_size:
        raise HandshakeError(
            f"engine {meta.engine_id}: dtype {meta.dtype}/head_size {meta.head_size} "
            f"cannot be read into dtype {local.dtype}/head_size {local.head_size}"
        )
    check_agent_metadata(local, meta)
    return meta


def check_agent_metadata(local: LocalView, meta: AgentMetadata) -> None:
    """Refuse metadata whose regions do not fit what the peer's geometry implies: more than
    two per layer of the model, duplicates, a `block_len` other than its heads, head size,
    dtype and block size make, more blocks than `REMOTE_CAPACITY_RATIO` times our capacity,
    or addresses that overflow. Every count we later build descriptors from is checked here."""
    who = f"engine {meta.engine_id} (pp_rank={meta.pp_rank}, tp_rank={meta.tp_rank})"
    try:
        layout = get_layout(meta.layout)
        geometry = KVGeometry(
            meta.tp_size, meta.num_kv_heads, meta.block_size, meta.layout, meta.is_mla
        )
        check_layout(geometry, layout, "remote")
        heads = len(geometry.heads_of(meta.tp_rank))
    except (TopologyError, ValueError, LookupError) as exc:
        raise HandshakeError(f"{who}: its geometry is not usable: {exc}") from None
    if meta.is_mla != local.geometry.is_mla or meta.pp_rank >= meta.pp_size:
        raise HandshakeError(
            f"{who}: is_mla={meta.is_mla} pp_size={meta.pp_size} do not fit this engine's "
            f"is_mla={local.geometry.is_mla} or its own pp_rank"
        )
    element = torch.empty((), dtype=getattr(torch, local.dtype)).element_size()
    per_kv = element * meta.head_size * heads * meta.block_size
    if local.num_blocks is None:
        max_blocks = MAX_REMOTE_BLOCKS
    else:
        tokens = local.num_blocks * local.geometry.block_size * REMOTE_CAPACITY_RATIO
        max_blocks = max(1, tokens // meta.block_size)
    max_regions = 2 * int(local.factors.get("num_layers", len(local.layers)))
    if len(meta.regions) > max_regions:
        raise HandshakeError(
            f"{who}: registers {len(meta.regions)} regions; a model of "
            f"{max_regions // 2} layers has at most {max_regions}"
        )
    seen: set[tuple[str, int]] = set()
    for region in meta.regions:
        where = f"{who}: region {region.layer[:80]!r} kv={region.kv}"
        if (region.layer, region.kv) in seen:
            raise HandshakeError(f"{where}: registered twice")
        seen.add((region.layer, region.kv))
        expected = per_kv * (2 if region.kv == -1 and not meta.is_mla else 1)
        if region.block_len != expected:
            raise HandshakeError(
                f"{where}: block_len {region.block_len} bytes, but its geometry ({heads} "
                f"heads of {meta.head_size} x {local.dtype}, {meta.block_size} tokens per "
                f"block) makes {expected}"
            )
        if region.num_blocks > max_blocks:
            raise HandshakeError(
                f"{where}: claims {region.num_blocks} blocks; at most {max_blocks} accepted "
                f"({REMOTE_CAPACITY_RATIO}x this engine's KV capacity)"
            )
        if region.base_addr + region.block_len * region.num_blocks >= 1 << 64:
            raise HandshakeError(f"{where}: its blocks run past the end of the address space")


def check_consistent(metas: dict[RankKey, AgentMetadata]) -> None:
    """All workers of one remote engine must describe the same engine geometry."""
    shapes = {
        (m.tp_size, m.pp_size, m.num_kv_heads, m.head_size, m.block_size, m.layout, m.is_mla)
        for m in metas.values()
    }
    if len(shapes) > 1:
        raise HandshakeError(
            f"engine {next(iter(metas.values())).engine_id}: its workers disagree on the "
            f"geometry (tp, pp, heads, head size, block size, layout, MLA): {sorted(shapes)}"
        )


@dataclass
class RemoteEngine:
    """A remote engine this worker has shaken hands with."""

    engine_id: str
    metas: dict[RankKey, AgentMetadata]
    agents: dict[RankKey, str]
    geometry: KVGeometry
    plan: TransferPlan
    notify: dict[RankKey, int]
    direct: bool
    """True when reads land straight in the local blocks (same layout and block size, and
    every head slice is one byte range); otherwise they go through a staging buffer."""
    stage_of_layer: dict[str, int]
    dlists: dict[tuple[int, ...], Any] = field(default_factory=dict)
    direct_reads: list[Any] | None = None
    """The READs every request makes, but its block ids (`posting.DirectRead`), worked out on
    the first read."""
    block_limit: int = field(init=False)
    """Blocks of P's smallest registered region: every block id P sends must be below it."""

    def __post_init__(self) -> None:
        self.block_limit = min(
            (r.num_blocks for m in self.metas.values() for r in m.regions), default=0
        )

    def check_block_ids(self, block_ids: list[int]) -> None:
        """P's block ids come through the proxy: refuse ids outside P's registered blocks (a
        `kvx.NULL_BLOCK` too: P no longer holds that block)."""
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.block_limit):
            bad = [b for b in block_ids if not 0 <= b < self.block_limit]
            raise ValueError(
                f"remote_block_ids {bad[:4]} are outside P's {self.block_limit} blocks"
            )

    def sealed(self, note: Notification, secret: str | None) -> Iterator[tuple[str, bytes]]:
        """(agent, message) for each worker of this engine D tells, with the reads it expects:
        `note` sealed in pieces of at most `MAX_IDS_PER_NOTIFICATION` request ids (P refuses a
        larger one whole)."""
        ids = note.request_ids
        for i in range(0, len(ids), MAX_IDS_PER_NOTIFICATION):
            piece = ids[i : i + MAX_IDS_PER_NOTIFICATION]
            for key, count in self.notify.items():
                yield (
                    self.agents[key],
                    seal_notification(secret, Notification(note.kind, piece, count)),
                )

    def release(self, agent: Any) -> None:
        """Release the prepared lists and remove the remote agents from local `agent`."""
        for dlist in self.dlists.values():
            agent.release_dlist_handle(dlist)
        for name in self.agents.values():
            try:
                agent.remove_remote_agent(name)
            except Exception as exc:  # a dead peer
                logger.warning("removing agent %s failed: %s", name, exc)

    def remote_dlist(self, key: RankKey, head_offset: int, num_heads: int, make: Callable) -> Any:
        """The prepared descriptor list of remote worker `key` (cached)."""
        k = (*key, head_offset, num_heads)
        if k not in self.dlists:
            self.dlists[k] = make(self.agents[key], self.metas[key], head_offset, num_heads)
        return self.dlists[k]


def build_remote(
    local: LocalView,
    metas: dict[RankKey, AgentMetadata],
    add_agent: Callable[[bytes], str],
    remove_agent: Callable[[str], None],
) -> RemoteEngine:
    """Check the fetched metadata against the local geometry, plan the reads and add the
    remote agents (main thread: NIXL calls); on failure none stays added."""
    first = next(iter(metas.values()))
    geometry = KVGeometry(
        first.tp_size, first.num_kv_heads, first.block_size, first.layout, first.is_mla
    )
    try:
        plan = plan_reads(local.geometry, geometry, local.tp_rank)
        notify = notify_counts(local, geometry, first.pp_size)
    except TopologyError as exc:
        raise HandshakeError(f"cannot read from engine {first.engine_id}: {exc}") from None
    stage_of_layer: dict[str, int] = {}
    for (stage, _), meta in metas.items():
        for region in meta.regions:
            stage_of_layer.setdefault(region.layer, stage)
    missing = [name for name in local.layers if name not in stage_of_layer]
    if missing:
        raise HandshakeError(
            f"engine {first.engine_id} does not hold layers {missing} (it has "
            f"{sorted(stage_of_layer)}): both sides must run the same model"
        )
    same = (geometry.layout, geometry.block_size) == (
        local.geometry.layout,
        local.geometry.block_size,
    )
    full = all(r.num_heads == len(geometry.heads_of(r.remote_tp_rank)) for r in plan.reads) and (
        len(plan.reads) == 1
    )
    direct = same and (full or heads_outermost_in_block(get_layout(geometry.layout)))
    agents: dict[RankKey, str] = {}
    try:
        for key, meta in metas.items():
            agents[key] = add_agent(meta.agent_metadata)
    except Exception as exc:  # NIXL cannot reach the peer (e.g. it died after the handshake)
        for name in agents.values():
            remove_agent(name)
        raise HandshakeError(f"cannot connect to engine {first.engine_id}: {exc}") from None
    return RemoteEngine(
        first.engine_id, metas, agents, geometry, plan, notify, direct, stage_of_layer
    )
