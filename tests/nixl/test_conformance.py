"""NixlConnector passes the conformance suite over real NIXL: every scenario it claims, with P
and D in separate processes where the suite runs them so (process kills included)."""

from __future__ import annotations

import pytest

from kvx import Capability, KVTransferConfig
from kvx.conformance import run_suite
from kvx.conformance.runner import FAILED, NOT_CLAIMED, PASSED
from kvx.plugins.nixl.config import NixlConfig, check_groups_supported
from kvx.plugins.nixl.connector import NixlConnector

EXTRA = {"kv_lease_duration": 5, "handshake_timeout_s": 2, "transfer_timeout_s": 10}
CONFIG = {"kv_connector": "NixlConnector", "kv_connector_extra_config": EXTRA}
CLAIMS = {
    Capability.REMOTE_PREFILL,
    Capability.ASYNC_LOAD,
    Capability.HETERO_TP,
    Capability.BLOCK_SIZE_MISMATCH,
    Capability.LAYOUT_CONVERSION,
    Capability.MLA,
    Capability.HMA,
}


@pytest.mark.timeout(600)
def test_full_suite_passes() -> None:
    results = run_suite(CONFIG, fault_timeout_s=20)
    failed = {r.name: r.message for r in results if r.outcome == FAILED}
    assert not failed
    unclaimed = {r.name for r in results if r.outcome == NOT_CLAIMED}
    assert all(  # only what goes through a store or a slower tier
        any(claim in r.message for claim in ("store_reuse", "store_pd", "offload"))
        for r in results
        if r.name in unclaimed
    )
    for name in (
        "hetero_tp",
        "block_size_mismatch",
        "layout_conversion",
        "pd_separate_processes",
        "prefill_killed_recompute",
        "prefill_killed_fail",
        "decode_killed",
        "groups_pd",
    ):
        assert {r.name: r.outcome for r in results}[name] == PASSED


@pytest.mark.timeout(300)
def test_engine_layouts_converted_on_receive() -> None:
    """With `required_layout: null` the engines keep their own layouts (NHD, HND, vLLM-CPU
    packed): D converts P's blocks on receive, through the staging path."""
    config = {**CONFIG, "kv_connector_extra_config": {**EXTRA, "required_layout": None}}
    results = run_suite(config, only=["layout_conversion", "hetero_tp"], fault_timeout_s=20)
    assert {r.name: (r.outcome, r.message) for r in results} == {
        "layout_conversion": (PASSED, ""),
        "hetero_tp": (PASSED, ""),
    }


PUSH = {"kv_connector": "NixlPushConnector", "kv_connector_extra_config": EXTRA}


PUSH_SCENARIOS = (
    "hetero_tp",
    "mla_pd",
    "mla_pd_hetero_tp",
    "pd_separate_processes",
    "prefill_killed_recompute",
    "prefill_killed_fail",
    "decode_killed",
    "abort_on_decode_while_loading",
    "abort_between_prefill_and_decode",
    "pd_short_prompt",
    "pd_block_multiple",
    "pd_chunked_prefill",
    "pd_prefix_hit_on_decode",
    "preemption_on_decode",
    "pd_prefill_block_pressure",
    "window_pd",
)
"""The transfer paths push changes (CI time: the whole suite in push mode takes ~13 min here
and passed; the store, offload and contract-shape scenarios run the same code as pull)."""


@pytest.mark.timeout(600)
def test_push_mode_passes_transfer_and_fault_scenarios() -> None:
    """Push mode (P WRITEs into the blocks D registered): hetero TP (1:2, 2:1, 2:4, 4:2,
    replicated heads), MLA, separate processes and every P/D fault scenario pass; block size
    and layout conversion are not claimed (push writes blocks as they are)."""
    results = run_suite(PUSH, only=[*PUSH_SCENARIOS, "block_size_mismatch"], fault_timeout_s=20)
    outcomes = {r.name: (r.outcome, r.message) for r in results}
    assert outcomes.pop("block_size_mismatch")[0] == NOT_CLAIMED
    assert outcomes == dict.fromkeys(PUSH_SCENARIOS, (PASSED, ""))


def test_claims_and_required_layout() -> None:
    config = KVTransferConfig.from_dict({**CONFIG, "kv_role": "kv_both"})
    assert NixlConnector.claims_for(config) == CLAIMS
    assert NixlConnector.get_required_kvcache_layout(config) == "HND"


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        ({"transfer_mode": "push"}, "transfer_mode"),
        ({"verify_transfers": True}, "verify_transfers"),
    ],
)
def test_several_kv_groups_are_pull_mode_without_verify_transfers(
    extra: dict[str, object], option: str
) -> None:
    """Push mode and `verify_transfers` move one KV-cache group: they do not claim HMA, and
    an engine with two groups refuses them naming the option."""
    config = KVTransferConfig.from_dict(
        {**CONFIG, "kv_role": "kv_both", "kv_connector_extra_config": {**EXTRA, **extra}}
    )
    assert Capability.HMA not in NixlConnector.claims_for(config)
    options = config.extra_config_as(NixlConfig)
    check_groups_supported(options, 1)
    with pytest.raises(ValueError, match=f"{option}=.* is not supported with 2 KV-cache groups"):
        check_groups_supported(options, 2)
