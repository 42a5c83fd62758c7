"""P2pNcclConnector under the conformance suite on the CPU plane, for each send type.

By default a subset that keeps the suite's cost low (two to four scenarios per send type: for
PUT_ASYNC, whose frames are views of P's blocks, P reusing freed blocks at once, also while
a prompt longer than the window prefills in chunks; for GET,
whose loads are asynchronous, an abort while loading; test_failures.py fails loads on
purpose). See docs/connectors/p2p.md for what the whole suite gave;
`KVX_P2P_FULL_SUITE=1` runs every scenario for every send type (several minutes)."""

from __future__ import annotations

import os

import pytest

from kvx.conformance import run_suite
from kvx.conformance.runner import FAILED, PASSED

from ._ports import free_port_range, p2p_config

SUBSET = {  # in-process scenarios (test_separate_processes.py runs P and D in processes)
    "PUT": ["pd_short_prompt", "pd_prefix_hit_on_decode", "window_pd", "window_pd_prefill_hit"],
    "PUT_ASYNC": [
        "pd_chunked_prefill",
        "clean_shutdown",
        "pd_prefill_block_pressure",
        "window_pd_chunked_prefill",
    ],
    "GET": ["abort_on_decode_while_loading", "pd_prefix_hit_on_decode", "window_pd_prefill_hit"],
}
FULL = os.environ.get("KVX_P2P_FULL_SUITE") == "1"


@pytest.mark.timeout(1800 if FULL else 300)
@pytest.mark.parametrize("send_type", ["PUT", "PUT_ASYNC", "GET"])
def test_suite_passes(send_type: str) -> None:
    # GET: kv_port 0, every P worker on an ephemeral port advertised in kv_transfer_params
    config = p2p_config(send_type, 0 if send_type == "GET" else free_port_range(8))
    results = run_suite(config, only=None if FULL else SUBSET[send_type], fault_timeout_s=20)
    failed = {r.name: r.message for r in results if r.outcome == FAILED}
    assert not failed
    outcomes = {r.name: r.outcome for r in results}
    for name in SUBSET[send_type]:
        assert outcomes[name] == PASSED, (name, outcomes[name])
