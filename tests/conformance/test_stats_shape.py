"""Every built-in connector reports non-empty stats in the shared `TransferFigures` shape: the
conformance suite's stats_and_events_shape scenarios pass for each (real NIXL, real files, real
P2P sockets), and the figures match what the connectors moved."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from kvx import KVConnectorStats, TransferFigures
from kvx.conformance import run_suite
from kvx.conformance.runner import NOT_CLAIMED, PASSED
from kvx.plugins.nixl.stats import NixlKVConnectorStats
from kvx.plugins.storage.stats import StorageStats, failure_kind

STATS = [
    "stats_and_events_shape",
    "stats_and_events_shape_stored",
    "stats_and_events_shape_offloaded",
]
STORAGE = {
    "kv_connector": "SharedStorageConnector",
    "kv_connector_extra_config": {"storage_url": "file://{tmp}"},
}
OFFLOAD = {
    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24},
}
EXAMPLE = {
    "kv_connector": "ExamplePDConnector",
    "kv_connector_extra_config": {"directory": "{tmp}", "load_timeout_s": 5},
}
NIXL = {
    "kv_connector": "NixlConnector",
    "kv_connector_extra_config": {"kv_lease_duration": 5, "handshake_timeout_s": 2},
}


def _p2p() -> dict[str, Any]:
    """D listens on a port free right now (one rank: one port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {"send_type": "PUT", "transfer_timeout_s": 5}
    options["default_decode_address"] = f"127.0.0.1:{port}"
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_port": port,
        "kv_connector_extra_config": options,
    }


def _multi() -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [NIXL, STORAGE]},
    }


CONFIGS = {
    "storage": lambda: STORAGE,
    "offload": lambda: OFFLOAD,
    "example": lambda: EXAMPLE,
    "nixl": lambda: NIXL,
    "p2p": _p2p,
    "multi": _multi,
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_stats_scenarios_pass_with_non_empty_stats(name: str) -> None:
    results = run_suite(CONFIGS[name](), only=STATS, fault_timeout_s=20)
    ran = {r.name: (r.outcome, r.message) for r in results if r.outcome != NOT_CLAIMED}
    assert ran, f"{name}: no stats scenario applies"
    assert all(outcome == PASSED for outcome, _ in ran.values()), ran


def test_the_shape_refuses_unknown_directions_and_kinds() -> None:
    with pytest.raises(ValueError, match="'sideways' is not allowed; use one of saved, loaded"):
        TransferFigures(bytes={"sideways": 1})
    with pytest.raises(ValueError, match="'oops' is not allowed; use one of transport, timeout"):
        TransferFigures(failures={"oops": 1})
    assert TransferFigures().is_empty()
    assert not TransferFigures(held_requests=1).is_empty()
    assert KVConnectorStats({"n": 1}).figures_by_connector("X") == {"X": TransferFigures()}


def test_storage_failures_are_split_by_kind() -> None:
    from kvx.plugins.storage.blockformat import BlockFormatError, NotStoredError

    assert failure_kind(NotStoredError("k: not stored")) == "store_miss"
    assert failure_kind(BlockFormatError("k: checksum mismatch")) == "checksum"
    assert failure_kind(OSError("connection reset")) == "transport"
    stats = StorageStats(
        {"load_failed_store_miss": 2, "load_failed_checksum": 1, "save_errors": 3, "saved_bytes": 8}
    )
    figures = stats.figures()
    assert figures.failures == {"transport": 3, "checksum": 1, "store_miss": 2}
    assert figures.bytes == {"saved": 8, "loaded": 0}


def test_nixl_held_requests_merge_by_maximum_across_workers() -> None:
    a, b = NixlKVConnectorStats(), NixlKVConnectorStats()
    a.set_held(3, 1.5)
    b.set_held(3, 2.0)
    b.record_transfer(0.25, 0.01, 4096, 2)
    a.count("num_kv_expired_reqs")
    merged = a.aggregate(b)
    figures = merged.figures()
    assert (figures.held_requests, figures.held_oldest_seconds) == (3, 2.0)
    assert figures.bytes == {"received": 4096}
    assert figures.seconds == {"received": [0.25]}
    assert figures.failures["timeout"] == 1
