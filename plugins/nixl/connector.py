"""NixlConnector: prefill/decode disaggregation over NIXL, in pull mode (D READs) or push mode
(P WRITEs into blocks D registered; `NixlPushConnector`).

The facade builds the role's half: `scheduler.py` runs the request lifecycle and P's side
channel, `worker.py` registers memory and moves bytes. Matches vLLM's `NixlConnector`
(`vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`).
"""

from __future__ import annotations

import kvx
from kvx import (
    ANY_GEOMETRY,
    Capability,
    KVTransferConfig,
    RoleSplitConnector,
    SupportsHMA,
)
from kvx.plugins.nixl.config import NixlConfig, NixlPushConfig
from kvx.plugins.nixl.scheduler import NixlScheduler
from kvx.plugins.nixl.stats import NixlKVConnectorStats
from kvx.plugins.nixl.worker import NixlWorker


class NixlConnector(RoleSplitConnector[NixlScheduler, NixlWorker], SupportsHMA):
    """P keeps a finished prompt's blocks under a lease and serves its workers' NIXL metadata;
    D handshakes, READs the blocks (any TP, block size or layout on either side) and notifies
    P, which then frees them. Nothing is saved: D pulls P's blocks, and P holds them until D's
    notifications or the lease; loads are asynchronous.

    With several KV-cache groups (vLLM's hybrid allocator; pull mode) P hands D one table per
    group and D reads each layer from its group's blocks, in one handshake and one set of
    READs per P worker; the request is received when every group's blocks landed."""

    capabilities = ANY_GEOMETRY | {
        Capability.REMOTE_PREFILL,
        Capability.ASYNC_LOAD,
        Capability.MLA,
        Capability.HMA,
    }
    extra_config_schema = NixlConfig
    stats_type = NixlKVConnectorStats

    @classmethod
    def claims_for(cls, config: KVTransferConfig) -> frozenset[Capability]:
        """Push mode writes blocks as they are (no block size or layout conversion); push mode
        and `verify_transfers` move one KV-cache group only."""
        claims = frozenset(cls.capabilities)
        options = config.extra_config_as(cls.extra_config_schema)
        if options.transfer_mode == "push":
            claims -= {Capability.BLOCK_SIZE_MISMATCH, Capability.LAYOUT_CONVERSION}
        if options.transfer_mode == "push" or options.verify_transfers:
            claims -= {Capability.HMA}
        return claims

    @classmethod
    def fault_wait_s(cls, config: KVTransferConfig) -> float:
        """P frees an unread prompt's blocks when its lease runs out; D gives up on a dead P
        after the handshake or transfer timeout."""
        c = config.extra_config_as(NixlConfig)
        return max(c.kv_lease_duration, c.handshake_timeout_s, c.transfer_timeout_s)

    @classmethod
    def get_required_kvcache_layout(
        cls, config: KVTransferConfig, ctx: kvx.EngineContext | None = None
    ) -> str | None:
        """HND unless configured otherwise (a TP head slice of a block is then one byte
        range); None for MLA (matches vLLM)."""
        if ctx is not None and ctx.cache.use_mla:
            return None
        return config.extra_config_as(NixlConfig).required_layout

    @classmethod
    def supports_sleep_mode(cls, config: KVTransferConfig) -> bool:
        """No: P's peers hold the registered addresses of the KV memory sleep would free."""
        return False


class NixlPushConnector(NixlConnector):
    """NixlConnector with `transfer_mode` "push" by default (vLLM's `NixlPushConnector`): D
    registers its blocks with P, P WRITEs them and tells D."""

    extra_config_schema = NixlPushConfig
