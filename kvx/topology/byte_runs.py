"""Where a head slice (and token range) of one block lies in memory, as byte runs.

A connector that moves raw bytes (NIXL) turns a `HeadRead` and a `BlockSpan` into descriptors
with `block_byte_runs`. Offsets are relative to the start of one block inside one region: the
dims a layout keeps outside `blocks` (K/V in FlashAttention layouts, layers in cross-layer
ones) are separate regions, as vLLM registers them. In head-major layouts (HND) a head slice
of whole blocks is one run per region, which is why NIXL asks for HND; token-major layouts
(NHD) need one run per token. A layout storing K and V in different orders (vLLM-CPU's
transposed K) is walked one K/V half at a time, each in its own order.
"""

from __future__ import annotations

import itertools
import math

from kvx.hooks.specs import KVLayout
from kvx.topology.errors import TopologyError

_FIXED = {"kv": 2}


def block_byte_runs(
    layout: KVLayout,
    *,
    num_heads: int,
    block_size: int,
    head_size: int,
    itemsize: int,
    heads: range | None = None,
    tokens: range | None = None,
) -> list[tuple[int, int]]:
    """`(offset, length)` byte runs, in memory order and merged when adjacent, holding
    `heads` (indices in this rank's head dim, default all) and `tokens` (default all) of one
    block of one region of a tensor in `layout` (a layout object, e.g. a `kvx.layouts.Layout`).
    """
    memory = list(layout.memory)
    inner = memory[memory.index("blocks") + 1 :]
    sizes = {"heads": num_heads, "tokens": block_size, "head_size": head_size, **_FIXED}
    picks: dict[str, range] = {}
    for dim, want in (("heads", heads), ("tokens", tokens)):
        size = sizes[dim]
        if want is None:
            continue
        if dim not in inner:
            if want != range(1):
                raise TopologyError(f"layout {layout.name!r} has no {dim} dim; got {dim}={want}")
            continue
        if want.step != 1 or not 0 <= want.start < want.stop <= size:
            raise TopologyError(f"{dim} must be a non-empty range inside [0, {size}), got {want}")
        picks[dim] = want
    if not getattr(layout, "split_order", False):
        return _runs(inner, sizes, picks, itemsize)
    k_memory = list(getattr(layout, "k_memory", ()))
    k_inner = k_memory[k_memory.index("blocks") + 1 :]
    halves = _runs(k_inner, sizes, {**picks, "kv": range(1)}, itemsize) + _runs(
        inner, sizes, {**picks, "kv": range(1, 2)}, itemsize
    )
    runs: list[tuple[int, int]] = []
    for run in sorted(halves):
        _append(runs, *run)
    return runs


def _runs(
    inner: list[str], sizes: dict[str, int], picks: dict[str, range], itemsize: int
) -> list[tuple[int, int]]:
    """Merged runs of the elements `picks` selects in one block whose dims are `inner`."""
    shape = [sizes[d] for d in inner]
    ranges = [picks.get(d, range(sizes[d])) for d in inner]
    # The innermost dims taken whole, plus the one range just outside them, are contiguous.
    cut = len(inner)
    while cut > 0 and len(ranges[cut - 1]) == shape[cut - 1]:
        cut -= 1
    unit = math.prod(shape[cut:]) * itemsize
    if cut == 0:
        return [(0, unit)]
    strides = [math.prod(shape[i + 1 :]) * itemsize for i in range(len(shape))]
    runs: list[tuple[int, int]] = []
    last = ranges[cut - 1]
    for outer in itertools.product(*ranges[: cut - 1]):
        base = sum(i * s for i, s in zip(outer, strides))
        _append(runs, base + last.start * strides[cut - 1], len(last) * strides[cut - 1])
    return runs


def _append(runs: list[tuple[int, int]], start: int, length: int) -> None:
    """Append a run, merged into the last one when adjacent."""
    if runs and runs[-1][0] + runs[-1][1] == start:
        runs[-1] = (runs[-1][0], runs[-1][1] + length)
    else:
        runs.append((start, length))
