"""NixlConnector: prefill/decode disaggregation over NIXL, in pull mode (D READs) or push mode
(P WRITEs into blocks D registered; `NixlPushConnector`).

The facade builds the role's half: `scheduler.py` runs the request lifecycle and P's side
channel, `worker.py` registers memory and moves bytes. Matches vLLM's `NixlConnector`
(`vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`).
"""

from __future__ import annotations

from typing import Any

import kvx
from kvx import (
    ANY_GEOMETRY,
    Capability,
    ForwardContext,
    KVConnectorMetadata,
    KVTransferConfig,
    RoleSplitConnector,
)
from kvx.plugins.nixl.config import NixlConfig, NixlPushConfig
from kvx.plugins.nixl.scheduler import NixlScheduler
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
    _loads_started = False

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Start the step's loads here, before the forward pass, when the worker allows it
        (`start_reads_at_bind`, CPU KV): vLLM 0.32 starts an async-loading connector's loads
        after it has launched the forward (`kv_connector_model_runner_mixin.py`,
        `_get_kv_connector_output`), which on CPU is after the forward has run, so a READ
        that could finish during the step was only seen a step later."""
        super().bind_connector_metadata(connector_metadata)
        self._loads_started = self.worker.reads_at_bind()
        if self._loads_started:
            self.worker.start_load_kv(self._metadata())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self._loads_started:
            super().start_load_kv(forward_context, **kwargs)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._loads_started = False

    @classmethod
    def claims_for(cls, config: KVTransferConfig) -> frozenset[Capability]:
        """Push mode writes blocks as they are: no block size or layout conversion."""
        claims = frozenset(cls.capabilities)
        if config.extra_config_as(cls.extra_config_schema).transfer_mode == "push":
            claims -= {Capability.BLOCK_SIZE_MISMATCH, Capability.LAYOUT_CONVERSION}
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
