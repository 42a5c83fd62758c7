"""SharedStorageConnector inside the reference engine: P/D through storage, the conformance
suite's claimed scenarios."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from kvx_doc_defaults import assert_documented_default

from kvx.conformance import run_suite
from kvx.conformance.runner import FAILED, PASSED
from kvx.engine.disagg import DisaggregatedPair, pd_configs
from kvx.engine.engine import EngineConfig

pytestmark = pytest.mark.timeout(120)

LENGTHS = (37, 64, 5, 100)  # prompt lengths


@pytest.mark.parametrize(
    ("tp", "pp", "block_sizes", "layouts", "heads", "mla"),
    [
        ((2, 1), (1, 1), None, None, 4, False),
        ((1, 4), (1, 1), None, None, 4, False),
        ((4, 4), (1, 1), None, None, 2, False),  # KV heads replicated over ranks on both sides
        ((2, 1), (2, 1), None, None, 4, False),
        ((1, 1), (1, 2), (32, 16), None, 4, False),
        ((1, 1), (3, 2), None, None, 4, False),  # D's stages straddle P's (1+2+1 vs 2+2 layers)
        ((1, 1), (1, 1), (16, 32), None, 4, False),
        ((1, 1), (1, 1), (32, 8), None, 4, False),
        ((1, 1), (1, 1), None, ("NHD", "HND"), 4, False),
        ((2, 1), (1, 1), (32, 16), ("HND", "CPU_PACKED"), 4, False),
        ((2, 1), (1, 1), None, None, 4, True),
    ],
)
def test_prefill_to_decode_through_storage(
    tp: tuple[int, int],
    pp: tuple[int, int],
    block_sizes: tuple[int, int] | None,
    layouts: tuple[str, str] | None,
    heads: int,
    mla: bool,
    tmp_path: Path,
) -> None:
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1024) for _ in range(n)] for i, n in enumerate(LENGTHS)}
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": f"file://{tmp_path}"},
    }
    base = EngineConfig(num_layers=4, num_kv_heads=heads, use_mla=mla)
    prefill, decode = pd_configs(base, kv, tp=tp, block_sizes=block_sizes, layouts=layouts)
    prefill, decode = replace(prefill, pp_size=pp[0]), replace(decode, pp_size=pp[1])
    pair = DisaggregatedPair(prefill, decode, processes=False)
    try:
        report = pair.run(prompts, 4)  # checks every KV byte on both engines after each step
    finally:
        pair.close()
    assert report.all_identical, (report.kv_mismatches, report.results)
    d_block = decode.block_size  # D loads every full block but the one of the last token
    loaded = sum((n - 1) // d_block * d_block for n in LENGTHS)
    assert report.decode_stats["external_tokens"] == loaded


CLAIMED = {  # every scenario the connector's claims (store_reuse, hetero_tp, ...) select
    "idempotent_matching",
    "store_and_reuse",
    "corrupted_bytes_detected",
    "stored_hetero_tp",
    "mla_stored_hetero_tp",
    "stored_block_size_mismatch",
    "stored_layout_conversion",
    "roles_store_reuse",
    "stats_and_events_shape_stored",
    "window_store_reuse",
    "groups_store_reuse",
}


@pytest.mark.timeout(300)
def test_full_conformance_suite_on_files() -> None:
    # the store-reuse scenarios; its P/D-through-the-store scenarios (store_pd) and the matrix
    # run in tests/conformance (test_the_built_in_store_passes_store_pd_and_the_matrix)
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": "file://{tmp}"},
    }
    assert_documented_default(config, "shared-storage.md", "storage_url")
    results = run_suite(
        config,
        only=sorted(CLAIMED),
        fault_timeout_s=20,
    )
    assert not {r.name: r.message for r in results if r.outcome == FAILED}
    assert {r.name for r in results if r.outcome == PASSED} == CLAIMED


@pytest.mark.timeout(300)
def test_conformance_on_redis(redis_url: str) -> None:
    # corrupted_bytes_detected flips bytes in files under the scenario's directory; a Redis
    # store has none (the corrupt-value path on Redis is covered in test_connector.py).
    expect_passed = CLAIMED - {"corrupted_bytes_detected"}
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": redis_url},
    }
    assert_documented_default(config, "shared-storage.md", "storage_url")
    results = run_suite(
        config,
        only=sorted(expect_passed),
        fault_timeout_s=20,
    )
    assert not {r.name: r.message for r in results if r.outcome == FAILED}
    assert {r.name for r in results if r.outcome == PASSED} == expect_passed
