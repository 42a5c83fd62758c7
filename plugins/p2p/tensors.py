"""KV slices in and out of the paged cache, and their bytes on the wire.

On the wire a (request, layer) slice is the memory-order bytes of its blocks (in P's layout and
block size, only the heads of the D rank it goes to), as one or more segments whose
concatenation is those bytes. P sends segments straight from its cache where the blocks allow
(`block_segments`: one per run of consecutive blocks and K/V half, no copy) and otherwise cuts
a copy with `gather`. D writes the segments into its blocks with `scatter`: byte rows copied
straight into place when both sides share layout, block size and heads (one copy), else through
`kvx.layouts.convert_blocks` from the rebuilt layout view (`assemble`).
"""

from __future__ import annotations

import functools
import math
import warnings

import msgspec
import torch

from kvx.layouts import HEAD_SIZE, HEADS, Layout, convert_blocks, get_layout
from kvx.plugins.p2p.messages import MAX_SEGMENTS, TensorMeta

Segments = list[torch.Tensor]
"""uint8 tensors whose concatenation is a slice's memory-order bytes."""
# MAX_SEGMENTS (messages): segments one slice may travel in; more: one gathered copy


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


def block_rows(cache: torch.Tensor, layout: Layout) -> torch.Tensor | None:
    """`cache`'s bytes as `[outer, blocks, bytes per block]` (outer: the memory dims before
    blocks, e.g. K/V), a view; None if `cache` is not dense in its layout's memory order."""
    phys = cache.permute(layout.stride_order)
    if not phys.is_contiguous() or phys.dim() == 0:
        return None
    at = layout.stride_order.index(layout.blocks_dim)
    outer = math.prod(phys.shape[:at])
    if outer == 0 or phys.shape[at] == 0:
        return None
    return phys.reshape(outer, phys.shape[at], -1).view(torch.uint8)


def block_runs(block_ids: list[int], num_blocks: int) -> list[tuple[int, int]]:
    """`block_ids` as [start, stop) runs of consecutive ids, in order (ValueError if one is out
    of range). Cached: P and D ask it for the same blocks once per layer."""
    return list(_block_runs(tuple(block_ids), num_blocks))


@functools.lru_cache(maxsize=1024)
def _block_runs(block_ids: tuple[int, ...], num_blocks: int) -> tuple[tuple[int, int], ...]:
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if not 0 <= b < num_blocks:
            raise ValueError(f"block id {b} is out of range for a cache of {num_blocks} blocks")
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return tuple(runs)


def block_segments(
    cache: torch.Tensor,
    layout: Layout,
    block_ids: list[int],
    heads: range | None,
    rows: torch.Tensor | None = None,
) -> Segments | None:
    """The bytes `physical(gather(cache, layout, block_ids, heads, ...))` would hold, as views
    into `cache` (no copy): one segment per outer index and run of consecutive blocks. None
    when they are not whole blocks of a dense cache (a head subset) or too fragmented. `rows`:
    `block_rows(cache, layout)` if the caller has it (once per layer, not per slice)."""
    if heads is not None and (heads.start != 0 or len(heads) != layout.sizes_of(cache)[HEADS]):
        return None
    rows = block_rows(cache, layout) if rows is None else rows
    if rows is None:
        return None
    runs = block_runs(block_ids, rows.shape[1])
    if rows.shape[0] * len(runs) > MAX_SEGMENTS:
        return None
    return [rows[o, a:b].reshape(-1) for o in range(rows.shape[0]) for a, b in runs]


def physical(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`tensor` (made by `layout.allocate`) as its contiguous memory-order bytes, no copy."""
    phys = tensor.permute(layout.stride_order)
    if not phys.is_contiguous():
        phys = phys.contiguous()
    return phys.view(torch.uint8).reshape(-1)


def expected_nbytes(meta: TensorMeta) -> int:
    """The bytes `meta`'s shape makes (per geometry, cached: D checks every slice it is sent)."""
    return _expected_nbytes(
        meta.layout, meta.num_blocks, meta.block_size, meta.num_heads, meta.head_size, meta.dtype
    )


@functools.lru_cache(maxsize=4096)
def _expected_nbytes(
    layout_name: str, num_blocks: int, block_size: int, num_heads: int, head_size: int, dtype: str
) -> int:
    layout = get_layout(layout_name)
    shape = layout.logical_shape(num_blocks, block_size, num_heads, head_size)
    count = 1
    for n in shape:
        count *= n
    return count * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def meta_problem(meta: TensorMeta, max_tensor_bytes: int) -> str | None:
    """Why a peer's tensor meta cannot be taken (too big, unusable, bytes that do not match its
    shape), or None."""
    if meta.nbytes > max_tensor_bytes:
        return f"{meta.nbytes} bytes exceed max_tensor_bytes {max_tensor_bytes}"
    try:
        expected = expected_nbytes(meta)
    except (LookupError, ValueError, TypeError, AttributeError) as exc:
        return f"unusable tensor meta: {exc}"
    if expected != meta.nbytes:
        return f"meta announces {meta.nbytes} bytes, its shape makes {expected}"
    return None


def from_wire(raw: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The layout view of `raw` (uint8, memory order), checked against `meta`."""
    layout = get_layout(meta.layout)
    shape = layout.logical_shape(meta.num_blocks, meta.block_size, meta.num_heads, meta.head_size)
    phys_shape = [shape[i] for i in layout.stride_order]
    typed = raw.view(getattr(torch, meta.dtype)).view(phys_shape)
    inverse = sorted(range(len(shape)), key=layout.stride_order.__getitem__)
    return typed.permute(inverse)


def frombuffer(buffer: memoryview) -> torch.Tensor:
    """A uint8 tensor over a received frame (we only ever copy out of it)."""
    if not buffer.readonly:  # ZMQ's frames: no warning to silence (catch_warnings costs ~7 us)
        return torch.frombuffer(buffer, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
        return torch.frombuffer(buffer, dtype=torch.uint8)


def assemble(segments: Segments, meta: TensorMeta) -> torch.Tensor:
    """The layout view of a received slice (a copy only when it came in several segments)."""
    if len(segments) == 1:
        raw = segments[0]
    elif segments:
        raw = torch.cat([s.reshape(-1) for s in segments])
    else:
        raw = torch.empty(0, dtype=torch.uint8)
    return from_wire(raw, meta)


def scatter(
    segments: Segments,
    meta: TensorMeta,
    cache: torch.Tensor,
    layout: Layout,
    block_ids: list[int],
    start_token: int,
    num_tokens: int,
    dst_heads: range | None,
) -> None:
    """Write tokens `start_token..start_token+num_tokens` of the received slice into
    `block_ids` of `cache`; `start_token` is a multiple of the cache's block size. The slice
    starts at token `meta.first_block * meta.block_size` (0 unless P's table began with null
    blocks, outside its sliding window); tokens before that cannot be written."""
    sizes = layout.sizes_of(cache)
    bd, rb = sizes["tokens"], meta.block_size
    offset = meta.first_block * rb
    if offset:
        if start_token < offset or offset % bd:
            raise ValueError(
                f"{meta.request_id}#{meta.layer}: the peer sent tokens from {offset} (blocks "
                f"before were outside its sliding window); tokens from {start_token} in blocks "
                f"of {bd} are needed"
            )
        start_token -= offset
        meta = msgspec.structs.replace(meta, first_block=0, num_tokens=meta.num_tokens - offset)
    end = start_token + num_tokens
    if end > meta.num_tokens:
        raise ValueError(
            f"{meta.request_id}#{meta.layer}: the peer sent {meta.num_tokens} tokens, "
            f"{end} are needed"
        )
    if _same_blocks(meta, sizes, cache, layout, dst_heads) and _place(
        segments, meta, cache, layout, block_ids, start_token, num_tokens
    ):
        return
    received = assemble(segments, meta)
    src_layout = get_layout(meta.layout)
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


def _same_blocks(
    meta: TensorMeta,
    sizes: dict[str, int],
    cache: torch.Tensor,
    layout: Layout,
    dst_heads: range | None,
) -> bool:
    """True if the slice's blocks are byte for byte blocks of `cache` (same layout, block size,
    dtype and head size, every head of this rank; `sizes`: `layout.sizes_of(cache)`)."""
    if (meta.layout, meta.block_size, meta.dtype) != (
        layout.name,
        sizes["tokens"],
        str(cache.dtype).removeprefix("torch."),
    ) or meta.head_size != sizes[HEAD_SIZE]:
        return False
    if HEADS not in layout.dims:
        return True
    every = range(sizes[HEADS])
    return meta.num_heads == len(every) and dst_heads in (None, every)


def _place(
    segments: Segments,
    meta: TensorMeta,
    cache: torch.Tensor,
    layout: Layout,
    block_ids: list[int],
    start_token: int,
    num_tokens: int,
) -> bool:
    """Copy the slice's whole blocks straight from `segments` into `cache` (one copy per run of
    consecutive blocks), and a last partial block through `convert_blocks` so its tokens past
    `num_tokens` stay untouched. False (nothing written) when the segments are not whole
    blocks, so the caller converts instead."""
    rows = block_rows(cache, layout)
    if rows is None:
        return False
    outer, piece = rows.shape[0], rows.shape[2]
    wire_blocks = meta.num_blocks
    if meta.nbytes != outer * wire_blocks * piece or any(s.numel() % piece for s in segments):
        return False
    bs = meta.block_size
    first, full, tail = start_token // bs, num_tokens // bs, num_tokens % bs
    if len(block_ids) != full + (1 if tail else 0):
        raise ValueError(
            f"{len(block_ids)} destination blocks for {num_tokens} tokens of {bs} per block"
        )
    num_blocks = rows.shape[1]
    runs = block_runs(block_ids[:full], num_blocks)  # also the range check
    if block_ids and (
        len(set(block_ids)) != len(block_ids) or min(block_ids) < 0 or max(block_ids) >= num_blocks
    ):
        raise ValueError(f"the destination blocks {block_ids} repeat or leave the cache")
    dst_runs, at = [], first  # (first wire block, first destination block, count)
    for a, b in runs:
        dst_runs.append((at, a, b - a))
        at += b - a
    last = last_rows = None
    if tail:
        last = layout.allocate(
            1, bs, meta.num_heads, meta.head_size, dtype=cache.dtype, device=cache.device
        )
        last_rows = block_rows(last, layout)
    flat = 0  # index of the segment's first block over (outer index, wire block)
    for segment in segments:
        count = segment.numel() // piece
        pieces = segment.view(count, piece)
        for o in range(flat // wire_blocks, (flat + count - 1) // wire_blocks + 1):
            base = o * wire_blocks  # wire block j of outer index o is pieces[base + j - flat]
            lo, hi = max(flat, base) - base, min(flat + count, base + wire_blocks) - base
            for j, d, n in dst_runs:
                a, b = max(lo, j), min(hi, j + n)
                if a < b:
                    rows[o, d + a - j : d + b - j].copy_(pieces[base + a - flat : base + b - flat])
            if last_rows is not None and lo <= first + full < hi:
                last_rows[o, 0].copy_(pieces[base + first + full - flat])
        flat += count
    if last is not None:
        convert_blocks(
            last,
            cache,
            [0],
            [block_ids[-1]],
            src_layout=layout,
            dst_layout=layout,
            num_tokens=tail,
        )
    return True
