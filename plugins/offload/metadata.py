"""What crosses between the scheduler and worker sides of the OffloadingConnector."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvx import KVConnectorWorkerMetadata, LoadsAndStores


@dataclass
class LoadSpec:
    """Copy CPU chunk slots into engine blocks: `gpu_blocks[i]` <- slot `slots[i]`, block
    `offsets[i]` within that chunk. With several KV-cache groups, `gpu_blocks` is group 0's
    and `group_blocks[g - 1]` group g's (same positions); -1: that group needs no KV there
    (outside its sliding window), nothing is written."""

    req_id: str
    gpu_blocks: list[int]
    slots: list[int]  # -1: the chunk is on disk under `disk_keys[i]`
    offsets: list[int]
    disk_keys: list[str] = field(default_factory=list)
    group_blocks: list[list[int]] = field(default_factory=list)

    def tables(self) -> list[list[int]]:
        """Each group's engine blocks, in group order."""
        return [self.gpu_blocks, *self.group_blocks]


@dataclass
class StoreSpec:
    """Copy whole chunks out: chunk `keys[j]` is the engine blocks
    `gpu_blocks[j * blocks_per_chunk:(j + 1) * blocks_per_chunk]` into slot `slots[j]`
    (group 0's blocks; with several KV-cache groups, `group_blocks[g - 1]` group g's)."""

    req_id: str
    keys: list[str]
    slots: list[int]
    gpu_blocks: list[int]
    group_blocks: list[list[int]] = field(default_factory=list)

    def tables(self) -> list[list[int]]:
        """Each group's engine blocks, in group order."""
        return [self.gpu_blocks, *self.group_blocks]


@dataclass
class OffloadMetadata(LoadsAndStores[LoadSpec, StoreSpec]):
    """This step's chunk loads and stores, and the CPU tier's housekeeping."""

    held: list[str] = field(default_factory=list)  # requests kept until their stores finish
    spills: list[tuple[str, int]] = field(default_factory=list)  # (key, slot): CPU -> disk
    disk_drops: list[str] = field(default_factory=list)  # disk chunks to delete


@dataclass
class OffloadWorkerMeta(KVConnectorWorkerMetadata):
    """Chunk keys whose store finished on a worker (counts add up across workers), and chunk
    keys a worker could not write to the disk tier (with the error)."""

    stored: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    spill_failed: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, OffloadWorkerMeta):
            raise TypeError(f"cannot aggregate {type(other).__name__} into OffloadWorkerMeta")
        for mine, theirs in ((self.stored, other.stored), (self.failed, other.failed)):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count
        self.spill_failed.update(other.spill_failed)
        return self
