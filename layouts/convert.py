"""`convert_blocks`: blocks in any layout and block size into any other layout and block size."""

from __future__ import annotations

import torch

from kvx.layouts import _kernels
from kvx.layouts._kernels import BlockIdsLike, as_words, block_index, gather_scatter, word_bytes
from kvx.layouts.builtin import get_layout
from kvx.layouts.descriptor import BLOCKS, HEAD_SIZE, HEADS, TOKENS, Layout

_SUB = "sub"  # sub-block index, when a block is split into min(block sizes)-token pieces


def convert_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_block_ids: BlockIdsLike,
    dst_block_ids: BlockIdsLike,
    *,
    src_layout: str | Layout = "NHD",
    dst_layout: str | Layout = "NHD",
    num_tokens: int | None = None,
    src_heads: range | None = None,
    dst_heads: range | None = None,
) -> None:
    """Write the tokens of `src`'s blocks into `dst`'s blocks, converting layout and block size.

    The source blocks, in the order given, hold a token sequence (`num_tokens` long, default:
    all their tokens); it is written in order into the destination blocks, whose block size may
    be smaller or larger than the source's (either must divide the other). Exactly the blocks
    that sequence needs must be given; the part of a last, partial destination block past
    `num_tokens` and every other block of `dst` stay untouched. `src_heads` / `dst_heads` select
    a contiguous head range on either side for heterogeneous TP (both must select as many heads).
    Block sizes are read from the tensors. Unlike vLLM (remote block <= local block only), any
    divisible pair of block sizes works in both directions. A layout storing K and V in
    different orders (`Layout.split_order`, vLLM-CPU) is converted one K/V half at a time.
    """
    ls, ld = get_layout(src_layout), get_layout(dst_layout)
    if ls.dims != ld.dims:
        raise ValueError(
            f"cannot convert {ls.name} to {ld.name}: they hold different dims "
            f"({sorted(ls.dims)} vs {sorted(ld.dims)})"
        )
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} differs from dst dtype {dst.dtype}")
    ss, sd = ls.sizes_of(src), ld.sizes_of(dst)
    for dim in sorted(ls.dims - {BLOCKS, TOKENS, HEADS}):
        if ss[dim] != sd[dim]:
            raise ValueError(f"src has {dim}={ss[dim]} but dst has {dim}={sd[dim]}")
    parts = list(zip(_parts(ls, src, ld.split_order), _parts(ld, dst, ls.split_order)))
    if HEADS in ls.dims:
        parts = [_select_heads(s, src_heads, d, dst_heads) for s, d in parts]
    elif src_heads is not None or dst_heads is not None:
        raise ValueError(f"src_heads / dst_heads: layout {ls.name} has no heads dim")
    ns, nd = ss[TOKENS], sd[TOKENS]
    if max(ns, nd) % min(ns, nd):
        raise ValueError(
            f"block sizes must divide one another: src block size {ns}, dst block size {nd}"
        )

    src_idx = block_index(src_block_ids, ss[BLOCKS], src.device, "src_block_ids")
    dst_idx = block_index(dst_block_ids, sd[BLOCKS], dst.device, "dst_block_ids")
    total = src_idx.numel() * ns if num_tokens is None else num_tokens
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    for arg, idx, size in (("src_block_ids", src_idx, ns), ("dst_block_ids", dst_idx, nd)):
        if idx.numel() != -(-total // size):
            raise ValueError(
                f"{arg} has {idx.numel()} blocks but {total} tokens need "
                f"{-(-total // size)} blocks of {size} tokens"
            )
    if dst_idx.unique().numel() != dst_idx.numel():
        raise ValueError("dst_block_ids repeats a block id; each destination block is written once")
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr() and bool(
        torch.isin(dst_idx, src_idx.to(dst_idx.device)).any()
    ):
        raise ValueError("src and dst share memory and src_block_ids overlap dst_block_ids")

    for (vs, ms), (vd, md) in parts:
        _convert(vs, ms, src_idx, vd, md, dst_idx, ns, nd, total)


_Part = tuple[torch.Tensor, tuple[str, ...]]
"""A semantic view and its dims in memory order."""


def _parts(layout: Layout, tensor: torch.Tensor, halves: bool) -> list[_Part]:
    """`tensor`'s semantic view, or one view per K/V half when either side needs halves."""
    if halves or layout.split_order:
        views = layout.half_views(tensor)
        return [(views[kv], layout.half_memory(kv)) for kv in (0, 1)]
    return [(layout.semantic_view(tensor), layout.memory)]


def _convert(
    vs: torch.Tensor,
    ms: tuple[str, ...],
    src_idx: torch.Tensor,
    vd: torch.Tensor,
    md: tuple[str, ...],
    dst_idx: torch.Tensor,
    ns: int,
    nd: int,
    total: int,
) -> None:
    """Copy `total` tokens between two semantic views (memory orders `ms`, `md`)."""
    w = min(_word(vs, ms), _word(vd, md))
    vs, vd = as_words(vs, w), as_words(vd, w)
    # Both sides are walked in one side's memory order: PyTorch's gather wants the destination's
    # (its scatter then writes contiguous rows), the native kernel the source's (it reads each
    # block front to back, which the prefetcher streams, and permutes on the write).
    order = [d for d in (md if _kernels.native is None else ms) if d != BLOCKS]
    longest = max(ns, nd)
    whole = total // longest * longest
    if whole:
        g = min(ns, nd)
        src_main = _blocks_major(vs, ms, order, ns // g)
        dst_main = _blocks_major(vd, md, order, nd // g)
        gather_scatter(src_main, src_idx[: whole // ns], dst_main, dst_idx[: whole // nd])
    if total > whole:
        _copy_tail(vs, ms, src_idx[whole // ns :], vd, md, dst_idx[whole // nd :], total - whole)


def _select_heads(
    src: _Part, src_heads: range | None, dst: _Part, dst_heads: range | None
) -> tuple[_Part, _Part]:
    """Narrow both views to the selected head ranges (same count on both sides)."""
    picked = []
    sides = (("src_heads", src, src_heads), ("dst_heads", dst, dst_heads))
    for arg, (view, memory), heads in sides:
        dim = memory.index(HEADS)
        have = view.shape[dim]
        heads = range(have) if heads is None else heads
        if not (isinstance(heads, range) and heads.step == 1 and 0 <= heads.start < heads.stop):
            raise ValueError(f"{arg} must be a non-empty range(start, stop), got {heads!r}")
        if heads.stop > have:
            raise ValueError(f"{arg} {heads!r} exceeds the {have} heads of the tensor")
        picked.append((view.narrow(dim, heads.start, len(heads)), memory))
    (vs, ms), (vd, md) = picked
    if vs.shape[ms.index(HEADS)] != vd.shape[md.index(HEADS)]:
        raise ValueError(
            f"src selects {vs.shape[ms.index(HEADS)]} heads but dst "
            f"{vd.shape[md.index(HEADS)]}; pass src_heads / dst_heads to pick "
            "matching head ranges (heterogeneous TP)"
        )
    return picked[0], picked[1]


def _word(view: torch.Tensor, memory: tuple[str, ...]) -> int:
    """Widest word for `view`: only head_size, the innermost dim of every transform, may widen."""
    return word_bytes(view) if memory[-1] == HEAD_SIZE else view.element_size()


def _blocks_major(
    view: torch.Tensor, memory: tuple[str, ...], order: list[str], sub: int
) -> torch.Tensor:
    """`view` as `[blocks, sub, *order]`, its tokens split into `sub` pieces (a strided view)."""
    t = memory.index(TOKENS)
    split = view.unflatten(t, (sub, view.shape[t] // sub))
    names = [*memory[:t], _SUB, *memory[t:]]
    return split.permute([names.index(d) for d in (BLOCKS, _SUB, *order)])


def _copy_tail(
    vs: torch.Tensor,
    ms: tuple[str, ...],
    src_idx: torch.Tensor,
    vd: torch.Tensor,
    md: tuple[str, ...],
    dst_idx: torch.Tensor,
    count: int,
) -> None:
    """Copy the first `count` tokens of `src_idx`'s blocks into `dst_idx`'s, token by index."""
    rest = [d for d in md if d not in (BLOCKS, TOKENS)]
    src_tok = vs.permute([ms.index(d) for d in (BLOCKS, TOKENS, *rest)])
    dst_tok = vd.permute([md.index(d) for d in (BLOCKS, TOKENS, *rest)])
    ns, nd = src_tok.shape[1], dst_tok.shape[1]
    pos = torch.arange(count, device=vs.device)
    tokens = src_tok[src_idx[pos // ns], pos % ns].to(vd.device)
    pos = pos.to(vd.device)
    dst_tok[dst_idx[pos // nd], pos % nd] = tokens
