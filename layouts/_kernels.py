"""Machinery shared by the transforms: bit views, block-id checks and the gather/scatter loop.

Transforms only move bytes, so they run on bit views of the caches: every dtype (float8
included, which has few CPU kernels) is handled alike, and a wide word means fewer elements for
the indexing kernels, which copy element by element (16-byte words are ~25% faster than 8-byte
ones for `index_copy_` on CPU). Words are integers, or complex128 for 16 bytes: the kernels only
load and store them, never compute, so every bit pattern (NaN payloads included) survives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

CPU_CHUNK_BYTES = 4 << 20
"""Bytes gathered per step on CPU: the staging copy stays in cache between gather and scatter."""

_WORDS = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
    16: torch.complex128,
}

BlockIdsLike = Sequence[int] | torch.Tensor


def word_bytes(t: torch.Tensor, max_bytes: int = 16) -> int:
    """The widest word (<= `max_bytes`) `t` can be viewed as, widening only its last dim."""
    e = t.element_size()
    if t.dim() == 0 or (t.stride(-1) != 1 and t.shape[-1] != 1):
        return e
    for w in (16, 8, 4, 2):
        if e < w <= max_bytes and all(
            (n * e) % w == 0 for n in (t.shape[-1], t.storage_offset(), *t.stride()[:-1])
        ):
            return w
    return e


def as_words(t: torch.Tensor, w: int) -> torch.Tensor:
    """A bit-identical view of `t` with `w`-byte elements (see `word_bytes`)."""
    same = t.view(_WORDS[t.element_size()])
    return same if w == t.element_size() else same.view(_WORDS[w])


def block_index(ids: BlockIdsLike, num_blocks: int, device: torch.device, arg: str) -> torch.Tensor:
    """`ids` as an int64 tensor on `device`, checked to lie in [0, num_blocks)."""
    if isinstance(ids, torch.Tensor):
        idx = ids
    else:
        idx = torch.as_tensor(ids)
        if idx.numel() == 0:
            idx = idx.to(torch.long)
    if (
        idx.dim() != 1
        or idx.dtype.is_floating_point
        or idx.dtype.is_complex
        or (idx.dtype == torch.bool)
    ):
        raise ValueError(
            f"{arg} must be a 1-d list or tensor of integer block ids, got "
            f"{idx.dtype} with shape {tuple(idx.shape)}"
        )
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(
                f"{arg}: block id {lo if lo < 0 else hi} is out of range; the cache has "
                f"{num_blocks} blocks (ids 0..{num_blocks - 1})"
            )
    return idx.to(device=device, dtype=torch.long)


def gather_scatter(
    src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """Copy `src[src_idx]` (blocks along dim 0) into `dst[dst_idx]`.

    The gathered blocks are reinterpreted as `dst` blocks in order (so a source block may fill
    several destination blocks or the reverse). Per-block views may be strided: the gather reads
    through `src`'s strides, the scatter writes through `dst`'s. On CPU the work is staged in
    cache-sized chunks of whole blocks, never one block at a time.
    """
    src_elems, dst_elems = math.prod(src.shape[1:]), math.prod(dst.shape[1:])
    unit = math.lcm(src_elems, dst_elems)
    per_src, per_dst = unit // src_elems, unit // dst_elems
    units = src_idx.numel() // per_src
    assert units * per_src == src_idx.numel() and units * per_dst == dst_idx.numel()
    if units == 0:
        return
    step = units
    if src.device.type == "cpu" and dst.device.type == "cpu":
        step = max(1, CPU_CHUNK_BYTES // (unit * src.element_size()))
    buf = torch.empty(
        (min(units, step) * per_src, *src.shape[1:]), dtype=src.dtype, device=src.device
    )
    for start in range(0, units, step):
        stop = min(units, start + step)
        rows = torch.index_select(
            src, 0, src_idx[start * per_src : stop * per_src], out=buf[: (stop - start) * per_src]
        )
        rows = rows.view(-1, *dst.shape[1:]).to(dst.device)
        dst.index_copy_(0, dst_idx[start * per_dst : stop * per_dst], rows)
