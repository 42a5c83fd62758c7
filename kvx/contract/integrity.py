"""Per-block digests of transferred KV: P digests its blocks at hand-off, D digests what landed
and names the blocks that differ (a load error under `kv_load_failure_policy`).

A digest is XXH3-64 (the `xxhash` package kvx's stored values are checked with) of one block's
bytes. A connector hands the bytes in memory order as one or more segments whose concatenation
is `[outer, num_blocks, bytes per block]` (`outer`: the memory dims before the blocks dim, e.g.
K and V), cut anywhere: the digest of a block covers its bytes in every outer index, in order,
so P and D agree however each side's segments were cut.

The digests are computed in place, one C call for a whole batch of blocks without the GIL
(`_digest`, built with kvx: the vendored xxhash, its AVX-512 or AVX2 build chosen at import),
or through the `xxhash` package, one call per block region, where that extension was not built.
Either way the cost is a read of every byte: memory bandwidth, about half a memcpy of the same
bytes (nixl.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import xxhash

_native: ModuleType | None
try:
    from kvx.contract import _digest as _native
except ImportError:  # built without a C compiler: the xxhash package, one call per region
    _native = None

__all__ = [
    "IntegrityError",
    "block_digests",
    "cache_block_digests",
    "check_block_digests",
    "merge_digests",
]


class IntegrityError(ValueError):
    """The bytes that landed are not the bytes the sender digested. `blocks` names them."""

    def __init__(self, message: str, blocks: list[int]) -> None:
        super().__init__(message)
        self.blocks = blocks


def _as_bytes(segment: Any) -> memoryview:
    """A flat byte view of `segment` (a tensor, array or buffer), copied only from a GPU or
    when a tensor is not contiguous. torch is imported here, not with kvx."""
    if hasattr(segment, "detach"):  # a torch tensor
        import torch

        t = segment.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        segment = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return memoryview(segment).cast("B")


def block_digests(segments: Sequence[Any], num_blocks: int, outer: int = 1) -> list[int]:
    """XXH3-64 of each of `num_blocks` blocks whose memory-order bytes are the concatenation of
    `segments` (uint8 tensors, arrays or buffers), laid out `[outer, num_blocks, per block]`.

    Raises ValueError when the bytes do not split into `outer * num_blocks` equal chunks.
    """
    if num_blocks <= 0 or outer <= 0:
        return []
    parts = [_as_bytes(s) for s in segments]
    total = sum(p.nbytes for p in parts)
    chunks = outer * num_blocks
    if total % chunks:
        raise ValueError(f"{total} bytes do not split into {outer} x {num_blocks} equal blocks")
    per = total // chunks
    if _native is not None:
        return _native.chunk_digests(parts, num_blocks, outer)
    if outer == 1 and len(parts) == 1:
        data = parts[0]
        return [xxhash.xxh3_64_intdigest(data[b * per : (b + 1) * per]) for b in range(num_blocks)]
    hashers = [xxhash.xxh3_64() for _ in range(num_blocks)]
    chunk = filled = 0
    for part in parts:
        pos = 0
        while pos < part.nbytes:
            take = min(per - filled, part.nbytes - pos)
            hashers[chunk % num_blocks].update(part[pos : pos + take])
            pos += take
            filled += take
            if filled == per:
                chunk, filled = chunk + 1, 0
    return [h.intdigest() for h in hashers]


def cache_block_digests(
    tables: Sequence[Any], block_ids: Sequence[int], parts: int = 1, merge: bool = False
) -> list[int]:
    """XXH3-64 of each block of `block_ids` over every table in order (e.g. one per layer):
    a table is a uint8 tensor `[outer, num_blocks, bytes per block]` viewing a KV cache in
    its memory order. What a connector that moves whole blocks of a paged cache (NIXL pull and
    push) digests on both sides. From a GPU only the blocks asked for are copied to the host.

    With `parts` > 1 each table row's block bytes are cut into `parts` equal parts (a block's
    heads, where they come first) and each part is digested over every table: `parts` digests
    per block, block-major. With `merge`, each block's part digests are merged into one
    (`merge_digests` over all of them): what a head range of a block digests to.

    Raises ValueError for a table of another shape or type, a block id outside a table, or
    rows that do not split into `parts`."""
    ids = list(block_ids)
    if any(t.device.type != "cpu" for t in tables):
        tables = [t[:, ids].cpu() for t in tables]
        ids = list(range(len(ids)))
    low, high = (min(ids), max(ids)) if ids else (0, -1)
    for t in tables:
        if t.dim() != 3 or t.element_size() != 1:
            raise ValueError(
                f"a digest table is a uint8 [outer, blocks, bytes per block] tensor, not "
                f"{t.dtype} {tuple(t.shape)}"
            )
        if low < 0 or high >= t.shape[1]:
            raise ValueError(f"block ids {low}..{high}: a table has blocks 0..{t.shape[1] - 1}")
        if parts < 1 or t.shape[2] % parts:
            raise ValueError(f"{t.shape[2]} bytes per block do not split into {parts} parts")
    if _native is not None:
        return _native.region_digests(_regions(tables), ids, parts, merge)
    arrays = [t.numpy() for t in tables]
    out = []
    for b in ids:
        sums = []
        for p in range(parts):
            hasher = xxhash.xxh3_64()
            for array in arrays:
                per = array.shape[2] // parts
                for rows in array:
                    hasher.update(rows[b, p * per : (p + 1) * per].data)
            sums.append(hasher.intdigest())
        out += merge_digests(sums, parts, 0, parts) if merge else sums
    return out


def merge_digests(digests: Sequence[int], parts: int, first: int, count: int) -> list[int]:
    """Per group of `parts` digests (one group per block, as `cache_block_digests` with
    `parts` makes them), the XXH3-64 of its digests `first`..`first + count - 1` as
    little-endian 8-byte words: the digest of that part range of the block.

    Raises ValueError for a range outside a group or digests that are not whole groups."""
    if parts < 1 or first < 0 or count < 1 or first + count > parts or len(digests) % parts:
        raise ValueError(
            f"cannot merge {count} parts from part {first} of {len(digests)} digests in "
            f"groups of {parts}: need 0 <= first, 1 <= count, first + count <= parts and "
            "whole groups"
        )
    if _native is not None:
        return _native.merge_digests(digests, parts, first, count)
    return [
        xxhash.xxh3_64_intdigest(
            b"".join(d.to_bytes(8, "little") for d in digests[at + first : at + first + count])
        )
        for at in range(0, len(digests), parts)
    ]


def _regions(tables: Sequence[Any]) -> list[tuple[Any, int, int, int]]:
    """Each table row as a region of its table's memory, (buffer, start, size, step): block b
    of the row is `buffer[start + b * step:][:size]`, no byte copied (a row whose blocks are
    not contiguous is)."""
    import torch

    regions = []
    for t in tables:
        if t.stride(2) != 1 and t.shape[2] > 1:
            t = t.contiguous()
        outer, blocks, per = t.shape
        if not (outer and blocks and per):
            continue
        span = (outer - 1) * t.stride(0) + (blocks - 1) * t.stride(1) + per
        flat = torch.as_strided(t, (span,), (1,), t.storage_offset()).numpy()
        regions += [(flat, o * t.stride(0), per, t.stride(1)) for o in range(outer)]
    return regions


def check_block_digests(
    what: str,
    expected: Sequence[int],
    actual: Sequence[int],
    block_ids: Sequence[int] | None = None,
) -> None:
    """Raise `IntegrityError` naming `what` (e.g. the request and layer) and the blocks whose
    digest differs; `block_ids[i]` names block i (default: its index). A peer that sent a
    different number of digests than blocks fails every block."""
    names = list(range(len(actual))) if block_ids is None else list(block_ids)
    if len(names) != len(actual):
        raise ValueError(f"{len(names)} block ids name {len(actual)} digests")
    if len(expected) != len(actual):
        raise IntegrityError(
            f"{what}: the sender gave {len(expected)} block digests for {len(actual)} blocks",
            names,
        )
    bad = [names[i] for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a]
    if bad:
        shown = ", ".join(map(str, bad[:16])) + (", ..." if len(bad) > 16 else "")
        raise IntegrityError(
            f"{what}: {len(bad)} of {len(actual)} blocks differ from what the sender digested "
            f"(blocks {shown})",
            bad,
        )
