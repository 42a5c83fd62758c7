"""Built-in connectors pass the conformance suite with the configs their docs give as the
default (tests/nixl/test_documented_defaults.py does NixlConnector's, tests/lmcache LMCache's).
Where a full run already exists, it is not run again here: that run asserts its config is the
documented default (tests/storage/test_engine.py for SharedStorageConnector on file:// and
redis://, tests/offload/test_offloading.py for OffloadingConnector). What no other test runs
with the documented defaults runs here, on the scenarios those defaults decide: P2P's CPU path
with its default send type and timeouts (the stall limit must know its 30 s
`transfer_timeout_s`), and MultiConnector with the children its page shows."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from kvx_doc_defaults import DOCS, assert_documented_default, documented_keys

from kvx import KVTransferConfig
from kvx.conformance import PASSED, run_suite
from kvx.plugins.p2p.config import P2pConfig
from kvx.plugins.p2p.connector import P2pNcclConnector


def p2p_default(port: int) -> dict[str, Any]:
    """Only D's address is set (a fixed 1P1D: the suite's proxy names no D), on a free port."""
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_port": port,
        "kv_connector_extra_config": {"default_decode_address": f"127.0.0.1:{port}"},
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_p2p_runs_with_the_defaults_its_page_documents() -> None:
    """What decides the fault scenarios (the send type, the CPU plane, the 30 s timeout) is
    what docs/connectors/p2p.md says and what the connector uses when nothing is set."""
    defaults = P2pConfig()
    rows = documented_keys("p2p.md")
    for key in ("send_type", "data_plane", "transfer_timeout_s"):
        value = getattr(defaults, key)
        shown = f'`"{value}"`' if isinstance(value, str) else f"`{value:g}`"
        assert rows[key].lstrip().startswith(shown), (key, shown, rows[key])
    assert (
        P2pNcclConnector.fault_wait_s(
            KVTransferConfig.from_dict({**p2p_default(1), "kv_role": "kv_both"})
        )
        >= 30
    )


@pytest.mark.timeout(600)
def test_p2p_cpu_path_passes_with_its_documented_defaults() -> None:
    config = p2p_default(free_port())
    assert_documented_default(config, "p2p.md", "default_decode_address")
    scenarios = ["pd_long_prompts", "abort_between_prefill_and_decode", "decode_killed"]
    results = run_suite(config, only=scenarios)
    assert [(r.name, r.outcome, r.message) for r in results] == [
        (name, PASSED, "") for name in scenarios
    ]


def documented_multi_config() -> dict[str, Any]:
    """The MultiConnector config docs/connectors/multi.md shows, its directories replaced by
    the suite's fresh `{tmp}`."""
    text = (DOCS / "multi.md").read_text()
    block = re.search(r"```json\n(\{\n  \"kv_connector\": \"MultiConnector\".*?)```", text, re.S)
    assert block, "docs/connectors/multi.md shows no MultiConnector config"
    raw = block.group(1).replace("/tmp/kv-handoff", "{tmp}/handoff")
    return dict(json.loads(raw.replace("file:///tmp/kv-store", "file://{tmp}/store")))


@pytest.mark.timeout(600)
def test_multi_connector_passes_with_its_documented_config(tmp_path: Path) -> None:
    config = documented_multi_config()
    handoff, store = config["kv_connector_extra_config"]["connectors"]
    assert handoff["kv_connector_extra_config"] == {"directory": "{tmp}/handoff"}
    assert store["kv_connector_extra_config"] == {"storage_url": "file://{tmp}/store"}
    scenarios = ["pd_long_prompts", "abort_between_prefill_and_decode", "store_and_reuse"]
    results = run_suite(config, only=scenarios)
    assert [(r.name, r.outcome, r.message) for r in results] == [
        (name, PASSED, "") for name in scenarios
    ]
