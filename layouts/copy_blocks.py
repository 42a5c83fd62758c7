"""`copy_kv_blocks`: whole blocks between two sets of per-layer caches (host <-> device)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from kvx.layouts._kernels import (
    BlockIdsLike,
    LayersPlan,
    as_words,
    block_index,
    gather_scatter,
    gather_scatter_layers,
    layers_plan,
    native_ids,
    native_layers,
    word_bytes,
)
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
        _refuse_unpaired(n_src, n_dst)
    if not src_kv_caches or not dst_kv_caches or n_src == 0:
        return
    KVBlockCopier(src_kv_caches, dst_kv_caches, direction, layout=layout)(
        src_block_ids, dst_block_ids
    )


class KVBlockCopier:
    """`copy_kv_blocks` between two fixed sets of caches, with the per-layer work (checks, word
    views, grouping, addresses) done once here instead of on every call: for a connector that
    copies between the same registered caches every step. The caches must stay allocated (this
    keeps them referenced) and in place."""

    def __init__(
        self,
        src_kv_caches: Mapping[str, torch.Tensor],
        dst_kv_caches: Mapping[str, torch.Tensor],
        direction: Literal["h2d", "d2h"],
        *,
        layout: str | Layout = "NHD",
    ) -> None:
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
        spec = get_layout(layout)
        host_side = "src" if direction == "h2d" else "dst"
        groups: dict[tuple[object, ...], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
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
            geometry = (  # all that `_word_views` and the kernel read, except the address
                *(t.shape for t in (src, dst)),
                *(t.stride() for t in (src, dst)),
                *(t.storage_offset() * t.element_size() % 16 for t in (src, dst)),
                src.dtype,
                src.device,
                dst.device,
            )
            groups.setdefault(geometry, []).append((name, src, dst))
        # Per group of layers: the plan of one native call (geometry of the first layer's word
        # views, every layer's src and dst addresses), or each layer's own word views.
        self._layers: list[LayersPlan] = []
        self._single: list[tuple[torch.Tensor, torch.Tensor]] = []
        for pairs in groups.values():
            first, src, dst = pairs[0]
            views = _word_views(spec, first, src, dst)
            if len(pairs) > 1 and all(native_layers(ws, wd) for ws, wd in views):
                for ws, wd in views:
                    src_offset = ws.data_ptr() - src.data_ptr()
                    dst_offset = wd.data_ptr() - dst.data_ptr()
                    src_addrs = [s.data_ptr() + src_offset for _, s, _ in pairs]
                    dst_addrs = [d.data_ptr() + dst_offset for _, _, d in pairs]
                    self._layers.append(layers_plan(ws, src_addrs, wd, dst_addrs))
                continue
            for name, s, d in pairs:  # one layer at a time (the PyTorch path, or a lone layer)
                self._single += views if s is src else _word_views(spec, name, s, d)
        self._caches = (dict(src_kv_caches), dict(dst_kv_caches))  # keeps the addresses valid

    def __call__(self, src_block_ids: BlockIdsLike, dst_block_ids: BlockIdsLike) -> None:
        """Copy block `src_block_ids[i]` to `dst_block_ids[i]` in every layer."""
        n_src, n_dst = len(src_block_ids), len(dst_block_ids)
        if n_src != n_dst:
            _refuse_unpaired(n_src, n_dst)
        if n_src == 0:
            return
        for plan in self._layers:  # lists go as they are (the kernel checks them); a tensor
            # of ids is kept (`_*_kept`) until its call returns
            src_ids, _src_kept = native_ids(src_block_ids, plan.src_blocks, "src_block_ids")
            dst_ids, _dst_kept = native_ids(dst_block_ids, plan.dst_blocks, "dst_block_ids")
            gather_scatter_layers(plan, src_ids, n_src, dst_ids, n_dst)
        if not self._single:
            return
        indices: dict[tuple[str, torch.device, int], torch.Tensor] = {}

        def index(arg: str, ids: BlockIdsLike, view: torch.Tensor) -> torch.Tensor:
            key = (arg, view.device, view.shape[0])
            if key not in indices:
                indices[key] = block_index(ids, view.shape[0], view.device, arg)
            return indices[key]

        for ws, wd in self._single:
            gather_scatter(
                ws,
                index("src_block_ids", src_block_ids, ws),
                wd,
                index("dst_block_ids", dst_block_ids, wd),
            )


def _refuse_unpaired(n_src: int, n_dst: int) -> None:
    raise ValueError(
        f"src_block_ids has {n_src} ids but dst_block_ids has {n_dst}; they must pair up "
        "one to one (vLLM ignores this silently, kvx refuses to drop blocks)"
    )


def _word_views(
    layout: Layout, name: str, src: torch.Tensor, dst: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Blocks-first word views of layer `name`'s `src` and `dst` (one pair, or one per K/V
    half), checked to hold blocks of the same shape."""
    out = []
    for (vs, memory), (vd, _) in zip(_views(layout, src), _views(layout, dst)):
        if vs.shape[1:] != vd.shape[1:]:
            raise ValueError(
                f"layer {name!r}: src blocks {tuple(vs.shape[1:])} and dst blocks "
                f"{tuple(vd.shape[1:])} differ in shape ({layout.name} semantic dims)"
            )
        wide = memory[-1] == HEAD_SIZE  # only head_size may widen into words
        w = min(word_bytes(vs), word_bytes(vd)) if wide else vs.element_size()
        out.append((as_words(vs, w), as_words(vd, w)))
    return out


def _views(layout: Layout, tensor: torch.Tensor) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
    """Blocks-first semantic views of `tensor` with their memory orders: one, or one per K/V
    half for a layout storing K and V in different orders."""
    if layout.split_order:
        halves = layout.half_views(tensor)
        parts = [(halves[kv], layout.half_memory(kv)) for kv in (0, 1)]
    else:
        parts = [(layout.semantic_view(tensor), layout.memory)]
    return [(view.movedim(memory.index(BLOCKS), 0), memory) for view, memory in parts]
