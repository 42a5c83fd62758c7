"""vLLM's receive-side transforms, with vLLM's (legacy NIXL connector) signatures and semantics.

Each takes one K or V cache with the logical shape `[num_blocks, block_size, heads, head_size]`
(the per-layer, per-K/V tensor vLLM's NIXL connector registers), the block ids that were just
received, and rewrites those blocks in place. Other blocks are not touched.

vLLM does `index_select -> reshape/permute (a copy) -> index_copy_`. Here the permutation is
folded into the gather (or the scatter), so each block is read once and written once, on a bit
view of the cache; on CPU the native kernel does both in one pass per block.
"""

from __future__ import annotations

import torch

from kvx.layouts import _kernels
from kvx.layouts._kernels import BlockIdsLike, as_words, block_index, gather_scatter, word_bytes


def kv_postprocess_layout_on_receive(cache: torch.Tensor, indices: BlockIdsLike) -> None:
    """Reorder blocks a remote HND engine wrote into this NHD cache.

    Each selected block's elements, in the cache's logical order, are read as
    `[heads, block_size, head_size]` and written back as `[block_size, heads, head_size]`
    (matches vLLM's `kv_postprocess_layout_on_receive`).
    """
    _regroup(cache, indices, 1, heads_major=False, fn="kv_postprocess_layout_on_receive")


def kv_postprocess_blksize_on_receive(
    cache: torch.Tensor, indices: BlockIdsLike, block_size_ratio: int
) -> None:
    """Merge `block_size_ratio` smaller remote blocks received into each local block (HND).

    The selected block, read in `[heads, block_size, head_size]` order (HND memory order), holds
    `r = block_size_ratio` remote blocks `[heads, block_size / r, head_size]` one after another;
    they are rewritten as one block whose tokens are the remote blocks' tokens in order
    (matches vLLM's `kv_postprocess_blksize_on_receive`; only remote <= local block size).
    """
    _regroup(
        cache, indices, block_size_ratio, heads_major=True, fn="kv_postprocess_blksize_on_receive"
    )


def kv_postprocess_blksize_and_layout_on_receive(
    cache: torch.Tensor, indices: BlockIdsLike, block_size_ratio: int
) -> None:
    """Merge smaller HND remote blocks into each local NHD block.

    The selected block, read in the cache's logical `[block_size, heads, head_size]` order,
    holds `r = block_size_ratio` remote HND blocks `[heads, block_size / r, head_size]`; they are
    rewritten as one NHD block with the remote blocks' tokens in order (matches vLLM's
    `kv_postprocess_blksize_and_layout_on_receive`; only remote <= local block size).
    """
    _regroup(
        cache,
        indices,
        block_size_ratio,
        heads_major=False,
        fn="kv_postprocess_blksize_and_layout_on_receive",
    )


def _regroup(
    cache: torch.Tensor, indices: BlockIdsLike, ratio: int, *, heads_major: bool, fn: str
) -> None:
    """Rewrite each selected block `X[b]` from `r` sub-blocks `[heads, n, head_size]`.

    `X` is the cache viewed `[B, H, N, D]` when `heads_major`, else `[B, N, H, D]`; the flat
    contents of `X[b]` are the `r` received sub-blocks, and the result is written to `X[b]`
    with token `j * n + t` taken from sub-block `j`, token `t`.
    """
    if cache.dim() != 4:
        raise ValueError(
            f"{fn}: cache must be 4-d [num_blocks, block_size, heads, head_size], "
            f"got shape {tuple(cache.shape)}"
        )
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"{fn}: block_size_ratio must be an int >= 1, got {ratio!r}")
    num_blocks, block_size, _, _ = cache.shape
    if block_size % ratio:
        raise ValueError(
            f"{fn}: block_size_ratio {ratio} does not divide the cache's block size {block_size}"
        )
    idx = block_index(indices, num_blocks, cache.device, f"{fn}: indices")
    if idx.numel() == 0:
        return
    kernel = _kernels.native
    if kernel is not None and cache.device.type == "cpu":
        key = (cache.shape, cache.stride(), cache.storage_offset(), cache.dtype, ratio, heads_major)
        plan = _PLANS.get(key)
        if plan is None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            plan = _PLANS[key] = _kernels.in_place_plan(*_views(cache, ratio, heads_major, True))
        _kernels.run_in_place(kernel, plan, cache, idx)
    else:
        src, dst = _views(cache, ratio, heads_major, False)
        gather_scatter(src, idx, dst, idx, in_place=True)


_PLANS: dict[tuple[object, ...], _kernels.InPlacePlan] = {}
"""Native plans by cache geometry: an engine calls with the same few caches every step."""
_MAX_PLANS = 1024


def _views(
    cache: torch.Tensor, ratio: int, heads_major: bool, native: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination block views (bit views) of `cache` for `_regroup`."""
    num_blocks, block_size, heads, _ = cache.shape
    x = cache.permute(0, 2, 1, 3) if heads_major else cache
    x = as_words(x, word_bytes(x))
    n, d = block_size // ratio, x.shape[-1]
    # Received sub-blocks `[r, H, n, D]`, reordered to X's order with tokens split as (r, n).
    order = (0, 2, 1, 3, 4) if heads_major else (0, 1, 3, 2, 4)
    dst = x.unflatten(2 if heads_major else 1, (ratio, n))
    if x[0].is_contiguous() and not native:
        # PyTorch: the permutation goes into the gather's view, the scatter stays contiguous
        return x.view(num_blocks, ratio, heads, n, d).permute(order), dst
    # Into the scatter's view: X[b], read in its logical order, is the received [r, H, n, D].
    # The native kernel prefers this: the block is read front to back (the prefetcher streams
    # it), and the permuted writes land in lines it just read.
    return x, dst.permute(order)
