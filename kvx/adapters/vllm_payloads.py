"""kvx payloads carried through vLLM in vLLM's own base types, and back.

vLLM moves a connector's per-step metadata, worker metadata, handshake metadata, stats and KV
events between its processes and merges them across workers by calling methods on them; each
wrapper here holds the kvx object and forwards those calls, so the kvx connector only ever sees
kvx types. Imports vLLM (only `kvx.adapters.vllm` imports this module).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed import kv_events as vllm_events
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvx
from kvx.contract.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockStoreFailed,
    KVCacheEvent,
)


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One step's kvx metadata plus the requests the step preempted (vLLM 0.32 hands
    `handle_preemptions` the metadata, kvx hands it the preempted ids)."""

    kvx_metadata: kvx.KVConnectorMetadata
    preempted_req_ids: set[str] = field(default_factory=set)


@dataclass
class HandshakeMetadata(KVConnectorHandshakeMetadata):
    kvx_metadata: kvx.KVConnectorHandshakeMetadata


class WorkerMetadata(KVConnectorWorkerMetadata):
    """A worker's kvx metadata; vLLM merges workers' with `aggregate`."""

    def __init__(self, kvx_metadata: kvx.KVConnectorWorkerMetadata) -> None:
        self.kvx_metadata = kvx_metadata

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, WorkerMetadata):
            raise TypeError(f"cannot merge {type(other).__name__} into kvx worker metadata")
        self.kvx_metadata = self.kvx_metadata.aggregate(other.kvx_metadata)
        return self


class Stats(KVConnectorStats):
    """vLLM's stats object around a kvx `KVConnectorStats` (same `data` dict)."""

    def __init__(self, kvx_stats: kvx.KVConnectorStats) -> None:
        super().__init__(data=kvx_stats.data)
        self.kvx_stats = kvx_stats

    def to_dict(self) -> dict[str, Any]:
        return self.kvx_stats.to_dict()

    def reset(self) -> None:
        self.kvx_stats.reset()
        self.data = self.kvx_stats.data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, Stats):
            raise TypeError(f"cannot merge {type(other).__name__} into kvx connector stats")
        self.kvx_stats = self.kvx_stats.aggregate(other.kvx_stats)
        self.data = self.kvx_stats.data
        return self

    def reduce(self) -> dict[str, int | float]:
        return self.kvx_stats.reduce()

    def is_empty(self) -> bool:
        return self.kvx_stats.is_empty()


class WorkerEvents(vllm_events.KVConnectorKVEvents):
    """A worker's kvx KV events; vLLM merges workers' and hands them to the scheduler side."""

    def __init__(self, kvx_events: kvx.KVConnectorKVEvents) -> None:
        self.kvx_events = kvx_events

    def add_events(self, events: list[Any]) -> None:
        self.kvx_events.add_events(events)

    def aggregate(self) -> WorkerEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.kvx_events.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        return self.kvx_events.get_all_events()

    def get_number_of_workers(self) -> int:
        return self.kvx_events.get_number_of_workers()

    def clear_events(self) -> None:
        self.kvx_events.clear_events()


def cache_event(event: KVCacheEvent) -> vllm_events.KVCacheEvent:
    """A kvx KV cache event as the vLLM event vLLM's publisher sends."""
    if isinstance(event, BlockStored):
        return vllm_events.BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=None,
        )
    if isinstance(event, BlockRemoved):
        return vllm_events.BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium)
    if isinstance(event, AllBlocksCleared):
        return vllm_events.AllBlocksCleared()
    raise TypeError(f"kvx KV cache event {type(event).__name__} has no vLLM equivalent")


def cache_events(events: Iterable[KVCacheEvent]) -> list[vllm_events.KVCacheEvent]:
    """vLLM's events for kvx's; `BlockStoreFailed` (a kvx extension vLLM has no kind for) is
    left out: kvx's stats and logs report failed saves."""
    return [cache_event(e) for e in events if not isinstance(e, BlockStoreFailed)]


def hit_sources(sources: dict[str, int]) -> dict[CacheHitSource, int]:
    """kvx's per-source token counts (`{"DISK": 256}`) keyed by vLLM's `CacheHitSource`;
    unknown names count as `EXTERNAL_UNSPECIFIED`."""
    out: dict[CacheHitSource, int] = {}
    for name, count in sources.items():
        if not count:
            continue
        try:
            source = CacheHitSource(name.lower())
        except ValueError:
            source = CacheHitSource.EXTERNAL_UNSPECIFIED
        out[source] = out.get(source, 0) + count
    return out


def unwrap_output(output: Any) -> kvx.KVConnectorOutput:
    """vLLM's aggregated `KVConnectorOutput` as kvx's."""
    stats = output.kv_connector_stats
    events = output.kv_cache_events
    meta = output.kv_connector_worker_meta
    return kvx.KVConnectorOutput(
        finished_sending=set(output.finished_sending) if output.finished_sending else None,
        finished_recving=set(output.finished_recving) if output.finished_recving else None,
        failed_recving=set(output.failed_recving or ()),
        invalid_block_ids=set(output.invalid_block_ids or ()),
        kv_connector_stats=stats.kvx_stats if isinstance(stats, Stats) else None,
        kv_cache_events=events.kvx_events if isinstance(events, WorkerEvents) else None,
        kv_connector_worker_meta=meta.kvx_metadata if isinstance(meta, WorkerMetadata) else None,
        expected_finished_count=output.expected_finished_count,
    )
