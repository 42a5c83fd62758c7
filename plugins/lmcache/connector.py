"""LMCacheConnectorV1: the connector class, a thin facade over its scheduler and worker halves.

kvx core has no role-split connector base yet; this class only routes each contract method to
`LMCacheScheduler` or `LMCacheWorker`, so it can move onto such a base unchanged.
"""

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
from kvx.plugins.lmcache.config import LMCacheConfig
from kvx.plugins.lmcache.metadata import LMCacheMetadata
from kvx.plugins.lmcache.scheduler import LMCacheScheduler
from kvx.plugins.lmcache.stats import LMCacheStats
from kvx.plugins.lmcache.worker import LMCacheWorker


class LMCacheConnectorV1(KVConnectorBase_V1):
    """Stores the KV of computed prompt tokens in LMCache chunks (local CPU, local disk,
    redis://, lm://) and loads the longest prefix LMCache holds into the engine's paged blocks,
    through LMCache's own engine (vLLM's LMCacheConnectorV1, made to run on CPU)."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.STORE_REUSE})

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, ctx: kvx.EngineContext
    ) -> None:
        super().__init__(config, role, ctx)
        self.options = config.extra_config_as(LMCacheConfig)
        self._scheduler: LMCacheScheduler | None = None
        self._worker: LMCacheWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = LMCacheScheduler(self.options, ctx, store=config.is_kv_producer)
        else:
            self._worker = LMCacheWorker(self.options, ctx)

    @classmethod
    def claims_for(cls, config: KVTransferConfig) -> frozenset[Capability]:
        options = config.extra_config_as(LMCacheConfig)
        layerwise = {Capability.LAYERWISE} if options.use_layerwise else set()
        return frozenset(cls.capabilities | layerwise)

    @property
    def scheduler(self) -> LMCacheScheduler:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on a worker-side connector")
        return self._scheduler

    @property
    def worker(self) -> LMCacheWorker:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on a scheduler-side connector")
        return self._worker

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return LMCacheStats(dict(data or {}))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool(extra_config.get("use_layerwise", False))

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
        """Stores finish inside the step that computed the tokens: blocks are never held."""
        self.scheduler.request_finished(request)
        return False, None

    def take_events(self) -> Iterable[kvx.KVCacheEvent]:
        return self.scheduler.take_events()

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.worker.save_kv_layer(layer_name, self._metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.take_stats()

    def shutdown(self) -> None:
        """Always returns (LMCache's own teardown is bounded, see `engine.destroy_engine`)."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def _metadata(self) -> LMCacheMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMCacheMetadata):
            raise TypeError(f"expected LMCacheMetadata, got {type(meta).__name__}")
        return meta
