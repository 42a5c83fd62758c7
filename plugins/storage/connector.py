"""SharedStorageConnector (alias ExampleConnector): the facade that builds the scheduler or the
worker half, each on its own backend opened from the configured URL."""

from __future__ import annotations

from typing import Any

from kvx import (
    ANY_GEOMETRY,
    Capability,
    ConnectorScheduler,
    ConnectorWorker,
    EngineContext,
    GroupScheduler,
    GroupWorker,
    RoleSplitConnector,
    StorageBackend,
    SupportsHMA,
    open_storage_backend,
    split_by_group,
)
from kvx.plugins.storage.config import SharedStorageConfig
from kvx.plugins.storage.keys import Geometry
from kvx.plugins.storage.metadata import StorageMetadata
from kvx.plugins.storage.scheduler import StorageScheduler
from kvx.plugins.storage.stats import StorageStats
from kvx.plugins.storage.worker import StorageWorker


class SharedStorageConnector(
    RoleSplitConnector[ConnectorScheduler, ConnectorWorker[Any]], SupportsHMA
):
    """Stores every full block of computed prompt KV in shared storage and loads the longest
    stored prefix of a new prompt, synchronously (vLLM's ExampleConnector, made per block,
    checksummed, engine-neutral and asynchronous on the save side).

    With several KV-cache groups (vLLM's hybrid allocator) each group is its own set of stored
    values (its layers' KV per block, under the same block keys: the layer set in a value's
    name tells the groups apart), saved and loaded through the group's own block table."""

    capabilities = ANY_GEOMETRY | {
        Capability.STORE_REUSE,
        Capability.DETECTS_CORRUPTION,
        Capability.MLA,
        Capability.STORE_PD,
        Capability.HMA,
    }
    extra_config_schema = SharedStorageConfig
    metadata_type = StorageMetadata
    stats_type = StorageStats

    def build_scheduler(self) -> ConnectorScheduler:
        return split_by_group(
            self.engine_context,
            self._scheduler_for,
            lambda halves, _: GroupScheduler(halves),
        )

    def build_worker(self) -> ConnectorWorker[Any]:
        return split_by_group(self.engine_context, self._worker_for, GroupWorker)

    def _scheduler_for(self, ctx: EngineContext) -> StorageScheduler:
        _, geometry, backend = self._open(ctx)
        try:
            parallel = ctx.parallel
            return StorageScheduler(
                geometry,
                backend,
                preferred_shards=min(parallel.tp_size, geometry.total_heads),
                preferred_pp=parallel.pp_size,
                store=self.kv_transfer_config.is_kv_producer,
                load=self.kv_transfer_config.is_kv_consumer,
            )
        except BaseException:
            backend.close()
            raise

    def _worker_for(self, ctx: EngineContext) -> StorageWorker:
        options, geometry, backend = self._open(ctx)
        try:
            return StorageWorker(
                geometry,
                backend,
                ctx,
                verify_checksums=options.verify_checksums,
                io_threads=options.io_threads,
                max_inflight_bytes=options.max_inflight_bytes,
                mac_key=options.mac_key,
            )
        except BaseException:
            backend.close()
            raise

    def _open(self, ctx: EngineContext) -> tuple[SharedStorageConfig, Geometry, StorageBackend]:
        options: SharedStorageConfig = self.options
        geometry = Geometry.of(ctx, options.namespace, options.storage_block_size)
        backend = open_storage_backend(options.url, options.backend_options(), ctx.registry)
        return options, geometry, backend


ExampleConnector = SharedStorageConnector

__all__ = ["ExampleConnector", "SharedStorageConnector"]
