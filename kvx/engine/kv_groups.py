"""The reference engine's two-group mode (`EngineConfig.kv_groups=2`), as Gemma-3 under vLLM's
hybrid allocator: even layers are full attention (group 0), odd layers read only the last
`sliding_window` tokens (group 1), and each group has its own block table per request.

The scheduler keeps one table of *logical* blocks per request; `WindowGroups` turns it into the
two tables a connector sees. Logical block `b` is block `b` in group 0 and block
`logical_blocks + b` in group 1, so the groups' ids never coincide (a connector using one
group's ids for the other reads and writes the wrong blocks). Group 1's leading entries become
`NULL_BLOCK` as its window moves on, like vLLM's sliding-window manager; the block behind such an
entry stays reserved (the engine does not reuse it for another request, a simplification of
vLLM's freeing). The cache's last block is the null block; each layer's blocks of the other
group are never any request's and must stay untouched (`guarded_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvx.contract.types import NULL_BLOCK

WINDOW_GROUP = 1  # the sliding-window group; group 0 is full attention


@dataclass(frozen=True)
class WindowGroups:
    """Block ids of a full-attention group and a sliding-window group over one cache."""

    num_blocks: int  # physical blocks per layer tensor (the last is the null block)
    window: int  # tokens the window group's layers attend to
    block_size: int

    @property
    def logical_blocks(self) -> int:
        """Blocks the scheduler hands out: each is one block in every group."""
        return (self.num_blocks - 1) // 2

    def layer_groups(self, num_layers: int) -> tuple[int, ...]:
        """Each layer's group: even layers full attention, odd layers the window."""
        return tuple(i % 2 for i in range(num_layers))

    def skipped(self, num_computed: int, num_blocks: int) -> int:
        """Leading blocks of the window group no position from `num_computed` on attends to
        (vLLM's `remove_skipped_blocks`)."""
        return min(max(0, num_computed - self.window + 1) // self.block_size, num_blocks)

    def tables(self, blocks: Sequence[int], skipped: int) -> tuple[list[int], list[int]]:
        """(group 0's, group 1's) tables of logical `blocks`, group 1's first `skipped` null."""
        base = self.logical_blocks
        window = [NULL_BLOCK if j < skipped else base + b for j, b in enumerate(blocks)]
        return list(blocks), window

    def logical(self, block_id: int) -> int:
        """The logical block behind a block id of either group."""
        base = self.logical_blocks
        return block_id - base if base <= block_id < 2 * base else block_id

    def guarded_blocks(self, group: int) -> list[int]:
        """Blocks a layer of `group` never gives a request: the other group's ids and the
        unused tail, up to and including the null block."""
        base = self.logical_blocks
        other = range(0, base) if group == WINDOW_GROUP else range(base, 2 * base)
        return [*other, *range(2 * base, self.num_blocks)]
