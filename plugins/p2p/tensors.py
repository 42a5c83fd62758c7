"""KV slices in and out of the paged cache, and their bytes on the wire.

P cuts a (request, layer) slice out of its cache with `gather` (its own layout and block size,
a head range for the D rank it goes to); D writes it into its blocks with `scatter`, converting
layout, block size and head position with `kvx.layouts.convert_blocks`. On the wire a slice is
its physical (memory-order) bytes; `from_wire` rebuilds the layout view from the meta.
"""

from __future__ import annotations

import warnings

import torch

from kvx.layouts import HEADS, Layout, convert_blocks, get_layout
from kvx.plugins.p2p.messages import TensorMeta


def has_heads(layout: Layout) -> bool:
    return HEADS in layout.dims


def gather(
    cache: torch.Tensor,
    layout: Layout,
    block_ids: list[int],
    heads: range | None,
    head_size: int,
) -> torch.Tensor:
    """A fresh tensor in `layout` holding `block_ids` of `cache` (only `heads`, local head
    indices, when the layout has a heads dim)."""
    block_size = layout.block_size_of(cache)
    num_heads = len(heads) if heads is not None else 1
    out = layout.allocate(
        len(block_ids), block_size, num_heads, head_size, dtype=cache.dtype, device=cache.device
    )
    convert_blocks(
        cache,
        out,
        block_ids,
        list(range(len(block_ids))),
        src_layout=layout,
        dst_layout=layout,
        src_heads=heads,
        dst_heads=range(num_heads) if heads is not None else None,
    )
    return out


def physical(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`tensor` (made by `layout.allocate`) as its contiguous memory-order bytes, no copy."""
    phys = tensor.permute(layout.stride_order)
    if not phys.is_contiguous():
        phys = phys.contiguous()
    return phys.view(torch.uint8).reshape(-1)


def expected_nbytes(meta: TensorMeta) -> int:
    layout = get_layout(meta.layout)
    shape = layout.logical_shape(meta.num_blocks, meta.block_size, meta.num_heads, meta.head_size)
    count = 1
    for n in shape:
        count *= n
    return count * torch.empty((), dtype=getattr(torch, meta.dtype)).element_size()


def from_wire(raw: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The layout view of `raw` (uint8, memory order), checked against `meta`."""
    layout = get_layout(meta.layout)
    shape = layout.logical_shape(meta.num_blocks, meta.block_size, meta.num_heads, meta.head_size)
    phys_shape = [shape[i] for i in layout.stride_order]
    typed = raw.view(getattr(torch, meta.dtype)).view(phys_shape)
    inverse = sorted(range(len(shape)), key=layout.stride_order.__getitem__)
    return typed.permute(inverse)


def frombuffer(buffer: memoryview) -> torch.Tensor:
    """A uint8 tensor over a received frame (read-only: we only ever copy out of it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
        return torch.frombuffer(buffer, dtype=torch.uint8)


def scatter(
    received: torch.Tensor,
    meta: TensorMeta,
    cache: torch.Tensor,
    layout: Layout,
    block_ids: list[int],
    start_token: int,
    num_tokens: int,
    dst_heads: range | None,
) -> None:
    """Write tokens `start_token..start_token+num_tokens` of `received` (which starts at token 0)
    into `block_ids` of `cache`; `start_token` is a multiple of the cache's block size."""
    src_layout = get_layout(meta.layout)
    bd, rb = layout.block_size_of(cache), meta.block_size
    end = start_token + num_tokens
    if end > meta.num_tokens:
        raise ValueError(
            f"{meta.request_id}#{meta.layer}: the peer sent {meta.num_tokens} tokens, "
            f"{end} are needed"
        )
    src_heads = range(meta.num_heads) if dst_heads is not None else None
    if start_token % rb == 0:
        first = start_token // rb
        convert_blocks(
            received,
            cache,
            list(range(first, -(-end // rb))),
            block_ids,
            src_layout=src_layout,
            dst_layout=layout,
            num_tokens=num_tokens,
            src_heads=src_heads,
            dst_heads=dst_heads,
        )
        return
    # D's prefix hit ends inside one of P's (larger) blocks: convert from token 0 into a
    # scratch tensor in D's geometry, then copy the blocks D lacks.
    sizes = layout.sizes_of(cache)
    nblocks = -(-end // bd)
    scratch = layout.allocate(
        nblocks, bd, sizes.get(HEADS, 1), sizes["head_size"], dtype=cache.dtype, device=cache.device
    )
    convert_blocks(
        received,
        scratch,
        list(range(-(-end // rb))),
        list(range(nblocks)),
        src_layout=src_layout,
        dst_layout=layout,
        num_tokens=end,
        src_heads=src_heads,
        dst_heads=dst_heads,
    )
    skip = start_token // bd
    convert_blocks(
        scratch,
        cache,
        list(range(skip, nblocks)),
        block_ids,
        src_layout=layout,
        dst_layout=layout,
        num_tokens=num_tokens,
        src_heads=dst_heads,
        dst_heads=dst_heads,
    )
