"""Where a layer's KV blocks live in memory: NIXL regions and descriptor lists over them.

A layer tensor whose layout keeps K and V outside the blocks dim (NHD, HND: `[2, blocks, ...]`)
is two regions, K and V; a blocks-first tensor (FlashInfer, MLA, vLLM-CPU) is one region.
Descriptor `i * num_blocks + b` of a list is block `b` of region `i` (vLLM's region-major
ids), optionally narrowed to a head slice when heads are the outermost dim inside a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvx.layouts import BLOCKS, HEADS, KV, Layout
from kvx.plugins.nixl.handshake import Region

if TYPE_CHECKING:
    import torch


def layer_regions(layer: str, layout: Layout, tensor: torch.Tensor) -> list[Region]:
    """The regions of one layer's tensor in `layout` (it must be dense in memory order)."""
    sizes = layout.sizes_of(tensor)
    if not tensor.permute(layout.stride_order).is_contiguous():
        raise ValueError(
            f"layer {layer}: the KV tensor is not dense in the {layout.name} memory order; "
            "NIXL registers whole regions"
        )
    blocks = sizes[BLOCKS]
    nbytes = tensor.numel() * tensor.element_size()
    base = tensor.data_ptr()
    if layout.memory[0] == BLOCKS:
        return [Region(layer, -1, base, nbytes // blocks, blocks)]
    if layout.memory[:2] == (KV, BLOCKS):
        half = nbytes // 2
        return [Region(layer, kv, base + kv * half, half // blocks, blocks) for kv in (0, 1)]
    raise ValueError(
        f"layout {layout.name!r} keeps {layout.memory[0]!r} outside the blocks; NixlConnector "
        "supports blocks-first layouts and [kv, blocks, ...] layouts"
    )


def heads_outermost_in_block(layout: Layout) -> bool:
    """True if a contiguous head range of one region's block is one contiguous byte range
    (in both the K and the V order when they differ, as in vLLM-CPU's layout)."""
    orders = (layout.memory, layout.k_memory) if layout.split_order else (layout.memory,)
    for memory in orders:
        inner = [d for d in memory if d != BLOCKS and not (d == KV and layout.kv_split)]
        if not inner or inner[0] != HEADS:
            return False
    return True


def block_descs(
    regions: Sequence[Region],
    head_offset: int = 0,
    num_heads: int = 0,
    heads: int = 1,
    device: int = 0,
) -> list[tuple[int, int, int]]:
    """(address, length, device) of every block of every region, region-major; with
    `num_heads`, only heads `head_offset...+num_heads` of the `heads` each block holds."""
    descs: list[tuple[int, int, int]] = []
    for r in regions:
        per_head = r.block_len // heads
        start = head_offset * per_head
        length = num_heads * per_head if num_heads else r.block_len
        descs.extend(
            (r.base_addr + b * r.block_len + start, length, 0) for b in range(r.num_blocks)
        )
    return descs
