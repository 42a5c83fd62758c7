"""KV cache events a connector reports (blocks stored in / removed from its tiers).

Matches the event kinds vLLM publishes (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) and the
worker-side container `KVConnectorKVEvents` that is merged across workers. `BlockStoreFailed`
is a kvx extension (vLLM has no such kind): kvx's vLLM adapter does not forward it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVCacheEvent:
    """Base class of every KV cache event."""


@dataclass(frozen=True)
class BlockStored(KVCacheEvent):
    """Blocks became available in `medium` (e.g. `"CPU"`, `"DISK"`, `"REDIS"`)."""

    block_hashes: tuple[bytes | int, ...]
    parent_block_hash: bytes | int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True)
class BlockRemoved(KVCacheEvent):
    """Blocks were evicted from `medium`."""

    block_hashes: tuple[bytes | int, ...]
    medium: str | None = None


@dataclass(frozen=True)
class BlockStoreFailed(KVCacheEvent):
    """kvx extension, not forwarded to vLLM: storing blocks in `medium` failed (a full disk,
    an unreachable store), so they are not there to load; `reason` is the error. Built-in
    connectors' workers report failures in their worker metadata and the scheduler half
    emits each distinct one once from `take_events`."""

    block_hashes: tuple[bytes | int | str, ...]
    medium: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class AllBlocksCleared(KVCacheEvent):
    """Every block of the connector's cache was dropped (e.g. on `reset_cache`)."""


@dataclass
class KVConnectorKVEvents:
    """Events one or more workers produced in a step.

    Merging across workers counts how many workers contributed, so a scheduler can tell an event
    that every worker reported from one that only some did.
    """

    events: list[KVCacheEvent] = field(default_factory=list)
    num_workers: int = 1

    def add_events(self, events: Iterable[KVCacheEvent]) -> None:
        self.events.extend(events)

    def aggregate(self, other: KVConnectorKVEvents) -> KVConnectorKVEvents:
        self.add_events(other.events)
        self.increment_workers(other.num_workers)
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.events.clear()
        self.num_workers = 0
