"""Prefill stores in one process, decode loads in another, through LMCache's lm:// server and
through Redis: tokens identical to a single engine, every KV byte checked after every step
(the reference engine's P/D runner, `kvx.engine.disagg`)."""

from __future__ import annotations

import random

import pytest

from kvx.engine.disagg import DisaggregatedPair, pd_configs
from kvx.engine.engine import EngineConfig

pytestmark = pytest.mark.timeout(240)

LENGTHS = (37, 64, 5, 100)


def _run_pd(remote_url: str, tp: int = 1, processes: bool = True, **extra: object) -> None:
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1024) for _ in range(n)] for i, n in enumerate(LENGTHS)}
    kv = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_connector_extra_config": {
            "chunk_size": 16,
            "save_unfull_chunk": True,
            "local_cpu": False,
            "remote_url": remote_url,
            "max_local_cpu_size": 0.05,  # LMCache allocates its CPU buffer up front
            **extra,
        },
    }
    base = EngineConfig(num_layers=4, num_kv_heads=4, num_blocks=64)
    prefill, decode = pd_configs(base, kv, tp=(tp, tp))
    pair = DisaggregatedPair(prefill, decode, processes=processes, timeout_s=60)
    try:
        report = pair.run(prompts, 4, timeout_s=120)  # checks every KV byte on both engines
    finally:
        pair.close()
    assert report.all_identical, (report.kv_mismatches, report.results)
    loaded = sum((n - 1) // 16 * 16 for n in LENGTHS)  # all but the last token's block
    assert report.decode_stats["external_tokens"] == loaded


def test_pd_through_lm_server(lm_url: str) -> None:
    _run_pd(lm_url)


def test_pd_through_redis(redis_url: str) -> None:
    _run_pd(redis_url)


def test_pd_through_redis_tp2_layerwise(redis_url: str) -> None:
    """TP 2 on both sides, layer-wise (both engines in this process: the test is about the
    per-rank keys and layer-wise keys, not the process boundary the tests above cross)."""
    _run_pd(redis_url, tp=2, processes=False, use_layerwise=True)
