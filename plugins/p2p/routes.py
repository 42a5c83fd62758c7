"""Who sends which heads of which layer to whom, from `kvx.topology` plans.

Both sides compute the same plan: D rank `d` reads `plan_reads(D, P, d)`; in PUT modes P rank
`p` sends D rank `d` exactly the reads of that plan whose remote rank is `p`, in GET mode D
asks P for them. Workers are addressed as `port + pp_rank * tp_size + tp_rank`.
"""

from __future__ import annotations

import functools

from kvx.plugins.p2p.messages import Geometry
from kvx.topology import HeadRead, KVGeometry, plan_reads, pp_layer_range, readers_per_remote_rank


def worker_port(base_port: int, pp_rank: int, tp_size: int, tp_rank: int) -> int:
    port = base_port + pp_rank * tp_size + tp_rank
    if port > 65535:
        raise ValueError(f"kv_port {base_port} + rank {port - base_port} exceeds 65535")
    return port


@functools.lru_cache(maxsize=256)
def stage_of(layer_index: int, num_layers: int, pp_size: int) -> int:
    """The PP stage holding layer `layer_index` of `num_layers`."""
    for stage in range(pp_size):
        if layer_index in pp_layer_range(num_layers, stage, pp_size):
            return stage
    raise ValueError(f"layer {layer_index} is outside {num_layers} layers")


def kv_geometry(g: Geometry) -> KVGeometry:
    return KVGeometry(g.tp_size, g.num_kv_heads, g.block_size, g.layout, g.is_mla, g.pp_size)


def compatibility_problem(mine: Geometry, peer: Geometry) -> str | None:
    """Why KV cannot move between the two engines (None: it can, converting what differs)."""
    for name in ("num_kv_heads", "head_size", "dtype", "is_mla", "num_layers"):
        a, b = getattr(mine, name), getattr(peer, name)
        if a != b:
            return f"{name} is {a!r} here and {b!r} on the peer: not the same model"
    return None


@functools.lru_cache(maxsize=256)
def sends(
    decode: KVGeometry, prefill: KVGeometry, prefill_rank: int
) -> tuple[tuple[int, HeadRead], ...]:
    """P rank `prefill_rank`: (D tp rank, heads) for every slice it sends."""
    return tuple(
        (d, read)
        for d in range(decode.tp_size)
        for read in plan_reads(decode, prefill, d).reads
        if read.remote_tp_rank == prefill_rank
    )


@functools.lru_cache(maxsize=256)
def reads(decode: KVGeometry, prefill: KVGeometry, decode_rank: int) -> tuple[HeadRead, ...]:
    return plan_reads(decode, prefill, decode_rank).reads


@functools.lru_cache(maxsize=256)
def readers(prefill: KVGeometry, decode: KVGeometry) -> dict[int, int]:
    return readers_per_remote_rank(prefill, decode)
