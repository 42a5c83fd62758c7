"""OffloadingConnector: the CPU tier's bookkeeping, its config rules, and the conformance suite."""

from __future__ import annotations

import pytest
from kvx_doc_defaults import assert_documented_default

from kvx import BlockRemoved, BlockStored, ConfigError, KVTransferConfig
from kvx.conformance import run_suite
from kvx.conformance.runner import FAILED, PASSED
from kvx.engine import Engine, EngineConfig
from kvx.plugins.offload.manager import OffloadingManager
from kvx.plugins.offload.policies import ARCPolicy

K = [f"{i:02x}" * 4 for i in range(10)]  # chunk keys (hex, like the connector's)


def stored(manager: OffloadingManager, *keys: str) -> None:
    plan = manager.prepare_store(list(keys))
    assert plan is not None
    manager.complete_store(plan.keys)


def test_lru_store_lookup_pin_and_evict() -> None:
    m = OffloadingManager(num_slots=2)
    stored(m, K[0], K[1])
    assert m.lookup([K[0], K[1], K[2]]) == 2
    slots = m.prepare_load([K[0]])  # pinned: may not be evicted
    assert slots == [m.slot_of[K[0]]]
    plan = m.prepare_store([K[2]])
    assert plan is not None and plan.evicted == [K[1]]  # K[0] pinned, K[1] least recent
    m.complete_store(plan.keys)
    assert m.lookup([K[0], K[2]]) == 2 and m.lookup([K[1]]) == 0
    m.complete_load([K[0]])
    m.prepare_load([K[2]])
    m.complete_load([K[2]])  # touched: K[0] is now the least recent
    plan = m.prepare_store([K[3]])
    assert plan is not None and plan.evicted == [K[0]]


def test_nothing_to_evict_returns_none_and_failed_store_forgets() -> None:
    m = OffloadingManager(num_slots=1)
    plan = m.prepare_store([K[0]])
    assert plan is not None
    assert m.prepare_store([K[1]]) is None  # the only slot is pinned by the store in flight
    m.complete_store([K[0]], success=False)
    assert m.lookup([K[0]]) == 0
    assert m.prepare_store([K[1]]) is not None


def test_store_threshold_and_events() -> None:
    m = OffloadingManager(num_slots=1, store_threshold=2, tokens_per_chunk=32)
    first = m.prepare_store([K[0]])
    assert first is not None and first.keys == []  # offered once: not yet worth storing
    second = m.prepare_store([K[0]])
    assert second is not None and second.keys == [K[0]]
    m.complete_store(second.keys)
    m.prepare_store([K[1]])
    plan = m.prepare_store([K[1]])
    assert plan is not None and plan.evicted == [K[0]]
    m.complete_store(plan.keys)
    events = m.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored]
    assert all(e.medium == "CPU" for e in events)
    assert events[0].block_size == 32  # type: ignore[attr-defined]
    assert m.take_events() == []


def test_disk_tier_keeps_evicted_chunks_loadable() -> None:
    m = OffloadingManager(num_slots=1, disk_chunks=2)
    stored(m, K[0])
    plan = m.prepare_store([K[1]])
    assert plan is not None and plan.spills == [(K[0], 0)] and plan.disk_drops == []
    m.complete_store(plan.keys)
    assert m.lookup([K[0], K[1]]) == 2  # K[0] on disk, K[1] in the CPU slot
    assert m.prepare_load([K[0], K[1]]) == [None, 0]
    m.complete_load([K[0], K[1]])
    stored(m, K[2])  # K[1] spills; the disk tier (2 chunks) is full
    plan = m.prepare_store([K[3]])  # K[2] spills, the oldest disk chunk K[0] goes
    assert plan is not None and plan.disk_drops == [K[0]]
    m.complete_store(plan.keys)
    assert m.lookup([K[0]]) == 0 and m.lookup([K[1], K[2], K[3]]) == 3
    media = [(type(e).__name__, e.medium) for e in m.take_events()]
    assert ("BlockStored", "DISK") in media and ("BlockRemoved", "DISK") in media


def test_arc_keeps_frequent_keys_through_a_scan() -> None:
    arc = ARCPolicy(capacity=3)
    for key in K[:3]:
        arc.insert(key)
    arc.touch(K[0])  # K[0] used twice: frequency list
    victims = []
    for key in K[3:6]:  # a scan of one-time keys
        victim = arc.victim(lambda k: True)
        assert victim is not None
        arc.remove(victim)
        victims.append(victim)
        arc.insert(key)
    assert K[0] not in victims and K[0] in arc
    arc.insert(victims[0])  # a ghost hit in B1 favours recency
    assert arc.p > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "kv_connector_extra_config.cpu_bytes_to_use: required key is missing"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use: 0 (integer) is out of range"),
        (
            {"cpu_bytes_to_use": 1 << 20, "eviction_policy": "fifo"},
            'eviction_policy: "fifo" (string) is not allowed',
        ),
    ],
)
def test_config_errors(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KVTransferConfig.from_dict(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes_to_use": 1 << 20, "block_size": 24}, "24 is not a multiple of the engine"),
        ({"cpu_bytes_to_use": 100}, "cpu_bytes_to_use: 100 bytes hold no chunk"),
        ({"cpu_bytes_to_use": 1 << 49}, "more than this machine's memory"),
    ],
)
def test_geometry_errors(extra: dict[str, object], message: str) -> None:
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )
    with pytest.raises(ConfigError, match=message):
        Engine(EngineConfig(kv_transfer_config=config))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"cpu_bytes_to_use": 1 << 20, "block_size": 32, "blocks_per_chunk": 2},
            "block_size: give blocks_per_chunk .2. or block_size .32., not both",
        ),
        (
            {"cpu_bytes_to_use": 1 << 20, "disk_url": "memory://x"},
            "disk_bytes_to_use: required with disk_url",
        ),
        ({"cpu_bytes_to_use": 1 << 20, "disk_bytes_to_use": 1 << 20}, "disk_url: required"),
        ({"cpu_bytes_to_use": 2**64}, "cpu_bytes_to_use: 18446744073709551616 .integer. is out"),
        ({"cpu_bytes_to_use": 1 << 20, "block_size": 2**64}, "block_size: 18446744073709551616"),
        (
            {"cpu_bytes_to_use": 1 << 20, "disk_url": "file:///a\x00", "disk_bytes_to_use": 1},
            "disk_url: 'file:///a.x00' contains a NUL byte",
        ),
    ],
)
def test_config_errors_are_found_by_validation(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config." + message):
        KVTransferConfig.from_dict(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        )


DOCUMENTED_DEFAULTS = {"cpu_bytes_to_use": 1 << 24}  # the tier's size is required


def test_the_first_conformance_config_is_the_documented_default() -> None:
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": DOCUMENTED_DEFAULTS,
    }
    assert_documented_default(config, "offloading.md", "cpu_bytes_to_use")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "extra",
    [
        DOCUMENTED_DEFAULTS,
        {"cpu_bytes_to_use": 1 << 24, "block_size": 32, "eviction_policy": "arc"},
        {"cpu_bytes_to_use": 1 << 24, "blocks_per_chunk": 2, "store_threshold": 1},
        # A CPU tier of 4 chunks: reloads come from the disk tier.
        {
            "cpu_bytes_to_use": 1 << 16,
            "disk_url": "file://{tmp}/disk",
            "disk_bytes_to_use": 1 << 24,
        },
        {
            "cpu_bytes_to_use": 1 << 16,
            "disk_url": "memory://kvx-offload-test",
            "disk_bytes_to_use": 1 << 24,
            "eviction_policy": "arc",
        },
    ],
)
def test_conformance(extra: dict[str, object]) -> None:
    results = run_suite(
        {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra},
        fault_timeout_s=20,
    )
    outcomes = {r.name: r.outcome for r in results}
    assert not {r.name: r.message for r in results if r.outcome == FAILED}
    assert outcomes["offload_and_reload"] == PASSED
    assert outcomes["window_offload"] == PASSED
    assert outcomes["groups_offload"] == PASSED
    assert outcomes["idempotent_matching"] == PASSED


@pytest.mark.timeout(120)
def test_stats_and_events_after_a_reload() -> None:
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24},
        }
    )
    engine = Engine(EngineConfig(num_blocks=24, kv_transfer_config=config))
    try:

        def run(requests: dict[str, tuple[list[int], int]]) -> None:
            for rid, (prompt, max_tokens) in requests.items():
                engine.add_request(rid, prompt, max_tokens)
            while engine.has_pending_work():
                engine.step()

        run({"first": (list(range(100)), 2)})
        run({f"filler{i}": ([i] * 90, 30) for i in range(3)})  # evicts first's blocks
        run({"again": (list(range(100)), 2)})
        totals: dict[str, float] = {}
        for stats in engine.kv_stats:
            for key, value in stats.reduce().items():
                totals[key] = totals.get(key, 0) + value
        assert totals["stores"] > 0 and totals["store_bytes"] > 0
        assert totals["loads"] > 0 and totals["load_bytes"] > 0
        assert engine.check_kv() == []
        assert engine.scheduler_connector is not None
        events = list(engine.scheduler_connector.take_events())
        assert events and all(isinstance(e, BlockStored | BlockRemoved) for e in events)
    finally:
        engine.shutdown()
