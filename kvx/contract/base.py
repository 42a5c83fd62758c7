"""The connector contract: `KVConnectorBase_V1`, the class every kvx connector derives from.

Behaviour-compatible with vLLM's `KVConnectorBase_V1` (method names, arguments, return types,
defaults), spoken over kvx's engine-neutral types (`kvx.contract.types`). One connector class serves
two roles: the engine builds one instance with `KVConnectorRole.SCHEDULER` in the scheduler process
and one with `KVConnectorRole.WORKER` per worker (TP x PP rank). The two never share memory;
everything the scheduler side tells workers travels in `KVConnectorMetadata`. The types its
methods speak besides the engine's are in `kvx.contract.auxiliary`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from kvx.contract.auxiliary import (
    CONTRACT_VERSION,
    Capability,
    CopyBlocksOp,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    KVTransferResults,
)
from kvx.contract.events import KVCacheEvent, KVConnectorKVEvents
from kvx.contract.handshake import KVConnectorHandshakeMetadata
from kvx.contract.stats import KVConnectorStats

if TYPE_CHECKING:
    import torch

    from kvx.config.transfer import KVTransferConfig
    from kvx.contract.types import (
        EngineContext,
        ForwardContext,
        KVCacheBlocks,
        Request,
        SchedulerOutput,
    )


class KVConnectorBase_V1(ABC):
    """Base class of every kvx connector.

    Constructed as `Connector(config, role, ctx)`. Class attributes a connector may set:
    `contract_version` (the (major, minor) it implements; the registry refuses another major)
    and `capabilities` (the `Capability` claims the conformance suite checks).
    """

    contract_version: ClassVar[tuple[int, int]] = CONTRACT_VERSION
    capabilities: ClassVar[frozenset[Capability]] = frozenset()

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, ctx: EngineContext) -> None:
        self._kv_transfer_config = config
        self._role = role
        self._ctx = ctx
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        return self._kv_transfer_config

    @property
    def engine_context(self) -> EngineContext:
        return self._ctx

    # ------------------------------------------------------------------ worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker: called before every model execution with this step's metadata.

        Overrides must call `super().bind_connector_metadata(...)`.
        """
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Worker: called after every model execution; drops the step's metadata."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """Worker: the metadata bound for the current step (it must be bound)."""
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound for this step")
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        """Worker: whether metadata is bound for the current step."""
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker: called once after the KV cache tensors exist (layer name -> tensor).

        Connectors that pre-register memory (NIXL) do it here. Default: nothing.
        """

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        """Worker: called instead of `register_kv_caches` when `prefer_cross_layer_blocks` is
        true and the model's layers are uniform; `kv_cache` has a leading layers dim."""

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """True if the connector wants one cross-layer tensor (`register_cross_layers_kv_cache`)."""
        return False

    def unregister_kv_caches(self) -> None:
        """Worker: the engine is going to sleep and frees its KV memory. Idempotent."""

    def restore_kv_caches(self) -> None:
        """Worker: the engine woke up and re-created the same KV tensors. Idempotent."""

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        """Worker: gives the platform's host<->device block copy for host-buffer transfers."""

    def get_mem_pool_context(self) -> Any:
        """Worker: a context manager to allocate KV memory in, or None."""
        return None

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        """Worker: requests were preempted this step; their blocks may be overwritten by the
        coming forward pass. Called before `bind_connector_metadata` of that step.

        Connectors with asynchronous saves must finish (or cancel) stores that read those
        blocks before returning. Default: nothing.
        """

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker: start loading KV for this step, before the forward pass.

        Loads needed by this step's forward must be started here (and be complete, at the latest,
        in `wait_for_layer_load`). Asynchronous loads may run across steps and finish later through
        `get_finished`. Also called on steps without a forward pass so async work can progress.
        """

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker: block until `layer_name`'s KV is in the paged buffer (inside the layer,
        before attention reads it). Synchronous connectors that loaded everything may return."""

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Worker: the layer has written its KV for this step; start saving it (may be async).
        `kv_layer` is the layer's paged tensor."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Worker: once per step as the forward context exits, metadata still bound.

        When it returns the blocks being saved must be safe to reuse: either the saves completed
        or the connector keeps the request (via `request_finished` returning True) until it reports
        the request in `get_finished`'s sending set.
        """

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker: after each step, return (done sending/saving, done receiving/loading).

        `finished_req_ids` are requests the scheduler finished since the last call. An id in the
        sending set must be one the scheduler finished with `request_finished` returning True
        (now or in an earlier step). Default: `(None, None)`.
        """
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVTransferResults:
        """Worker: preferred over `get_finished`; adds `failed_recving` (default wraps it)."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ())
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker: block ids whose load failed.

        Async loads: report no later than the step that reports the request finished-receiving
        (which must still happen). Sync loads: report in the step the failure was detected.
        """
        return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker: stats since the last call (the connector then starts afresh), or None."""
        return None

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """Worker: KV cache events since the last call, or None."""
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker: after `register_kv_caches`, what peers need to connect to this worker."""
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Worker: after each step, metadata for the scheduler side (merged across workers)."""
        return None

    def finish_forward(self) -> None:
        """Worker: the model runner finished a forward pass (after `wait_for_save`)."""

    def reset_capture_state(self) -> None:
        """Worker: CUDA-graph capture finished; forget anything recorded during capture."""

    def shutdown(self) -> None:
        """Both sides: finish or cancel async work, close threads, sockets and files."""

    # ------------------------------------------------------------------ scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler: how many tokens beyond `num_computed_tokens` (local prefix hits) the
        connector can supply, and whether they load asynchronously.

        Called whenever the scheduler considers a waiting request, possibly many times for one
        request (also after preemption), so it must be free of side effects. Return `None` for
        "not decided yet, ask again later". The bool must be False when the count is 0.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Scheduler: blocks were allocated for `request`; record what to load.

        Decide on `num_external_tokens` (0 means load nothing), not on whether `blocks` is empty.
        Async loads may see this twice: at allocation for the external tokens and again after the
        load finished.
        """

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler: once per step after scheduling, pack the workers' work for this step.

        Must not mutate `scheduler_output`; resets the connector's per-step state.
        """

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler: the aggregated worker results of a step arrived."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler: exactly once when a request finishes (any reason, aborts too), before its
        blocks are freed.

        Return `(True, params)` to keep the blocks until a worker reports the request in the
        finished-sending set; `params` become the request's output `kv_transfer_params`.
        """
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler: drain the KV cache events produced since the last call."""
        return ()

    def get_finished_count(self) -> int | None:
        """Both sides: how many workers must report a request finished (None = every worker)."""
        return None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Scheduler: every worker's handshake metadata, keyed by TP rank (start serving it)."""

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Scheduler: same, keyed by (pp_rank, tp_rank).

        Default: refuses pp_rank != 0 and forwards `{tp_rank: meta}` to
        `set_xfer_handshake_metadata` (matches vLLM 0.33).
        """
        pp_ranks = sorted({pp for pp, _ in metadata if pp != 0})
        if pp_ranks:
            raise ValueError(
                f"{type(self).__name__} is not pipeline-parallel aware but got handshake "
                f"metadata for pp_rank(s) {pp_ranks}; override "
                "set_xfer_handshake_metadata_pp_aware to support PP > 1"
            )
        self.set_xfer_handshake_metadata({tp: meta for (_, tp), meta in metadata.items()})

    def reset_cache(self) -> bool | None:
        """Scheduler: the engine resets its prefix cache; drop cached KV if the connector can.
        Return True/False for success, None if not supported."""
        return None

    def on_new_request(self, request: Request) -> None:
        """Scheduler: a request was added to the engine."""

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Scheduler: the engine's KV cache manager, for connectors that inspect it."""

    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        """Scheduler: the engine's block pool, for connectors that inspect it."""

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Scheduler: which KV-cache groups an external hit covers (default: group 0)."""
        return (0,)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[str, int]:
        """Scheduler: tokens of an external hit per source (e.g. `{"DISK": 256}`), for metrics."""
        return {}

    def register_finished_partial_tail(self, request: Request, block_ids: list[int]) -> bool:
        """Scheduler: push-mode helper; True if the connector takes the partial tail block."""
        return False

    def has_pending_block_frees(self) -> bool:
        """Scheduler: True while the connector still owes the engine block frees (push mode)."""
        return False

    def has_pending_push_work(self) -> bool:
        """Scheduler: True while push-mode sends are queued, so the engine keeps stepping."""
        return False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """A producer whose hand-off is pending when preempted is recomputed, not handed off."""
        return self._kv_transfer_config.is_kv_producer

    # ------------------------------------------------------------------ class level

    @classmethod
    def get_required_kvcache_layout(
        cls, config: KVTransferConfig, ctx: EngineContext | None = None
    ) -> str | None:
        """Class: the KV layout the connector needs the engine to allocate (None = any)."""
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout must be called on a connector class")
        return None

    @classmethod
    def claims_for(cls, config: KVTransferConfig) -> frozenset[Capability]:
        """Class: the capabilities this connector claims under `config` (default: the class's
        `capabilities`; composite connectors derive them from their children)."""
        return frozenset(cls.capabilities)

    @classmethod
    def fault_wait_s(cls, config: KVTransferConfig) -> float:
        """Class: the longest (seconds) this connector may leave an engine without progress
        while it deals with a fault under `config`: a lease running out, a handshake or
        transfer timeout. The conformance suite's stall limit stretches to cover it while a
        fault is handled. 0 (default): it never waits that way."""
        return 0.0

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Class: True if the connector works inside layer hooks (no full CUDA-graph capture)."""
        return False

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Class: rebuild a stats object from a plain dict (empty when `data` is None)."""
        return None

    @classmethod
    def build_prom_metrics(
        cls,
        config: KVTransferConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """Class: per-connector Prometheus metrics, or None."""
        return None

    @classmethod
    def supports_sleep_mode(cls, config: KVTransferConfig) -> bool:
        """Class: whether the engine may sleep (free and re-create KV memory) with this
        connector; see `unregister_kv_caches` / `restore_kv_caches`."""
        return True


KVConnectorBase = KVConnectorBase_V1
KVConnectorBaseType = KVConnectorBase_V1
