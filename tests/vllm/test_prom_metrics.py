"""The kvx_* series reach vLLM's Prometheus registry through vLLM's own `KVConnectorProm` (the
object `vllm serve`'s stat logger builds), from the plain stats dicts vLLM carries: counters
move by exactly what the stats say, with vLLM's labels, per connector and per failure kind."""

from __future__ import annotations

from typing import Any

import prometheus_client
import vllm.plugins
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

LABELS = {"model_name": "tiny", "engine": "0"}


def prom_for(kv_connector: str, extra: dict[str, Any]) -> KVConnectorProm:
    vllm.plugins.load_general_plugins()
    ktc = KVTransferConfig(
        kv_connector=kv_connector, kv_role="kv_both", kv_connector_extra_config=extra
    )
    return KVConnectorProm(
        VllmConfig(kv_transfer_config=ktc), list(LABELS), {0: list(LABELS.values())}
    )


def sample(name: str, **labels: str) -> float:
    value = prometheus_client.REGISTRY.get_sample_value(name, {**LABELS, **labels})
    return 0.0 if value is None else value


def test_storage_stats_move_the_series_by_what_they_say(tmp_path: Any) -> None:
    prom = prom_for("kvx.SharedStorageConnector", {"storage_url": f"file://{tmp_path}"})
    c = {"connector": "SharedStorageConnector"}
    names = [
        ("kvx_kv_transfer_bytes_total", {**c, "direction": "saved"}),
        ("kvx_kv_transfer_blocks_total", {**c, "direction": "loaded"}),
        ("kvx_kv_hit_tokens_total", {**c, "source": "storage"}),
        ("kvx_kv_transfer_failures_total", {**c, "kind": "checksum"}),
        ("kvx_kv_transfer_failures_total", {**c, "kind": "store_miss"}),
        ("kvx_kv_transfer_duration_seconds_count", {**c, "direction": "saved"}),
    ]
    before = [sample(n, **labels) for n, labels in names]
    data = {
        "saved_bytes": 4096,
        "loaded_blocks": 3,
        "loaded_tokens": 48,
        "load_failed_checksum": 1,
        "load_failed_store_miss": 2,
        "save_seconds": [0.002, 0.3],
    }
    prom.observe(data, 0)
    prom.observe(data, 0)
    after = [sample(n, **labels) for n, labels in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [8192, 6, 96, 2, 4, 4]
    # every failure kind is a series from the start (alerts on its rate work at once)
    assert (
        prometheus_client.REGISTRY.get_sample_value(
            "kvx_kv_transfer_failures_total", {**LABELS, **c, "kind": "timeout"}
        )
        is not None
    )


def test_a_multi_connector_reports_per_child(tmp_path: Any) -> None:
    storage = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": f"file://{tmp_path}"},
    }
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20},
    }
    prom = prom_for("kvx.MultiConnector", {"connectors": [storage, offload]})
    key = ("kvx_kv_transfer_bytes_total", "direction")
    before = (
        sample(key[0], connector="SharedStorageConnector", direction="saved"),
        sample(key[0], connector="OffloadingConnector", direction="loaded"),
    )
    prom.observe(
        {
            "SharedStorageConnector": {"saved_bytes": 100},
            "OffloadingConnector": {"load_bytes": 7, "load_durations": [0.001]},
        },
        0,
    )
    after = (
        sample(key[0], connector="SharedStorageConnector", direction="saved"),
        sample(key[0], connector="OffloadingConnector", direction="loaded"),
    )
    assert (after[0] - before[0], after[1] - before[1]) == (100, 7)


def test_nixl_held_requests_are_a_gauge_and_bad_stats_never_raise() -> None:
    prom = prom_for("kvx.NixlConnector", {})
    c = {"connector": "NixlConnector"}
    prom.observe({"held_requests": 4, "held_oldest_seconds": 2.5}, 0)
    assert sample("kvx_kv_held_requests", **c) == 4
    assert sample("kvx_kv_held_oldest_seconds", **c) == 2.5
    prom.observe({"held_requests": 0, "held_oldest_seconds": 0.0}, 0)
    assert sample("kvx_kv_held_requests", **c) == 0
    prom.observe({"transfer_duration": "not a list"}, 0)  # logged, not raised
