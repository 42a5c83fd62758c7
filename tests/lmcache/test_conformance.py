"""LMCacheConnectorV1 passes the conformance suite's claimed scenarios over real LMCache, with
each backend: local CPU, local disk, redis:// (and layer-wise on local CPU)."""

from __future__ import annotations

from typing import Any

import pytest

from kvx import Capability, KVTransferConfig
from kvx.conformance import run_suite
from kvx.conformance.runner import FAILED, PASSED
from kvx.plugins.lmcache.connector import LMCacheConnectorV1

pytestmark = pytest.mark.timeout(900)

BASE = {"chunk_size": 16, "save_unfull_chunk": True, "max_local_cpu_size": 0.05}
CLAIMED = {
    "idempotent_matching",
    "roles_store_reuse",
    "store_and_reuse",
    "stats_and_events_shape_stored",
    "window_store_reuse",
    "matrix",
}
# clean_shutdown runs for every connector: LMCache's own process-wide threads outlive the
# connector's shutdown, and with its Redis backend its connections stay open too (known gaps
# of LMCache's, recorded here so that a change either way is noticed).
LEAKS = ("stats-logger-thread", "PinMonitor-thread", "storage-manager-event-loop")
OPEN_FDS = "file descriptors still open after shutdown"


def _suite(extra: dict[str, Any]) -> None:
    results = run_suite(
        {"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {**BASE, **extra}},
        fault_timeout_s=20,
    )
    failed = {r.name: r.message for r in results if r.outcome == FAILED}
    assert set(failed) <= {"clean_shutdown"}, failed
    leaked = failed.get("clean_shutdown", "threads still running after shutdown")
    if leaked.endswith(OPEN_FDS):
        assert "remote_url" in extra, leaked  # only with LMCache's Redis
    else:
        assert leaked.startswith("threads still running after shutdown"), leaked
        assert any(name in leaked for name in LEAKS) or not failed, leaked
    assert {r.name for r in results if r.outcome == PASSED} | set(failed) >= CLAIMED


def test_suite_on_local_cpu() -> None:
    _suite({})


def test_suite_on_local_disk() -> None:
    _suite({"local_cpu": False, "local_disk": "file://{tmp}/lmcache", "max_local_disk_size": 0.1})


def test_suite_on_redis(redis_url: str) -> None:
    _suite({"local_cpu": False, "remote_url": redis_url})


def test_suite_layerwise() -> None:
    _suite({"use_layerwise": True})


def test_claims() -> None:
    def claims(extra: dict[str, Any]) -> frozenset[Capability]:
        config = KVTransferConfig.from_dict(
            {
                "kv_connector": "LMCacheConnectorV1",
                "kv_role": "kv_both",
                **{"kv_connector_extra_config": extra},
            }
        )
        return LMCacheConnectorV1.claims_for(config)

    assert claims({}) == {Capability.STORE_REUSE}
    assert claims({"use_layerwise": True}) == {Capability.STORE_REUSE, Capability.LAYERWISE}
