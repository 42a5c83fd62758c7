"""Staged reads, for peers whose blocks cannot land in place (another block size or layout,
or head slices that are not one byte range): D READs whole remote blocks into buffers in the
remote geometry, then converts them into its own blocks with `kvx.layouts.convert_blocks`
(layout, block size in either direction, head ranges). No NIXL calls here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvx.layouts import Layout, convert_blocks, get_layout
from kvx.plugins.nixl.handshake import Region
from kvx.plugins.nixl.regions import layer_regions
from kvx.plugins.nixl.remote import RankKey, RemoteEngine


@dataclass
class StagedRead:
    """The READs of one remote worker into staging: its local regions, remote descriptor ids."""

    key: RankKey
    regions: list[Region]
    remote_ids: list[int]


@dataclass
class Staging:
    """Buffers (per remote worker and layer) that READs land in before conversion.

    `first_token`: the token the first staged block starts at (a multiple of the remote block
    size, possibly before the first token D needs when D's prefix hit ends inside a block)."""

    tensors: dict[tuple[RankKey, str], torch.Tensor]
    reads: list[StagedRead]
    first_token: int
    registration: Any = None
    dlists: list[Any] = field(default_factory=list)


def plan_staging(
    remote: RemoteEngine,
    remote_block_ids: list[int],
    num_tokens: int,
    start_token: int,
    layers: list[str],
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Staging:
    """Allocate staging for the remote blocks holding tokens `start_token..num_tokens`."""
    rb = remote.geometry.block_size
    first, last = start_token // rb, -(-num_tokens // rb)
    block_ids = remote_block_ids[first:last]
    if len(block_ids) != last - first:
        raise ValueError(f"P sent {len(remote_block_ids)} blocks for {num_tokens} tokens")
    layout = get_layout(remote.geometry.layout)
    tensors: dict[tuple[RankKey, str], torch.Tensor] = {}
    reads = []
    for p in remote.plan.remote_ranks:
        heads = len(remote.geometry.heads_of(p))
        for stage in sorted(set(remote.stage_of_layer.values())):
            read = StagedRead((stage, p), [], [])
            for ri, region in enumerate(remote.metas[read.key].regions):
                if region.layer not in layers:
                    continue
                if (read.key, region.layer) not in tensors:
                    t = layout.allocate(
                        len(block_ids), rb, heads, head_size, dtype=dtype, device=device
                    )
                    tensors[(read.key, region.layer)] = t
                    read.regions += layer_regions(region.layer, layout, t)
                read.remote_ids += [ri * region.num_blocks + b for b in block_ids]
            if read.remote_ids:
                reads.append(read)
    return Staging(tensors, reads, first * rb)


def convert_staged(
    staging: Staging,
    remote: RemoteEngine,
    caches: dict[str, torch.Tensor],
    layout: Layout,
    local_block_ids: list[int],
    num_tokens: int,
    start_token: int,
) -> None:
    """Write the staged tokens `start_token..num_tokens` into `local_block_ids`."""
    src_layout = get_layout(remote.geometry.layout)
    mla = remote.geometry.is_mla
    bd = layout.block_size_of(next(iter(caches.values())))
    count = num_tokens - staging.first_token
    skip = (start_token - staging.first_token) // bd
    for name, cache in caches.items():
        stage = remote.stage_of_layer[name]
        target, dst_ids = cache, local_block_ids
        if skip:  # convert from the staged block start, keep only the blocks D lacks
            dst_ids = list(range(-(-count // bd)))
            sizes = layout.sizes_of(cache)
            target = layout.allocate(
                len(dst_ids),
                bd,
                sizes.get("heads", 1),
                sizes["head_size"],
                dtype=cache.dtype,
                device=cache.device,
            )
        for read in remote.plan.reads:
            src = staging.tensors[((stage, read.remote_tp_rank), name)]
            ro, lo, n = read.remote_head_offset, read.local_head_offset, read.num_heads
            convert_blocks(
                src,
                target,
                list(range(src_layout.num_blocks_of(src))),
                dst_ids,
                src_layout=src_layout,
                dst_layout=layout,
                num_tokens=count,
                src_heads=None if mla else range(ro, ro + n),
                dst_heads=None if mla else range(lo, lo + n),
            )
        if skip:
            dim = layout.blocks_dim
            index = torch.tensor(local_block_ids, dtype=torch.long, device=cache.device)
            cache.index_copy_(dim, index, target.narrow(dim, skip, len(local_block_ids)))
