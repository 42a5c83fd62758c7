"""What crosses between the scheduler and worker sides of LMCacheConnectorV1 (plain fields
only: msgspec-encodable, never pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvx import KVConnectorWorkerMetadata, LoadsAndStores


@dataclass
class LoadSpec:
    """Write tokens `[start, end)` of `token_ids` into the request's engine blocks.

    `token_ids` runs to the chunk boundary LMCache matched (a chunk is found only by all of its
    tokens), which may lie past `end`; tokens outside `[start, end)` are not written."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int


@dataclass
class StoreSpec:
    """Store tokens `[start, len(token_ids))` (`start` chunk-aligned: earlier chunks are stored
    already) from the request's engine blocks `block_ids`, which hold tokens from 0 on."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int


@dataclass
class LMCacheMetadata(LoadsAndStores[LoadSpec, StoreSpec]):
    """This step's chunk loads and stores (`LoadSpec`, `StoreSpec`)."""


@dataclass
class StoredChunk:
    """One chunk LMCache stored: its chain hash, its parent's, and its tokens."""

    parent: int | None
    token_ids: list[int]


@dataclass
class LMCacheWorkerMeta(KVConnectorWorkerMetadata):
    """Chunks stored on workers this step, by chain hash, with how many workers stored each."""

    chunks: dict[int, StoredChunk] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, LMCacheWorkerMeta):
            raise TypeError(f"cannot aggregate {type(other).__name__} into LMCacheWorkerMeta")
        self.chunks.update(other.chunks)
        for chunk, count in other.counts.items():
            self.counts[chunk] = self.counts.get(chunk, 0) + count
        return self
