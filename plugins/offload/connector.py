"""OffloadingConnector: the connector class, which dispatches to its scheduler or worker side."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import kvx
from kvx import (
    Capability,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    KVTransferConfig,
)
from kvx.plugins.offload.config import OffloadingConfig
from kvx.plugins.offload.metadata import OffloadMetadata
from kvx.plugins.offload.scheduler import OffloadScheduler, chunk_geometry
from kvx.plugins.offload.worker import OffloadWorker


class OffloadingConnector(KVConnectorBase_V1):
    """Offloads full chunks of KV blocks to a CPU tier and loads them back asynchronously when a
    later request (or a preempted one) needs a prefix the engine no longer holds."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.ASYNC_LOAD, Capability.OFFLOAD}
    )

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, ctx: kvx.EngineContext
    ) -> None:
        super().__init__(config, role, ctx)
        options = config.extra_config_as(OffloadingConfig)
        self._scheduler: OffloadScheduler | None = None
        self._worker: OffloadWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = OffloadScheduler(options, ctx)
        else:
            per_chunk, slots, _ = chunk_geometry(options, ctx)
            self._worker = OffloadWorker(ctx, per_chunk, slots, options.disk_url)

    @property
    def scheduler(self) -> OffloadScheduler:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on a worker-side connector")
        return self._scheduler

    @property
    def worker(self) -> OffloadWorker:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on a scheduler-side connector")
        return self._worker

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVConnectorStats(dict(data or {}))

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[kvx.KVCacheEvent]:
        return self.scheduler.take_events()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache()

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        self.worker.handle_preemptions()

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request is computed only after its load finished."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Stores copy whole chunks once the step's forward is done (`wait_for_save`)."""

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker.get_finished()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.take_stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
