"""NixlConnector: prefill/decode disaggregation in pull mode over NIXL.

The class dispatches by role: `scheduler.py` runs the request lifecycle and P's side channel,
`worker.py` registers memory and moves bytes. Matches vLLM's `NixlConnector` (reference 5.5).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

import kvx
from kvx import (
    Capability,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVTransferConfig,
)
from kvx.plugins.nixl.config import NixlConfig
from kvx.plugins.nixl.metadata import NixlMetadata
from kvx.plugins.nixl.scheduler import NixlAgentHandshake, NixlScheduler
from kvx.plugins.nixl.stats import NixlKVConnectorStats
from kvx.plugins.nixl.worker import NixlWorker


class NixlConnector(KVConnectorBase_V1):
    """P keeps a finished prompt's blocks under a lease and serves its workers' NIXL metadata;
    D handshakes, READs the blocks (any TP, block size or layout on either side) and notifies
    P, which then frees them."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {
            Capability.REMOTE_PREFILL,
            Capability.ASYNC_LOAD,
            Capability.HETERO_TP,
            Capability.BLOCK_SIZE_MISMATCH,
            Capability.LAYOUT_CONVERSION,
        }
    )

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, ctx: kvx.EngineContext
    ) -> None:
        super().__init__(config, role, ctx)
        options = config.extra_config_as(NixlConfig)
        self._scheduler: NixlScheduler | None = None
        self._worker: NixlWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = NixlScheduler(options, config, ctx)
        else:
            self._worker = NixlWorker(options, config, ctx)

    def _sched(self) -> NixlScheduler:
        if self._scheduler is None:
            raise RuntimeError("this NixlConnector is a worker; that call is scheduler-side")
        return self._scheduler

    def _work(self) -> NixlWorker:
        if self._worker is None:
            raise RuntimeError("this NixlConnector is a scheduler; that call is worker-side")
        return self._worker

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: kvx.Request) -> None:
        self._sched().on_new_request(request)

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> NixlMetadata:
        return self._sched().build_connector_meta()

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().serve_handshakes({(0, tp): meta for tp, meta in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().serve_handshakes(metadata)

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return NixlAgentHandshake(self._work().handshake_payload())

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, NixlMetadata):
            raise TypeError(f"expected NixlMetadata, got {type(meta).__name__}")
        self._work().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request is computed only after its read finished."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing to save: D pulls P's blocks."""

    def wait_for_save(self) -> None:
        """Nothing to save: P holds the blocks until D's notifications or the lease."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, recved = self._work().get_finished()
        return sent or None, recved or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self._work().stats
        return None if stats.is_empty() else stats.clone_and_reset()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- class level ----------------------------------------------------------------------

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

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return NixlKVConnectorStats(data)
