"""LMCacheConnectorV1: the facade that builds the scheduler or the worker half."""

from __future__ import annotations

from typing import Any, ClassVar

from kvx import Capability, KVTransferConfig, RoleSplitConnector
from kvx.plugins.lmcache.config import LMCacheConfig
from kvx.plugins.lmcache.scheduler import LMCacheScheduler
from kvx.plugins.lmcache.stats import LMCacheStats
from kvx.plugins.lmcache.worker import LMCacheWorker


class LMCacheConnectorV1(RoleSplitConnector[LMCacheScheduler, LMCacheWorker]):
    """Stores the KV of computed prompt tokens in LMCache chunks (local CPU, local disk,
    redis://, lm://) and loads the longest prefix LMCache holds into the engine's paged blocks,
    through LMCache's own engine (vLLM's LMCacheConnectorV1, made to run on CPU)."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.STORE_REUSE})
    extra_config_schema = LMCacheConfig
    stats_type = LMCacheStats

    @classmethod
    def fault_wait_s(cls, config: KVTransferConfig) -> float:
        """A remote get and the workers' hit counts are waited for up to their timeouts."""
        options = config.extra_config_as(LMCacheConfig)
        return float(max(options.blocking_timeout_secs, options.lookup_timeout_s))

    @classmethod
    def claims_for(cls, config: KVTransferConfig) -> frozenset[Capability]:
        options = config.extra_config_as(LMCacheConfig)
        layerwise = {Capability.LAYERWISE} if options.use_layerwise else set()
        return frozenset(cls.capabilities | layerwise)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool(extra_config.get("use_layerwise", False))
