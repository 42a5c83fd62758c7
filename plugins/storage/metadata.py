"""What the scheduler side sends the workers each step: loads and stores of stored blocks.

Token positions are request positions; a stored block `i` of a request holds tokens
`[i * storage_block_size, (i + 1) * storage_block_size)`. Plain fields only (msgpack-able).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvx import KVConnectorWorkerMetadata, LoadsAndStores


@dataclass
class LoadSpec:
    """Load tokens `[start, start + num_tokens)` into engine blocks `block_ids` (the blocks
    holding those tokens, in order; `start` is engine-block aligned).

    `keys[j]` is stored block `first_block + j`, written by a writer of `stages[j]` PP stages
    and `shards[j]` equal head shards."""

    req_id: str
    block_ids: list[int]
    start: int
    num_tokens: int
    first_block: int
    keys: list[str]
    stages: list[int]
    shards: list[int]


@dataclass
class StoreSpec:
    """Store stored blocks `first_block ...` (`keys`) from engine blocks `block_ids`, which hold
    tokens from `block_ids_start` (engine-block aligned) on."""

    req_id: str
    block_ids: list[int]
    block_ids_start: int
    first_block: int
    keys: list[str]


@dataclass
class StorageMetadata(LoadsAndStores[LoadSpec, StoreSpec]):
    """This step's block loads and stores (`LoadSpec`, `StoreSpec`)."""


@dataclass
class StorageWorkerMeta(KVConnectorWorkerMetadata):
    """Saves that failed on workers since their last report: (block keys, medium, reason)."""

    failed_saves: list[tuple[list[str], str, str]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, StorageWorkerMeta):
            raise TypeError(f"cannot aggregate {type(other).__name__} into StorageWorkerMeta")
        self.failed_saves += other.failed_saves
        return self
