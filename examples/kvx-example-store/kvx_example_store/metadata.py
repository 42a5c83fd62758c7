"""What the scheduler half sends the workers each step (plain fields: it may cross processes)."""

from __future__ import annotations

from dataclasses import dataclass

from kvx import LoadsAndStores


@dataclass
class BlockRun:
    """Blocks of one request to load or store: `keys[i]` is the stored key of the KV in
    engine block `block_ids[i]`."""

    req_id: str
    block_ids: list[int]
    keys: list[str]


@dataclass
class ExampleStoreMetadata(LoadsAndStores[BlockRun, BlockRun]):
    """This step's work: `loads` (read into the blocks before the forward) and `stores`
    (written from the blocks the forward just computed)."""
