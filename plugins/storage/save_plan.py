"""Save planning, with no IO: which stored values one engine step's stores write, and where
each value's bytes come from.

Direct saves name, per complete stored block, its engine block (or a piece of one when
engine blocks hold several stored blocks). Buffered saves gather every layer of the step's
engine blocks into value buffers first: one row per stored block from each store's first
engine block on, filled per layer and engine-block-sized piece of a row by one
`convert_blocks` call for all stores (`Gather`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvx.plugins.storage.keys import Geometry, Stage
from kvx.plugins.storage.metadata import StoreSpec

Item = tuple[str, memoryview | int]
"""A value to write: its name, and its buffer row (buffered) or engine block (direct)."""

Gather = tuple[slice, list[int], list[int]]
"""Engine blocks gathered into value rows in one call: (the tokens of each row they fill,
the engine blocks, their rows; no rows: the blocks fill every row in order)."""


@dataclass
class SavePlan:
    """One step's values to write, and for buffered saves the rows they are gathered into."""

    items: list[Item] = field(default_factory=list)
    values: torch.Tensor | None = None  # per stored block a row (buffered saves only)
    gathers: list[Gather] = field(default_factory=list)


def complete_rows(
    spec: StoreSpec, rows: int, geo: Geometry, stage: Stage, heads: range
) -> list[tuple[int, str]]:
    """(row, value name) of each of a store's first `rows` rows (stored blocks from its first
    engine block on) that is a complete stored block of its keys."""
    first = spec.block_ids_start // geo.block_size - spec.first_block
    return [
        (r, geo.value_key(spec.keys[first + r], stage, heads))
        for r in range(rows)
        if 0 <= first + r < len(spec.keys)
    ]


def direct_plan(
    stores: list[StoreSpec], geo: Geometry, stage: Stage, heads: range, pieces: int
) -> SavePlan:
    """Per complete stored block its name and engine block; with `pieces` stored blocks per
    engine block, piece `s` of engine block `b` is block `b * pieces + s`."""
    items: list[Item] = []
    for spec in stores:
        for r, name in complete_rows(spec, len(spec.block_ids) * pieces, geo, stage, heads):
            items.append((name, spec.block_ids[r // pieces] * pieces + r % pieces))
    return SavePlan(items)


def buffered_rows(stores: list[StoreSpec], geo: Geometry) -> int:
    """Value rows a buffered save of `stores` fills (stored blocks from each store's first
    engine block on)."""
    bs, ebs = geo.block_size, geo.engine_block_size
    return sum(-(-len(spec.block_ids) * ebs // bs) for spec in stores)


def buffered_plan(
    stores: list[StoreSpec], geo: Geometry, stage: Stage, heads: range, values: torch.Tensor
) -> SavePlan:
    """The values of `stores` as rows of `values` (`buffered_rows` of them), and how the
    engine blocks are gathered into them."""
    bs, ebs = geo.block_size, geo.engine_block_size
    k = bs // ebs if bs > ebs else 1  # engine block `r * k + s` is piece `s` of row `r`
    gathers: list[Gather] = [
        (slice(s * ebs, (s + 1) * ebs) if k > 1 else slice(None), [], []) for s in range(k)
    ]
    items: list[Item] = []
    first_row = 0
    for spec in stores:
        n = -(-len(spec.block_ids) * ebs // bs)
        for s, (_, src, dst) in enumerate(gathers):
            ids = spec.block_ids[s::k]
            src.extend(ids)
            dst.extend(range(first_row, first_row + len(ids)) if k > 1 else [])
        if k == 1:  # engine blocks fill whole rows in order
            gathers[0][2].extend(range(first_row, first_row + n))
        for r, name in complete_rows(spec, n, geo, stage, heads):
            items.append((name, values[first_row + r].numpy().data))
        first_row += n
    return SavePlan(items, values, [gather for gather in gathers if gather[1]])
