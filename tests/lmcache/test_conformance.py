"""LMCacheConnectorV1 passes the conformance suite's claimed scenarios over real LMCache, with
each backend: local CPU with exactly the defaults docs/connectors/lmcache.md gives (LMCache's:
256-token chunks, no partial chunk), local disk, redis:// (and layer-wise on local CPU)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from kvx_test_clusters import ClusterProcesses

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
    "clean_shutdown",
}
# An engine whose chunks only its local tier (CPU, disk) holds is kept after the connector's
# shutdown, as the process's cache a later engine of the process finds (LMCache's local tiers
# live inside its engine; in vLLM that engine lives as long as the worker process). Its
# threads are that cache's, the only ones clean_shutdown may find left: with a disk tier also
# the default executor threads (`asyncio_N`) of its storage manager's event loop.
KEPT = re.compile(r"stats-logger-thread|PinMonitor-thread|storage-manager-event-loop|asyncio_\d+")


def _suite(extra: dict[str, Any] | None, kept: bool = False) -> None:
    """The suite on `BASE` updated by `extra`; `None`: the documented defaults (no extra config)."""
    config: dict[str, Any] = {"kv_connector": "LMCacheConnectorV1"}
    if extra is not None:
        config["kv_connector_extra_config"] = {**BASE, **extra}
    results = run_suite(config, fault_timeout_s=20)
    failed = {r.name: r.message for r in results if r.outcome == FAILED}
    if kept and "clean_shutdown" in failed:
        leaked = failed.pop("clean_shutdown")
        assert leaked.startswith("threads still running after shutdown"), leaked
        names = re.findall(r"'([^']+)'", leaked)
        assert all(KEPT.fullmatch(name) for name in names), leaked
    assert not failed, failed
    passed = {r.name for r in results if r.outcome == PASSED}
    assert passed >= CLAIMED - ({"clean_shutdown"} if kept else set()), passed


def test_suite_with_the_documented_defaults() -> None:
    """No extra config at all: LMCache's local CPU tier, 256-token chunks, full chunks only
    (tests/lmcache/test_docs.py checks these are the defaults the doc's table gives). Every
    claimed scenario has a prompt past one such chunk."""
    _suite(None, kept=True)


def test_suite_on_local_disk() -> None:
    _suite(
        {"local_cpu": False, "local_disk": "file://{tmp}/lmcache", "max_local_disk_size": 0.1},
        kept=True,
    )


def test_suite_on_redis(redis_url: str) -> None:
    """With a remote tier the engine is destroyed at shutdown: no thread, socket or event
    loop of LMCache's outlives it (clean_shutdown passes)."""
    _suite({"local_cpu": False, "remote_url": redis_url})


def test_suite_on_redis_with_local_cpu(redis_url: str) -> None:
    """LMCache's default local CPU tier in front of the remote one: destroyed at shutdown too
    (LMCache 0.5.6's destroy hangs with both unless kvx unblocks it, see engine.py)."""
    _suite({"remote_url": redis_url})


def test_suite_on_a_redis_cluster() -> None:
    """LMCache's own `redis-cluster://` connector on a real 3 masters + 3 replicas cluster,
    the URL naming every master."""
    with ClusterProcesses("redis") as cluster:
        nodes = ",".join(f"127.0.0.1:{port}" for port in cluster.ports[:3])
        _suite({"remote_url": f"redis-cluster://{nodes}"})


def test_suite_layerwise() -> None:
    _suite({"use_layerwise": True}, kept=True)


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
