"""The conformance suite has teeth: every deliberately broken connector fails it, with the rule
it broke named in the message, and the good connectors pass the same scenarios."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvx import get_registry
from kvx.conformance import FAILED, PASSED, SuiteOptions, run_suite
from kvx.conformance.harness import Harness
from kvx.conformance.runner import connector_claims, load_scenarios
from kvx.conformance.scenario import ScenarioFailure, check

BROKEN_DIR = Path(__file__).resolve().parent / "broken"
EXAMPLE_EXTRA = {"directory": "{tmp}", "load_timeout_s": 5}
STORAGE_EXTRA = {"storage_url": "file://{tmp}/store"}
STORAGE_BASED = {"StoresAsConsumer", "LoadsAsProducer", "SharesGroupTables"}
OPTIONS = SuiteOptions(fault_timeout_s=20, stall_timeout_s=5)  # a P/D run may take 60 s


# P dies before writing anything: D's load times out well within the stall limit
GIVES_UP_FAST = {"HidesLoadErrors": {**EXAMPLE_EXTRA, "load_timeout_s": 0.5}}


def broken(name: str) -> dict[str, object]:
    extra = STORAGE_EXTRA if name in STORAGE_BASED else GIVES_UP_FAST.get(name, EXAMPLE_EXTRA)
    return {
        "kv_connector": name,
        "kv_connector_module_path": "kvx_broken_connectors",
        "kv_connector_extra_config": extra,
    }


@pytest.fixture
def broken_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the broken connectors importable here and in spawned engine processes."""
    monkeypatch.syspath_prepend(str(BROKEN_DIR))
    monkeypatch.setenv("PYTHONPATH", str(BROKEN_DIR))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("connector", "caught_by", "rule"),
    [
        ("DropsBlock", "pd_long_prompts", "differ"),
        ("SwapsBlocks", "pd_long_prompts", "the connector wrote a wrong target block"),
        (
            "FinishesEarly",
            "pd_long_prompts",
            "reported the request received (finished_recving) at step",
        ),
        ("NeverFrees", "pd_block_multiple", "waits for get_finished() to report it in "),
        ("WritesOtherHeads", "pd_block_multiple", "differ"),
        ("LeaksThread", "clean_shutdown", "threads still running after shutdown"),
        ("SavesAsConsumer", "pd_short_prompt", "role kv_consumer: request_finished("),
        ("StoresAsConsumer", "roles_store_reuse", "a pure consumer never saves"),
        ("LoadsAsProducer", "roles_store_reuse", "a pure producer never loads"),
        ("ReportsUnheldSends", "pd_short_prompt", "which this engine does not hold for sending"),
        ("ReportsSendsTwice", "pd_block_multiple", "or it was already reported finished"),
        ("AssumesContiguous", "pd_long_prompts", "differ"),
        ("SavesLate", "pd_prefill_block_pressure", "differ"),
        ("SendsALock", "pd_short_prompt", "cannot be sent to a worker process"),
        ("WritesNullBlock", "window_pd", "the null block (no request's; a write through"),
        ("SharesGroupTables", "groups_store_reuse", "of this layer's other KV-cache group were"),
        ("SharesGroupTables", "groups_pd", "a connector used one group's block ids for group 1"),
        ("SlicesLatent", "mla_pd", "differ"),
        ("RoundsUpToBlocks", "pd_short_prompt", "rule matched-tokens-in-range: "),
        ("AsyncEvenForNothing", "pd_short_prompt", "rule async-load-has-tokens: "),
        ("FailsOnlyInFailed", "pd_short_prompt", "rule failed-is-finished: worker 0 reported"),
        (
            "HidesLoadErrors",
            "prefill_killed_recompute",
            "after P died, D's KV bytes differ from what the model wrote (0 failed load(s)",
        ),
    ],
)
def test_broken_connector_fails_the_suite(
    broken_importable: None, connector: str, caught_by: str, rule: str
) -> None:
    import kvx_broken_connectors

    try:
        (result,) = run_suite(broken(connector), only=[caught_by], options=OPTIONS)
    finally:
        for stop in kvx_broken_connectors.LEAKED_THREAD_STOPS:
            stop.set()
    assert result.outcome == FAILED, f"{connector} passed {caught_by}: {result}"
    assert rule in result.message, result.message


@pytest.mark.timeout(120)
def test_a_connector_holding_blocks_forever_fails_fast_naming_them(
    broken_importable: None,
) -> None:
    """No bare timeout: the stall names the request, its held blocks and the missing report,
    well within 15 s at the default stall limit."""
    start = time.monotonic()
    (result,) = run_suite(broken("NeverFrees"), only=["pd_short_prompt"])
    elapsed = time.monotonic() - start
    assert result.outcome == FAILED
    assert elapsed < 15, elapsed
    message = result.message
    assert message.startswith("EngineStall: no progress for 10s"), message
    for needle in (
        "prefill (prefill, 3 blocks held",
        "req-0 finished at step",
        "held for sending",
        "blocks [",
    ):
        assert needle in message, message
    assert "get_finished() to report it in finished_sending (no worker has)" in message


@pytest.mark.timeout(60)
def test_a_fault_scenario_waiting_on_a_lease_fails_fast_naming_the_held_blocks(
    broken_importable: None,
) -> None:
    """A connector that never frees a finished prompt's blocks is not waited for until the
    fault timeout (60 s): the stall limit applies while P should be letting a lease run out
    (every fault scenario waits through `Harness.wait_for_fault_handling`)."""
    start = time.monotonic()
    (result,) = run_suite(broken("NeverFrees"), only=["abort_between_prefill_and_decode"])
    elapsed = time.monotonic() - start
    assert result.outcome == FAILED
    assert elapsed < 15, elapsed
    message = result.message
    assert message.startswith("EngineStall: no progress for 10s (waiting until P freed"), message
    assert "blocks held after finish" in message and "blocks [" in message, message
    assert "get_finished() to report it in finished_sending (no worker has)" in message


@pytest.mark.timeout(60)
def test_the_skeleton_that_claims_nothing_does_not_pass(broken_importable: None) -> None:
    suite = run_suite(broken("DoesNothing"), options=OPTIONS)
    # idempotent_matching and clean_shutdown run whatever the claims
    assert suite.count(FAILED) == 0 and suite.count(PASSED) == 2
    assert not suite.ok() and suite.exit_code() == 1
    assert "NO KV transfer was tested: DoesNothing claims nothing" in suite.summary()
    assert suite.ok(allow_no_transfer=True) and suite.exit_code(allow_no_transfer=True) == 0


@pytest.mark.timeout(120)
def test_a_worker_mutating_its_metadata_breaks_no_sibling(broken_importable: None) -> None:
    """Every worker gets its own metadata, as across processes: clearing it is harmless."""
    results = run_suite(broken("ClearsMetadata"), only=["aggregation_tp_pp"], options=OPTIONS)
    assert [(r.outcome, r.message) for r in results] == [(PASSED, "")]


@pytest.mark.timeout(180)
def test_the_good_connectors_pass_the_same_scenarios(broken_importable: None) -> None:
    example = {"kv_connector": "ExamplePDConnector", "kv_connector_extra_config": EXAMPLE_EXTRA}
    scenarios = [
        "pd_short_prompt",
        "pd_block_multiple",
        "pd_long_prompts",
        "pd_prefill_block_pressure",
        "window_pd",
        "clean_shutdown",
    ]
    results = run_suite(example, only=scenarios, options=OPTIONS)
    assert sorted((r.name, r.outcome, r.message) for r in results) == sorted(
        (name, PASSED, "") for name in scenarios
    )
    (mla,) = run_suite(broken("ClaimsMla"), only=["mla_pd"], options=OPTIONS)
    assert (mla.outcome, mla.message) == (PASSED, "")  # the control for SlicesLatent
    storage = {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": STORAGE_EXTRA}
    # groups_pd: the control for SharesGroupTables (groups_store_reuse runs in tests/storage)
    results = run_suite(storage, only=["roles_store_reuse", "groups_pd"], options=OPTIONS)
    assert [(r.outcome, r.message) for r in results] == [(PASSED, "")] * 2


KVX = shutil.which("kvx", path=str(Path(sys.executable).parent))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("extra", "code"), [([], 1), (["--allow-no-transfer"], 0)])
def test_the_cli_fails_a_run_that_tested_no_transfer(extra: list[str], code: int) -> None:
    assert KVX is not None
    config = broken("DoesNothing") | {"kv_role": "kv_both"}
    result = subprocess.run(
        [KVX, "conformance", "--kv-transfer-config", json.dumps(config), *extra],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "PYTHONPATH": str(BROKEN_DIR)},
    )
    assert result.returncode == code, result.stdout + result.stderr
    out = " ".join(result.stdout.split())
    assert "DoesNothing claims nothing" in out
    assert "the config's kv_role 'kv_both' is not used" in out
    unclaimed = len(load_scenarios()) - 2  # every scenario but the two any connector runs
    assert f"2 passed, 0 failed, {unclaimed} not claimed; NO KV transfer was tested" in out


@pytest.mark.timeout(60)
def test_a_failed_load_is_named_as_the_cause_of_finished_error() -> None:
    """D gives up on P's file before P's next step writes it (a load timeout far too short):
    the request ends as `finished_error`, and the failure says D's connector reported a failed
    load (not a bare status), which is what a load timeout under heavy CPU load looks like."""
    config = {
        "kv_connector": "ExamplePDConnector",
        "kv_connector_extra_config": {"directory": "{tmp}", "load_timeout_s": 1e-6},
    }
    (result,) = run_suite(config, only=["pd_short_prompt"], options=OPTIONS)
    assert result.outcome == FAILED, result
    assert "ended as 'finished_error'" in result.message, result.message
    assert "failed load(s): the connector reported this request's blocks bad" in result.message


@pytest.mark.timeout(60)
def test_a_violation_is_named_before_the_failed_check_it_led_to(
    broken_importable: None, tmp_path: Path
) -> None:
    """A scenario check failing in a pair that broke a contract rule names the rule first:
    the rule is the cause, the wrong tokens or bytes the check saw are what it led to."""
    kv = broken("FailsOnlyInFailed")
    registry = get_registry()
    h = Harness(kv, connector_claims(kv, registry), tmp_path, registry, OPTIONS)
    with pytest.raises(ScenarioFailure) as caught, h.pair() as pair:
        pair.run(h.prompts([40]), 2, timeout_s=60)
        check(False, "a check after the run")
    message = str(caught.value)
    assert message.startswith("contract violated (docs/contract.md): "), message
    assert "rule failed-is-finished: worker 0 reported" in message, message
    assert message.endswith("; then a check after the run"), message
