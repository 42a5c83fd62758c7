"""NixlConnector: prefill/decode disaggregation in pull mode over NIXL.

The facade builds the role's half: `scheduler.py` runs the request lifecycle and P's side
channel, `worker.py` registers memory and moves bytes. Matches vLLM's `NixlConnector`
(`vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`).
"""

from __future__ import annotations

import kvx
from kvx import (
    ANY_GEOMETRY,
    Capability,
    KVConnectorHandshakeMetadata,
    KVConnectorStats,
    KVTransferConfig,
    RoleSplitConnector,
)
from kvx.plugins.nixl.config import NixlConfig
from kvx.plugins.nixl.scheduler import NixlAgentHandshake, NixlScheduler
from kvx.plugins.nixl.stats import NixlKVConnectorStats
from kvx.plugins.nixl.worker import NixlWorker


class NixlConnector(RoleSplitConnector[NixlScheduler, NixlWorker]):
    """P keeps a finished prompt's blocks under a lease and serves its workers' NIXL metadata;
    D handshakes, READs the blocks (any TP, block size or layout on either side) and notifies
    P, which then frees them. Nothing is saved: D pulls P's blocks, and P holds them until D's
    notifications or the lease; loads are asynchronous."""

    capabilities = ANY_GEOMETRY | {Capability.REMOTE_PREFILL, Capability.ASYNC_LOAD, Capability.MLA}
    extra_config_schema = NixlConfig
    stats_type = NixlKVConnectorStats
    _held_reported = False

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.serve_handshakes({(0, tp): meta for tp, meta in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.serve_handshakes(metadata)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return NixlAgentHandshake(self.worker.handshake_payload())

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Stats since the last call, with P's held requests as gauges: reported while any is
        held and once more when none is (so a dashboard sees the hold end)."""
        stats = self.worker.stats
        held, oldest = self.worker.held()
        if held or self._held_reported:
            stats.set_held(held, oldest)
        self._held_reported = held > 0
        return None if stats.is_empty() else stats.clone_and_reset()

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
