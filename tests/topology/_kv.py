"""Test helpers: per-rank KV caches cut from one global KV tensor, and plan execution by plain
tensor indexing."""

from __future__ import annotations

import torch

from kvx.engine.kv_cache import token_view
from kvx.layouts import get_layout
from kvx.topology import KVGeometry, TransferPlan

HEAD_SIZE = 4
SENTINEL = -1.0


def global_kv(num_tokens: int, geo: KVGeometry) -> torch.Tensor:
    """`[tokens, kv_parts, heads, head_size]` of distinct values (MLA: one part, one head)."""
    parts, heads = (1, 1) if geo.is_mla else (2, geo.num_kv_heads)
    n = num_tokens * parts * heads * HEAD_SIZE
    return torch.arange(1, n + 1, dtype=torch.float32).view(num_tokens, parts, heads, HEAD_SIZE)


def rank_cache(geo: KVGeometry, tp_rank: int, num_blocks: int) -> torch.Tensor:
    """An empty cache for one rank in `geo.layout`, every element `SENTINEL`."""
    layout = get_layout(geo.layout)
    heads = len(geo.heads_of(tp_rank))
    return layout.allocate(num_blocks, geo.block_size, heads, HEAD_SIZE).fill_(SENTINEL)


def tokens_of(geo: KVGeometry, cache: torch.Tensor) -> torch.Tensor:
    """`[blocks, block_size, kv_parts, heads, head_size]` view of `cache`."""
    return token_view(get_layout(geo.layout), cache)


def fill(geo: KVGeometry, tp_rank: int, cache: torch.Tensor, kv: torch.Tensor, blocks: list[int]):
    """Write the rank's heads of the global `kv` into `blocks` of `cache` (token order)."""
    view, heads, bs = tokens_of(geo, cache), geo.heads_of(tp_rank), geo.block_size
    for i, block in enumerate(blocks):
        chunk = kv[i * bs : (i + 1) * bs, :, heads.start : heads.stop]
        view[block, : chunk.shape[0]] = chunk


def expected(geo: KVGeometry, tp_rank: int, num_blocks: int, kv: torch.Tensor, blocks: list[int]):
    """What `tp_rank`'s cache must hold after receiving `kv` into `blocks`: its heads there and
    `SENTINEL` everywhere else (other blocks, the tail of a partial last block)."""
    cache = rank_cache(geo, tp_rank, num_blocks)
    fill(geo, tp_rank, cache, kv, blocks)
    return cache


def execute(
    plan: TransferPlan,
    remote_caches: list[torch.Tensor],
    local_cache: torch.Tensor,
    remote_blocks: list[int],
    local_blocks: list[int],
    num_tokens: int,
) -> None:
    """Run `plan` with plain tensor copies, one per (head read, block span)."""
    dst = tokens_of(plan.local, local_cache)
    for read in plan.reads:
        src = tokens_of(plan.remote, remote_caches[read.remote_tp_rank])
        rh = slice(read.remote_head_offset, read.remote_head_offset + read.num_heads)
        lh = slice(read.local_head_offset, read.local_head_offset + read.num_heads)
        for s in plan.block_pairs(local_blocks, remote_blocks, num_tokens):
            rt = slice(s.remote_token_start, s.remote_token_start + s.num_tokens)
            lt = slice(s.local_token_start, s.local_token_start + s.num_tokens)
            dst[s.local_block_id, lt, :, lh] = src[s.remote_block_id, rt, :, rh]
