"""`copy_kv_blocks`: whole blocks between two sets of per-layer caches (host <-> device)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from kvx.layouts._kernels import BlockIdsLike, as_words, block_index, gather_scatter, word_bytes
from kvx.layouts.builtin import get_layout
from kvx.layouts.descriptor import BLOCKS, HEAD_SIZE, Layout


def copy_kv_blocks(
    src_kv_caches: Mapping[str, torch.Tensor],
    dst_kv_caches: Mapping[str, torch.Tensor],
    src_block_ids: BlockIdsLike,
    dst_block_ids: BlockIdsLike,
    direction: Literal["h2d", "d2h"],
    *,
    layout: str | Layout = "NHD",
) -> None:
    """Copy block `src_block_ids[i]` to `dst_block_ids[i]` for every layer of `src_kv_caches`.

    Matches vLLM's `copy_kv_blocks`: `"h2d"` copies a host (CPU) buffer into device caches,
    `"d2h"` the reverse; both sides may be CPU tensors. Blocks are gathered on the source device,
    moved once per layer and scattered on the destination device. Every cache is in `layout`
    (default NHD, vLLM's FlashAttention shape, blocks on dim 1 as vLLM's platform ops assume).

    Like vLLM it does nothing when either dict or id list is empty. Unlike vLLM, id lists of
    different lengths raise ValueError instead of being silently ignored, as do a layer missing
    from `dst_kv_caches` and mismatched dtypes or block shapes.
    """
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    n_src, n_dst = len(src_block_ids), len(dst_block_ids)
    if n_src != n_dst:
        raise ValueError(
            f"src_block_ids has {n_src} ids but dst_block_ids has {n_dst}; they must pair up "
            "one to one (vLLM ignores this silently, kvx refuses to drop blocks)"
        )
    if not src_kv_caches or not dst_kv_caches or n_src == 0:
        return
    spec = get_layout(layout)
    host_side = "src" if direction == "h2d" else "dst"
    indices: dict[tuple[str, torch.device], torch.Tensor] = {}

    def index(arg: str, ids: BlockIdsLike, cache: torch.Tensor, blocks: int) -> torch.Tensor:
        key = (arg, cache.device)
        if key not in indices or int(indices[key].max()) >= blocks:
            indices[key] = block_index(ids, blocks, cache.device, arg)
        return indices[key]

    for name, src in src_kv_caches.items():
        if name not in dst_kv_caches:
            raise ValueError(f"layer {name!r} of src_kv_caches is missing from dst_kv_caches")
        dst = dst_kv_caches[name]
        host = src if host_side == "src" else dst
        if host.device.type != "cpu":
            raise ValueError(
                f"direction {direction!r}: the {host_side} caches must be on the host (cpu), "
                f"layer {name!r} is on {host.device}"
            )
        if src.dtype != dst.dtype:
            raise ValueError(f"layer {name!r}: src dtype {src.dtype} != dst dtype {dst.dtype}")
        for (vs, memory), (vd, _) in zip(_views(spec, src), _views(spec, dst)):
            if vs.shape[1:] != vd.shape[1:]:
                raise ValueError(
                    f"layer {name!r}: src blocks {tuple(vs.shape[1:])} and dst blocks "
                    f"{tuple(vd.shape[1:])} differ in shape ({spec.name} semantic dims)"
                )
            wide = memory[-1] == HEAD_SIZE  # only head_size may widen into words
            w = min(word_bytes(vs), word_bytes(vd)) if wide else vs.element_size()
            gather_scatter(
                as_words(vs, w),
                index("src_block_ids", src_block_ids, src, vs.shape[0]),
                as_words(vd, w),
                index("dst_block_ids", dst_block_ids, dst, vd.shape[0]),
            )


def _views(layout: Layout, tensor: torch.Tensor) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
    """Blocks-first semantic views of `tensor` with their memory orders: one, or one per K/V
    half for a layout storing K and V in different orders."""
    if layout.split_order:
        halves = layout.half_views(tensor)
        parts = [(halves[kv], layout.half_memory(kv)) for kv in (0, 1)]
    else:
        parts = [(layout.semantic_view(tensor), layout.memory)]
    return [(view.movedim(memory.index(BLOCKS), 0), memory) for view, memory in parts]
