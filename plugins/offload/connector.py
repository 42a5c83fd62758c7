"""OffloadingConnector: the facade that builds the scheduler or the worker half."""

from __future__ import annotations

from typing import ClassVar

from kvx import Capability, RoleSplitConnector, SupportsHMA
from kvx.plugins.offload.config import OffloadingConfig
from kvx.plugins.offload.scheduler import OffloadScheduler, chunk_geometry
from kvx.plugins.offload.stats import OffloadStats
from kvx.plugins.offload.worker import OffloadWorker


class OffloadingConnector(RoleSplitConnector[OffloadScheduler, OffloadWorker], SupportsHMA):
    """Offloads full chunks of KV blocks to a CPU tier and loads them back asynchronously when a
    later request (or a preempted one) needs a prefix the engine no longer holds. Loads are
    asynchronous and stores copy whole chunks once the step's forward is done
    (`wait_for_save`): nothing happens per layer. With several KV-cache groups (vLLM's
    hybrid allocator) a chunk holds every layer, each copied through its own group's table;
    a sliding group's null entries are neither stored nor loaded."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.ASYNC_LOAD, Capability.OFFLOAD, Capability.MLA, Capability.HMA}
    )
    extra_config_schema = OffloadingConfig
    stats_type = OffloadStats

    def build_worker(self) -> OffloadWorker:
        options = self.options
        per_chunk, slots, _ = chunk_geometry(options, self.engine_context)
        return OffloadWorker(
            self.engine_context, per_chunk, slots, options.disk_url, options.inline_copy_bytes
        )
