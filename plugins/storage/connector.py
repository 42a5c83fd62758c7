"""SharedStorageConnector (alias ExampleConnector): the facade that builds the scheduler or the
worker half, each on its own backend opened from the configured URL."""

from __future__ import annotations

from kvx import (
    ANY_GEOMETRY,
    Capability,
    RoleSplitConnector,
    StorageBackend,
    open_storage_backend,
)
from kvx.plugins.storage.config import SharedStorageConfig
from kvx.plugins.storage.keys import Geometry
from kvx.plugins.storage.scheduler import StorageScheduler
from kvx.plugins.storage.stats import StorageStats
from kvx.plugins.storage.worker import StorageWorker


class SharedStorageConnector(RoleSplitConnector[StorageScheduler, StorageWorker]):
    """Stores every full block of computed prompt KV in shared storage and loads the longest
    stored prefix of a new prompt, synchronously (vLLM's ExampleConnector, made per block,
    checksummed, engine-neutral and asynchronous on the save side)."""

    capabilities = ANY_GEOMETRY | {
        Capability.STORE_REUSE,
        Capability.DETECTS_CORRUPTION,
        Capability.MLA,
        Capability.STORE_PD,
    }
    extra_config_schema = SharedStorageConfig
    stats_type = StorageStats

    def build_scheduler(self) -> StorageScheduler:
        _, geometry, backend = self._open()
        try:
            parallel = self.engine_context.parallel
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

    def build_worker(self) -> StorageWorker:
        options, geometry, backend = self._open()
        try:
            return StorageWorker(
                geometry,
                backend,
                self.engine_context,
                verify_checksums=options.verify_checksums,
                io_threads=options.io_threads,
                max_inflight_bytes=options.max_inflight_bytes,
                mac_key=options.mac_key,
            )
        except BaseException:
            backend.close()
            raise

    def _open(self) -> tuple[SharedStorageConfig, Geometry, StorageBackend]:
        options: SharedStorageConfig = self.options
        geometry = Geometry.of(self.engine_context, options.namespace, options.storage_block_size)
        backend = open_storage_backend(
            options.url, options.backend_options(), self.engine_context.registry
        )
        return options, geometry, backend


ExampleConnector = SharedStorageConnector

__all__ = ["ExampleConnector", "SharedStorageConnector"]
