"""MultiConnector: several connectors behind one, with vLLM's MultiConnector semantics.

Loads come from the first child that reports a hit; saves go to every child; a request's blocks
are freed only after the last child that took ownership reported it sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any, ClassVar

import kvx
from kvx import (
    Capability,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorKVEvents,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    KVTransferConfig,
    KVTransferResults,
    PluginRegistry,
    SupportsHMA,
    create_connector,
    supports_hma,
)
from kvx.plugins.multi.metadata import MultiKVConnectorMetadata, MultiKVConnectorWorkerMetadata
from kvx.plugins.multi.stats import MultiKVConnectorStats

# Claims any child brings to the whole, and claims every child must share.
_ANY_CHILD = frozenset(
    {
        Capability.REMOTE_PREFILL,
        Capability.STORE_REUSE,
        Capability.ASYNC_LOAD,
        Capability.OFFLOAD,
        Capability.DETECTS_CORRUPTION,
        Capability.LAYERWISE,
    }
)


def child_configs(
    config: KVTransferConfig, registry: PluginRegistry | None = None
) -> list[KVTransferConfig]:
    """The children's configs, inheriting the parent's engine id and role (vLLM semantics);
    each validated against `registry` when given."""
    inherited = {"engine_id": config.engine_id, "kv_role": config.kv_role}
    return [
        KVTransferConfig.from_dict({**inherited, **child}, registry=registry)
        for child in config.kv_connector_extra_config.get("connectors", [])
    ]


def _registry(registry: PluginRegistry | None, ctx: kvx.EngineContext | None = None) -> Any:
    """The registry children are resolved in: the one given, else the engine context's, else
    (only for class-level calls made without either) the process-wide one.

    TODO(issue 30): the contract's class-level methods (`claims_for`, `fault_wait_s`,
    `requires_piecewise_for_cudagraph`, `build_kv_connector_stats`) carry no registry, so a
    composite asked at class level without `registry=` falls back to the global default."""
    if registry is not None:
        return registry
    if ctx is not None and ctx.registry is not None:
        return ctx.registry
    return kvx.get_registry()


class MultiConnector(KVConnectorBase_V1, SupportsHMA):
    """Composes the connectors listed in `kv_connector_extra_config.connectors`, in order."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset()

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, ctx: kvx.EngineContext
    ) -> None:
        super().__init__(config, role, ctx)
        registry = _registry(None, ctx)
        self.child_configs = child_configs(config, registry)
        if not self.child_configs:
            raise ValueError(
                "MultiConnector needs at least one child in kv_connector_extra_config.connectors"
            )
        self.children: list[KVConnectorBase_V1] = []
        try:
            for child in self.child_configs:
                self.children.append(create_connector(child, role, ctx, registry=registry))
        except Exception:
            self.shutdown()
            raise
        self.names = [str(c.kv_connector) for c in self.child_configs]
        self._chosen: dict[str, int] = {}  # request -> child that loads it
        self._extra_async_saves: dict[str, int] = {}  # scheduler: to ship next step
        self._suppress_sending: dict[str, int] = {}  # worker: reports still to swallow

    # ------------------------------------------------------------------ class level

    @classmethod
    def claims_for(
        cls, config: KVTransferConfig, *, registry: PluginRegistry | None = None
    ) -> frozenset[Capability]:
        found = _registry(registry)
        claims = [
            found.resolve_connector_class(c).claims_for(c) for c in child_configs(config, found)
        ]
        if not claims:
            return frozenset()
        union = frozenset().union(*claims) & _ANY_CHILD
        shared = frozenset.intersection(*claims) - _ANY_CHILD
        return union | shared

    @classmethod
    def fault_wait_s(
        cls, config: KVTransferConfig, *, registry: PluginRegistry | None = None
    ) -> float:
        """The longest wait of any child."""
        found = _registry(registry)
        waits = [
            found.resolve_connector_class(c).fault_wait_s(c) for c in child_configs(config, found)
        ]
        return max(waits, default=0.0)

    @classmethod
    def get_required_kvcache_layout(
        cls, config: KVTransferConfig, ctx: kvx.EngineContext | None = None
    ) -> str | None:
        found = _registry(None, ctx)
        layouts = {
            layout
            for child in child_configs(config, found)
            if (
                layout := found.resolve_connector_class(child).get_required_kvcache_layout(
                    child, ctx
                )
            )
            is not None
        }
        if len(layouts) > 1:
            raise ValueError(
                f"KV cache layout mismatch: the children of MultiConnector require "
                f"{sorted(layouts)}; combine connectors that agree on a layout"
            )
        return layouts.pop() if layouts else None

    @classmethod
    def requires_piecewise_for_cudagraph(
        cls, extra_config: dict[str, Any], *, registry: PluginRegistry | None = None
    ) -> bool:
        found = _registry(registry)
        children = [
            KVTransferConfig.from_dict({"kv_role": "kv_both", **c}, registry=found)
            for c in extra_config.get("connectors", [])
        ]
        return any(
            found.resolve_connector_class(child).requires_piecewise_for_cudagraph(
                child.kv_connector_extra_config
            )
            for child in children
        )

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None, *, registry: PluginRegistry | None = None
    ) -> KVConnectorStats:
        found = _registry(registry)
        rebuilt = {}
        for name, sub in (data or {}).items():
            stats = found.load_connector_class(name).build_kv_connector_stats(sub)
            if stats is not None:
                rebuilt[name] = stats
        return MultiKVConnectorStats(data=rebuilt)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Ask every child (the contract makes that side-effect free); the first hit wins and
        is remembered for `update_state_after_alloc` (the same answer each time it is asked)."""
        answers = [
            c.get_num_new_matched_tokens(request, num_computed_tokens) for c in self.children
        ]
        self._chosen.pop(request.request_id, None)
        if any(count is None for count, _ in answers):
            return None, False
        for i, (count, load_async) in enumerate(answers):
            if count:
                self._chosen[request.request_id] = i
                return count, load_async
        return 0, False

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        chosen = self._chosen.get(request.request_id)
        for i, child in enumerate(self.children):
            child.update_state_after_alloc(
                request, blocks, num_external_tokens if i == chosen else 0
            )

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> KVConnectorMetadata:
        meta = MultiKVConnectorMetadata(
            tuple(c.build_connector_meta(scheduler_output) for c in self.children),
            self._extra_async_saves,
        )
        self._extra_async_saves = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each child sees the step's output with its own slice of the worker metadata."""
        meta = connector_output.kv_connector_worker_meta
        slices = (
            meta.metadata
            if isinstance(meta, MultiKVConnectorWorkerMetadata)
            else (None,) * len(self.children)
        )
        for child, child_meta in zip(self.children, slices, strict=True):
            child.update_connector_output(
                replace(connector_output, kv_connector_worker_meta=child_meta)
            )

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._chosen.pop(request.request_id, None)
        return self._merge(
            request.request_id, [c.request_finished(request, block_ids) for c in self.children]
        )

    def request_finished_all_groups(
        self, request: kvx.Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if all(supports_hma(c) for c in self.children):
            self._chosen.pop(request.request_id, None)
            return self._merge(
                request.request_id,
                [
                    c.request_finished_all_groups(request, block_ids)  # type: ignore[attr-defined]
                    for c in self.children
                ],
            )
        if len(block_ids) != 1:
            raise ValueError(
                "MultiConnector has children without HMA support; it can only "
                f"finish requests with one KV-cache group, got {len(block_ids)}"
            )
        return self.request_finished(request, block_ids[0])

    def _merge(
        self, req_id: str, answers: list[tuple[bool, dict[str, Any] | None]]
    ) -> tuple[bool, dict[str, Any] | None]:
        merged: dict[str, Any] = {}
        for name, (_, params) in zip(self.names, answers, strict=True):
            for key, value in (params or {}).items():
                if key in merged:
                    raise RuntimeError(
                        f"MultiConnector: children both returned "
                        f"kv_transfer_params key {key!r} (second: {name}); "
                        "use connectors whose params do not clash"
                    )
                merged[key] = value
        owners = sum(took for took, _ in answers)
        if owners > 1:
            self._extra_async_saves[req_id] = owners - 1
        return owners > 0, merged or None

    def take_events(self) -> Iterable[kvx.KVCacheEvent]:
        for child in self.children:
            yield from child.take_events()

    def get_finished_count(self) -> int | None:
        counts = {c.get_finished_count() for c in self.children}
        if None in counts:
            return None
        if len(counts) > 1:
            raise ValueError(
                f"MultiConnector children disagree on get_finished_count: "
                f"{sorted(c for c in counts if c is not None)}"
            )
        return counts.pop()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        for child in self.children:
            child.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        for child in self.children:
            child.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool | None:
        results = [c.reset_cache() for c in self.children]
        return False not in results

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        for child in self.children:
            child.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: kvx.CopyBlocksOp) -> None:
        for child in self.children:
            child.set_host_xfer_buffer_ops(copy_operation)

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        for child in self.children:
            child.handle_preemptions(preempted_req_ids)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, MultiKVConnectorMetadata):
            raise TypeError(
                f"MultiConnector workers need MultiKVConnectorMetadata, got "
                f"{type(connector_metadata).__name__}"
            )
        for child, meta in zip(self.children, connector_metadata.metadata, strict=True):
            child.bind_connector_metadata(meta)
        for req_id, extra in connector_metadata.extra_async_saves.items():
            self._suppress_sending[req_id] = self._suppress_sending.get(req_id, 0) + extra

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self.children:
            child.clear_connector_metadata()

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        for child in self.children:
            child.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self.children:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for child in self.children:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVTransferResults:
        merged = KVTransferResults()
        for child in self.children:
            results = child.get_transfer_results(finished_req_ids)
            merged.finished_recving |= results.finished_recving
            merged.failed_recving |= results.failed_recving
            for req_id in results.finished_sending:
                if self._suppress_sending.get(req_id, 0) > 0:
                    self._suppress_sending[req_id] -= 1
                    if not self._suppress_sending[req_id]:
                        del self._suppress_sending[req_id]
                else:
                    merged.finished_sending.add(req_id)
        return merged

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(c.get_block_ids_with_load_errors() for c in self.children))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data: dict[str, KVConnectorStats] = {}
        for name, child in zip(self.names, self.children, strict=True):
            stats = child.get_kv_connector_stats()
            if stats is None:
                continue
            if name in data:  # two children of the same connector: one entry, merged
                data[name].aggregate(stats)
            else:
                data[name] = stats
        return MultiKVConnectorStats(data=data) if data else None

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        merged: KVConnectorKVEvents | None = None
        for child in self.children:
            events = child.get_kv_connector_kv_cache_events()
            if events is not None:
                if merged is None:
                    merged = KVConnectorKVEvents(list(events.events), 1)
                else:
                    merged.add_events(events.events)
        return merged

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        metas = tuple(c.build_connector_worker_meta() for c in self.children)
        if all(m is None for m in metas):
            return None
        return MultiKVConnectorWorkerMetadata(metas)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        for child in self.children:
            meta = child.get_handshake_metadata()
            if meta is not None:
                return meta
        return None

    def shutdown(self) -> None:
        """Shut every child down; re-raise the last error after trying all (like vLLM)."""
        error: Exception | None = None
        for child in self.children:
            try:
                child.shutdown()
            except Exception as exc:
                error = exc
        if error is not None:
            raise error
