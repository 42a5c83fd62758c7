"""MultiConnector: vLLM's composition semantics, config validation, and the conformance suite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvx import (
    EngineContext,
    KVCacheBlocks,
    KVCacheSpec,
    KVConnectorRole,
    KVTransferConfig,
    Request,
    create_connector,
)
from kvx.conformance import run_suite
from kvx.conformance.runner import FAILED, NOT_CLAIMED, PASSED
from kvx.engine import Engine, EngineConfig
from kvx.registry.core import Registry

CTX = EngineContext(
    engine_id="e",
    model_name="m",
    cache=KVCacheSpec(("l0",), num_kv_heads=2, head_size=8, block_size=16),
)


def scripted(name: str, **script: Any) -> dict[str, Any]:
    return {
        "kv_connector": "ScriptedConnector",
        "kv_connector_extra_config": {"name": name, **script},
    }


def multi(*children: dict[str, Any], role: str = "kv_both") -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "MultiConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"connectors": list(children)},
        }
    )


@pytest.fixture
def calls(plugin_registry: Registry) -> dict[str, list[tuple[str, object]]]:
    from kvx_test_plugin.connectors import CALLS

    CALLS.clear()
    return CALLS


def test_load_comes_from_the_first_child_with_a_hit(calls: dict) -> None:
    connector = create_connector(
        multi(scripted("a"), scripted("b", tokens=32, load_async=True), scripted("c", tokens=48)),
        KVConnectorRole.SCHEDULER,
        CTX,
    )
    request = Request("r", list(range(64)))
    assert connector.get_num_new_matched_tokens(request, 0) == (32, True)
    assert connector.get_num_new_matched_tokens(request, 0) == (32, True)  # idempotent
    connector.update_state_after_alloc(request, KVCacheBlocks(([0, 1, 2, 3],)), 32)
    assert [c for c in calls["a"] if c[0] == "alloc"] == [("alloc", 0)]
    assert [c for c in calls["b"] if c[0] == "alloc"] == [("alloc", 32)]
    assert [c for c in calls["c"] if c[0] == "alloc"] == [("alloc", 0)]
    assert calls["c"].count(("match", "r")) == 2  # later children are still asked


def test_params_merge_and_clash(calls: dict) -> None:
    connector = create_connector(
        multi(scripted("a", hold=True, params={"x": "1"}), scripted("b", params={"y": "2"})),
        KVConnectorRole.SCHEDULER,
        CTX,
    )
    assert connector.request_finished(Request("r", [1]), [0]) == (True, {"x": "1", "y": "2"})
    clash = create_connector(
        multi(scripted("a", params={"x": "1"}), scripted("b", params={"x": "2"})),
        KVConnectorRole.SCHEDULER,
        CTX,
    )
    with pytest.raises(RuntimeError, match="children both returned kv_transfer_params key 'x'"):
        clash.request_finished(Request("r", [1]), [0])


def test_blocks_freed_only_after_the_last_owning_child(plugin_registry: Registry) -> None:
    """Two children hold the request: the engine frees its blocks only when both reported."""
    config = EngineConfig(
        num_blocks=16,
        kv_transfer_config=multi(
            scripted("a", hold=True), scripted("b", hold=True), role="kv_producer"
        ),
    )
    engine = Engine(config)
    try:
        engine.add_request("r", list(range(20)), 1)
        engine.step()  # prefill + sample: finished, blocks held by both children
        assert engine.scheduler.held_blocks() == {"r": [0, 1]}
        worker = engine.workers[0].connector
        assert worker is not None
        engine.step()  # both children report "r" sent; the first report is swallowed
        assert engine.scheduler.held_blocks() == {}
        assert not engine.has_pending_work()
    finally:
        engine.shutdown()


def test_worker_suppresses_extra_sends(plugin_registry: Registry) -> None:
    from kvx.plugins.multi import MultiKVConnectorMetadata
    from kvx_test_plugin.connectors import ScriptedMetadata

    connector = create_connector(multi(scripted("a"), scripted("b")), KVConnectorRole.WORKER, CTX)
    connector.bind_connector_metadata(
        MultiKVConnectorMetadata((ScriptedMetadata(["r"]), ScriptedMetadata(["r"])), {"r": 1})
    )
    assert connector.get_transfer_results(set()).finished_sending == {"r"}
    connector.bind_connector_metadata(
        MultiKVConnectorMetadata((ScriptedMetadata(["q"]), ScriptedMetadata([])), {"q": 1})
    )
    assert connector.get_transfer_results(set()).finished_sending == set()
    connector.bind_connector_metadata(
        MultiKVConnectorMetadata((ScriptedMetadata([]), ScriptedMetadata(["q"])), {})
    )
    assert connector.get_transfer_results(set()).finished_sending == {"q"}


def test_load_errors_union_stats_per_child_and_counts(plugin_registry: Registry) -> None:
    from kvx.plugins.multi import MultiConnector

    config = multi(scripted("a", load_errors=[1, 2]), scripted("b", load_errors=[2, 5]))
    connector = create_connector(config, KVConnectorRole.WORKER, CTX)
    assert connector.get_block_ids_with_load_errors() == {1, 2, 5}
    stats = connector.get_kv_connector_stats()
    assert stats is not None and set(stats.data) == {"ScriptedConnector"}
    assert stats.data["ScriptedConnector"].data == {"calls": 0}  # both children, merged
    rebuilt = MultiConnector.build_kv_connector_stats(stats.to_dict())
    assert rebuilt.to_dict() == stats.to_dict()
    assert all(isinstance(v, (int, float)) for v in stats.reduce().values())
    same = create_connector(
        multi(scripted("a", finished_count=2), scripted("b", finished_count=2)),
        KVConnectorRole.WORKER,
        CTX,
    )
    assert same.get_finished_count() == 2
    differ = create_connector(
        multi(scripted("a", finished_count=2), scripted("b", finished_count=3)),
        KVConnectorRole.WORKER,
        CTX,
    )
    with pytest.raises(ValueError, match="disagree on get_finished_count"):
        differ.get_finished_count()


def test_layout_requirements(plugin_registry: Registry) -> None:
    from kvx.plugins.multi import MultiConnector

    agree = multi(scripted("a", layout="HND"), scripted("b"))
    assert MultiConnector.get_required_kvcache_layout(agree) == "HND"
    conflict = multi(scripted("a", layout="HND"), scripted("b", layout="NHD"))
    with pytest.raises(ValueError, match=r"KV cache layout mismatch: .*\['HND', 'NHD'\]"):
        MultiConnector.get_required_kvcache_layout(conflict)


def test_engine_adopts_the_required_layout_and_refuses_conflicts(plugin_registry: Registry) -> None:
    engine = Engine(EngineConfig(kv_transfer_config=multi(scripted("a", layout="HND"))))
    try:
        assert engine.config.layout == "HND"
        tensor = engine.workers[0].cache.tensors["model.layers.0.self_attn"]
        assert tensor.stride(2) < tensor.stride(3)  # heads before tokens in memory
    finally:
        engine.shutdown()
    conflict = multi(scripted("a", layout="HND"), scripted("b", layout="NHD"))
    with pytest.raises(ValueError, match="KV cache layout mismatch"):
        Engine(EngineConfig(kv_transfer_config=conflict))


def test_nested_config_errors_name_the_child(plugin_registry: Registry) -> None:
    from kvx import ConfigError

    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_dict(
            {
                "kv_connector": "MultiConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "connectors": [scripted("a"), {"kv_connector": "ScriptedConector"}],
                    "bogus": 1,
                },
            }
        )
    paths = {p.path for p in info.value.problems}
    assert paths == {
        "kv_connector_extra_config.connectors[1].kv_connector",
        "kv_connector_extra_config.bogus",
    }


@pytest.mark.timeout(600)
def test_conformance_with_example_and_scripted_children(plugin_env: Path) -> None:
    config = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "ExamplePDConnector",
                    "kv_connector_extra_config": {"directory": "{tmp}", "load_timeout_s": 5},
                },
                scripted("passive"),
            ]
        },
    }
    results = run_suite(config, fault_timeout_s=20)
    failed = {r.name: r.message for r in results if r.outcome == FAILED}
    assert not failed
    assert sum(r.outcome == PASSED for r in results) >= 20
    assert {r.name for r in results if r.outcome == NOT_CLAIMED} == {
        "store_and_reuse",
        "corrupted_bytes_detected",
        "offload_and_reload",
        "hetero_tp",
        "block_size_mismatch",
        "layout_conversion",
        "stored_hetero_tp",
        "stored_block_size_mismatch",
        "stored_layout_conversion",
        "roles_store_reuse",
        "stats_and_events_shape_stored",
        "stats_and_events_shape_offloaded",
        "mla_pd",
        "mla_pd_hetero_tp",
        "mla_stored_hetero_tp",
        "mla_offload_and_reload",
        "window_store_reuse",
        "window_offload",
        "store_pd_prefill_killed",
        "groups_pd",  # HMA only when every child supports it
        "groups_store_reuse",
        "groups_offload",
    }
