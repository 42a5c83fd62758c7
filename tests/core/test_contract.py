"""The connector contract: method table, defaults and the auxiliary types."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import kvx
from kvx import (
    BlockRemoved,
    BlockStored,
    CachedRequestData,
    EngineContext,
    KVCacheBlocks,
    KVCacheSpec,
    KVConnectorBase_V1,
    KVConnectorKVEvents,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVTransferConfig,
    NewRequestData,
    Request,
    SchedulerOutput,
    SupportsHMA,
    supports_hma,
    yield_req_data,
)

# (method, parameter names after self) from the reference's method table (section 3.3).
METHOD_TABLE: dict[str, tuple[str, ...]] = {
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "update_connector_output": ("connector_output",),
    "request_finished": ("request", "block_ids"),
    "take_events": (),
    "get_required_kvcache_layout": ("config", "ctx"),
    "requires_piecewise_for_cudagraph": ("extra_config",),
    "get_finished_count": (),
    "build_kv_connector_stats": ("data",),
    "build_prom_metrics": ("config", "metric_types", "labelnames", "per_engine_labelvalues"),
    "set_xfer_handshake_metadata": ("metadata",),
    "set_xfer_handshake_metadata_pp_aware": ("metadata",),
    "reset_cache": (),
    "on_new_request": ("request",),
    "bind_kv_cache_manager": ("kv_cache_manager",),
    "bind_gpu_block_pool": ("block_pool",),
    "get_loaded_kv_cache_group_ids": ("request",),
    "get_external_cache_hit_sources": ("request", "num_external_tokens"),
    "register_finished_partial_tail": ("request", "block_ids"),
    "has_pending_block_frees": (),
    "has_pending_push_work": (),
    "bind_connector_metadata": ("connector_metadata",),
    "clear_connector_metadata": (),
    "_get_connector_metadata": (),
    "has_connector_metadata": (),
    "register_kv_caches": ("kv_caches",),
    "register_cross_layers_kv_cache": ("kv_cache", "attn_backend"),
    "unregister_kv_caches": (),
    "restore_kv_caches": (),
    "set_host_xfer_buffer_ops": ("copy_operation",),
    "get_mem_pool_context": (),
    "handle_preemptions": ("preempted_req_ids",),
    "start_load_kv": ("forward_context", "kwargs"),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata", "kwargs"),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_transfer_results": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
    "get_kv_connector_stats": (),
    "get_kv_connector_kv_cache_events": (),
    "get_handshake_metadata": (),
    "build_connector_worker_meta": (),
    "finish_forward": (),
    "reset_capture_state": (),
    "shutdown": (),
    "supports_sleep_mode": ("config",),
}
ABSTRACT = {
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
}
CTX = EngineContext(
    engine_id="e",
    model_name="m",
    cache=KVCacheSpec(
        layer_names=("l0", "l1"), num_kv_heads=4, head_size=8, block_size=16, dtype="bfloat16"
    ),
)


class Minimal(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None: ...
    def wait_for_save(self) -> None: ...
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None: ...
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


def make(role: KVConnectorRole = KVConnectorRole.WORKER) -> Minimal:
    return Minimal(KVTransferConfig(kv_connector="Minimal", kv_role="kv_producer"), role, CTX)


@pytest.mark.parametrize("name", sorted(METHOD_TABLE))
def test_method_table(name: str) -> None:
    method = getattr(KVConnectorBase_V1, name)
    params = [p for p in inspect.signature(method).parameters if p not in ("self", "cls")]
    assert tuple(params) == METHOD_TABLE[name]
    assert (name in ABSTRACT) == getattr(method, "__isabstractmethod__", False)
    assert method.__doc__, f"{name} must document its contract"


def test_abstract_methods_are_enforced() -> None:
    with pytest.raises(TypeError, match="abstract"):
        KVConnectorBase_V1(KVTransferConfig(), KVConnectorRole.WORKER, CTX)  # type: ignore[abstract]


def test_defaults() -> None:
    c = make()
    request = Request("r1", [1, 2, 3])
    assert c.role is KVConnectorRole.WORKER
    assert c.request_finished(request, [0]) == (False, None)
    assert tuple(c.take_events()) == ()
    assert c.get_finished(set()) == (None, None)
    assert c.get_block_ids_with_load_errors() == set()
    assert c.get_kv_connector_stats() is None and c.get_handshake_metadata() is None
    assert c.get_finished_count() is None and c.reset_cache() is None
    assert c.requires_kv_delivery is True
    assert Minimal.get_required_kvcache_layout(c.kv_transfer_config) is None
    assert Minimal.requires_piecewise_for_cudagraph({}) is False
    assert Minimal.build_kv_connector_stats() is None
    results = c.get_transfer_results({"r1"})
    assert (results.finished_sending, results.finished_recving, results.failed_recving) == (
        set(),
        set(),
        set(),
    )


def test_required_layout_on_the_base_class_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="connector class"):
        KVConnectorBase_V1.get_required_kvcache_layout(KVTransferConfig())


def test_metadata_binding() -> None:
    c = make()
    assert not c.has_connector_metadata()
    with pytest.raises(RuntimeError, match="no connector metadata is bound"):
        c._get_connector_metadata()
    meta = KVConnectorMetadata()
    c.bind_connector_metadata(meta)
    assert c._get_connector_metadata() is meta
    c.clear_connector_metadata()
    assert not c.has_connector_metadata()


def test_transfer_results_wrap_get_finished() -> None:
    class Finishing(Minimal):
        def get_finished(self, finished_req_ids: set[str]) -> Any:
            return {"a"}, None

    c = Finishing(KVTransferConfig(), KVConnectorRole.WORKER, CTX)
    assert c.get_transfer_results(set()).finished_sending == {"a"}


def test_pp_aware_handshake_default() -> None:
    seen: list[dict[int, Any]] = []

    class Recording(Minimal):
        def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
            seen.append(metadata)

    c = Recording(KVTransferConfig(), KVConnectorRole.SCHEDULER, CTX)
    c.set_xfer_handshake_metadata_pp_aware({(0, 0): "a", (0, 1): "b"})  # type: ignore[dict-item]
    assert seen == [{0: "a", 1: "b"}]
    with pytest.raises(ValueError, match=r"not pipeline-parallel aware .* pp_rank\(s\) \[1\]"):
        c.set_xfer_handshake_metadata_pp_aware({(1, 0): "a"})  # type: ignore[dict-item]


def test_supports_hma_on_classes_and_instances() -> None:
    class Hma(Minimal, SupportsHMA):
        def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
            return False, None

    assert supports_hma(Hma) and supports_hma(Hma(KVTransferConfig(), KVConnectorRole.WORKER, CTX))
    assert not supports_hma(Minimal) and not supports_hma(make())


def test_stats_aggregate_and_reduce() -> None:
    a = KVConnectorStats({"transfers": 2, "durations": [0.5], "bytes": 10})
    b = KVConnectorStats({"transfers": 3, "durations": [1.5, 2.0], "errors": 1})
    assert a.aggregate(b) is a
    assert a.data == {"transfers": 5, "durations": [0.5, 1.5, 2.0], "bytes": 10, "errors": 1}
    assert a.reduce() == {"transfers": 5, "durations": 4.0, "bytes": 10, "errors": 1}
    clone = a.clone_and_reset()
    assert clone.data["transfers"] == 5 and a.is_empty() and not clone.is_empty()

    class Other(KVConnectorStats):
        pass

    with pytest.raises(TypeError, match="cannot aggregate Other into KVConnectorStats"):
        a.aggregate(Other({"x": 1}))
    with pytest.raises(TypeError, match="stats key 'x'"):
        KVConnectorStats({"x": [1]}).aggregate(KVConnectorStats({"x": 2}))


def test_events_merge_across_workers() -> None:
    first = KVConnectorKVEvents([BlockStored((b"h1",), None, (1, 2), 16, "CPU")])
    second = KVConnectorKVEvents([BlockRemoved((b"h0",), "CPU")])
    first.aggregate(second)
    assert first.get_number_of_workers() == 2
    assert [type(e).__name__ for e in first.get_all_events()] == ["BlockStored", "BlockRemoved"]
    first.clear_events()
    assert first.get_all_events() == [] and first.get_number_of_workers() == 0


def test_yield_req_data_marks_full_tables() -> None:
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("new", [1, 2], ([4, 5],), 0)],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["running", "resumed"],
            resumed_req_ids={"resumed"},
            new_block_ids=[([6],), ([7, 8, 9],)],
            num_computed_tokens=[16, 0],
        ),
        num_scheduled_tokens={"new": 2, "running": 1, "resumed": 40},
    )
    assert list(yield_req_data(out)) == [
        ("new", ([4, 5],), True),
        ("running", ([6],), False),
        ("resumed", ([7, 8, 9],), True),
    ]
    assert out.total_num_scheduled_tokens == 43


def test_types() -> None:
    blocks = KVCacheBlocks(([3, 4, 5],), (1,))
    assert blocks.get_unhashed_block_ids() == [4, 5]
    with pytest.raises(ValueError, match="exactly one KV-cache group, got 2"):
        KVCacheBlocks(([1], [2])).get_unhashed_block_ids()
    assert KVCacheBlocks.empty(2).get_block_ids() == ([], [])
    request = Request("r", [1, 2, 3], output_token_ids=[4])
    assert (request.all_token_ids, request.num_tokens, request.num_prompt_tokens) == (
        [1, 2, 3, 4],
        4,
        3,
    )
    assert not request.is_finished()
    import torch

    assert CTX.cache.torch_dtype is torch.bfloat16
    assert CTX.cache.num_layers == 2 and CTX.parallel.world_size == 1
    with pytest.raises(ValueError, match=r"KVCacheSpec\.dtype: 'nope' is not a torch dtype name"):
        _ = KVCacheSpec(("l",), 1, 1, 1, dtype="nope").torch_dtype


def test_public_api_is_importable() -> None:
    for name in kvx.__all__:
        assert hasattr(kvx, name), name
