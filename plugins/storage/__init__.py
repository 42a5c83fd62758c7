"""SharedStorageConnector (alias ExampleConnector): KV blocks in shared storage, by URL.

The class only dispatches by role: `scheduler.py` decides what to load and store, `worker.py`
moves the bytes, `backends/` talk to the storage (fsspec or Redis).
"""

from __future__ import annotations

from typing import Any, ClassVar

import kvx
from kvx import (
    Capability,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVTransferConfig,
)
from kvx.plugins.storage.backends.base import BackendOptions, open_backend
from kvx.plugins.storage.config import FILE_MODES, SharedStorageConfig
from kvx.plugins.storage.keys import Geometry
from kvx.plugins.storage.metadata import StorageMetadata
from kvx.plugins.storage.scheduler import StorageScheduler
from kvx.plugins.storage.worker import StorageWorker


class SharedStorageConnector(KVConnectorBase_V1):
    """Stores every full block of computed prompt KV in shared storage and loads the longest
    stored prefix of a new prompt, synchronously (vLLM's ExampleConnector, made per block,
    checksummed, engine-neutral and asynchronous on the save side)."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {
            Capability.STORE_REUSE,
            Capability.DETECTS_CORRUPTION,
            Capability.HETERO_TP,
            Capability.BLOCK_SIZE_MISMATCH,
            Capability.LAYOUT_CONVERSION,
        }
    )

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, ctx: kvx.EngineContext
    ) -> None:
        super().__init__(config, role, ctx)
        options = config.extra_config_as(SharedStorageConfig)
        geometry = Geometry.of(ctx, options.namespace, options.storage_block_size)
        backend = open_backend(
            options.url,
            BackendOptions(
                ttl_s=options.redis_ttl_s,
                timeout_s=options.timeout_s,
                file_mode=FILE_MODES[options.permissions],
            ),
        )
        self._scheduler: StorageScheduler | None = None
        self._worker: StorageWorker | None = None
        try:
            if role is KVConnectorRole.SCHEDULER:
                tp = ctx.parallel.tp_size
                self._scheduler = StorageScheduler(
                    geometry,
                    backend,
                    preferred_shards=min(tp, geometry.total_heads),
                    preferred_pp=ctx.parallel.pp_size,
                    store=config.is_kv_producer,
                )
            else:
                self._worker = StorageWorker(
                    geometry,
                    backend,
                    ctx,
                    verify_checksums=options.verify_checksums,
                    io_threads=options.io_threads,
                    max_inflight_bytes=options.max_inflight_bytes,
                )
        except BaseException:
            backend.close()
            raise
        self._backend = backend

    @property
    def scheduler(self) -> StorageScheduler:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on a worker-side connector")
        return self._scheduler

    @property
    def worker(self) -> StorageWorker:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on a scheduler-side connector")
        return self._worker

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVConnectorStats(dict(data or {}))

    # scheduler side
    def on_new_request(self, request: kvx.Request) -> None:
        self.scheduler.on_new_request(request)

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

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are durable by the step's `wait_for_save`: blocks are never held."""
        self.scheduler.request_finished(request)
        return False, None

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are synchronous: everything is in place when `start_load_kv` returns."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.worker.save_kv_layer(layer_name, kv_layer, self._metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.take_stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        else:
            self._backend.close()

    def _metadata(self) -> StorageMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StorageMetadata):
            raise TypeError(f"expected StorageMetadata, got {type(meta).__name__}")
        return meta


ExampleConnector = SharedStorageConnector

__all__ = ["ExampleConnector", "SharedStorageConnector"]
