"""NixlConnector passes the fault scenarios with the defaults docs/connectors/nixl.md gives
(a 30 s lease): the suite's stall limit covers the lease the connector declares
(`fault_wait_s`) instead of failing after 10 s."""

from __future__ import annotations

import pytest

from kvx import KVTransferConfig
from kvx.conformance import PASSED, run_suite
from kvx.plugins.nixl.connector import NixlConnector

DEFAULT = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}  # nothing else set


def test_the_declared_wait_is_the_documented_lease() -> None:
    config = KVTransferConfig.from_dict(DEFAULT)
    assert NixlConnector.fault_wait_s(config) == 30.0


@pytest.mark.timeout(600)
def test_lease_scenarios_pass_with_the_documented_defaults() -> None:
    """One lease scenario: each waits out the whole 30 s lease, and the others
    (abort_between_prefill_and_decode, ...) wait on the same lease and stall limit;
    tests/nixl/test_conformance.py runs them all with a 5 s lease."""
    scenarios = ["decode_killed"]
    results = run_suite(DEFAULT, only=scenarios)
    assert [(r.name, r.outcome, r.message) for r in results] == [
        (name, PASSED, "") for name in scenarios
    ]
