"""Per-block digests of the P2P slices (`verify_transfers`): P digests each slice's wire bytes
when it saves it, the digests travel in the slice's sealed `TensorMeta`, and D digests the
bytes that landed before writing them into its blocks (`kvx.block_digests`). A difference is
an `kvx.IntegrityError` naming the request, layer and blocks: a load error under
`kv_load_failure_policy`."""

from __future__ import annotations

import logging
import math

import msgspec

import kvx
from kvx.layouts import get_layout
from kvx.plugins.p2p.messages import MAX_DIGESTS, TensorMeta
from kvx.plugins.p2p.tensors import Segments

logger = logging.getLogger(__name__)


def outer_of(meta: TensorMeta) -> int:
    """How many memory-order chunks each block of `meta`'s slice is cut into (the memory dims
    before the blocks dim, e.g. K and V)."""
    layout = get_layout(meta.layout)
    shape = layout.logical_shape(meta.num_blocks, meta.block_size, meta.num_heads, meta.head_size)
    physical = [shape[i] for i in layout.stride_order]
    return math.prod(physical[: layout.stride_order.index(layout.blocks_dim)])


def with_digests(meta: TensorMeta, segments: Segments) -> TensorMeta:
    """`meta` carrying the digest of each block of the slice `segments` hold (unchanged for a
    slice of more than `MAX_DIGESTS` blocks: their digests would not fit a control frame)."""
    if not 0 < meta.num_blocks <= MAX_DIGESTS:
        if meta.num_blocks:
            logger.warning(
                "%s#%s: %d blocks, more than %d: sent without digests",
                meta.request_id,
                meta.layer,
                meta.num_blocks,
                MAX_DIGESTS,
            )
        return meta
    digests = kvx.block_digests(segments, meta.num_blocks, outer_of(meta))
    return msgspec.structs.replace(meta, digests=digests)


def verify(meta: TensorMeta, segments: Segments, request_id: str) -> None:
    """Raise `kvx.IntegrityError` when the landed bytes of a slice differ from P's digests
    (blocks named by their index in the request, `first_block` on). A slice without digests
    (P has `verify_transfers` off) passes."""
    if not meta.digests:
        return
    got = kvx.block_digests(segments, meta.num_blocks, outer_of(meta))
    first = meta.first_block
    kvx.check_block_digests(
        f"request {request_id} (P's {meta.request_id}), layer {meta.layer}, P rank {meta.src_rank}",
        meta.digests,
        got,
        range(first, first + meta.num_blocks),
    )
