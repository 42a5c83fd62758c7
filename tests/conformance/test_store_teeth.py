"""The suite has teeth for store connectors too: each broken store connector
(tests/conformance/broken/kvx_broken_stores.py) fails, with the rule it broke named, and
fast."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvx_test_services import RedisProcess

from kvx.conformance import FAILED, PASSED, SuiteOptions, run_suite

BROKEN_DIR = Path(__file__).resolve().parent / "broken"
STORE_EXTRA = {"storage_url": "file://{tmp}/store"}
OPTIONS = SuiteOptions(fault_timeout_s=20, stall_timeout_s=5)  # 20: a P/D run may take 60 s
ONE_CELL = SuiteOptions(
    fault_timeout_s=20, stall_timeout_s=5, dtypes=("float32",), block_sizes=(16,)
)


def broken_store(name: str) -> dict[str, object]:
    return {
        "kv_connector": name,
        "kv_connector_module_path": "kvx_broken_stores",
        "kv_connector_extra_config": STORE_EXTRA,
    }


@pytest.fixture
def broken_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the broken store connectors importable here and in spawned engine processes."""
    monkeypatch.syspath_prepend(str(BROKEN_DIR))
    monkeypatch.setenv("PYTHONPATH", str(BROKEN_DIR))


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("broken_importable")
@pytest.mark.parametrize("scenario", ["store_and_reuse", "roles_store_reuse"])
def test_a_store_that_never_reports_a_save_fails_each_scenario_fast(scenario: str) -> None:
    """At the default stall limit (10 s), not after the 60-120 s timeout: the failure names the
    held blocks and the report the engine waits for. (Set-up and the steps before the stall
    take a few seconds on an idle machine; the bound is loose for a shared one.)"""
    start = time.monotonic()
    (result,) = run_suite(broken_store("NeverFinishesStore"), only=[scenario])
    elapsed = time.monotonic() - start
    assert result.outcome == FAILED, result
    assert elapsed < 45, elapsed
    assert result.message.startswith("EngineStall: no progress for 10s"), result.message
    assert "get_finished() to report it in finished_sending" in result.message, result.message


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("broken_importable")
@pytest.mark.parametrize(
    ("connector", "caught_by", "rule", "options"),
    [
        ("AssumesContiguousStore", "store_and_reuse", "differs from what the model wrote", OPTIONS),
        ("AssumesContiguousStore", "pd_long_prompts", "differs from what the model wrote", OPTIONS),
        ("IgnoresLocalHitStore", "store_and_reuse", "differs from what the model wrote", OPTIONS),
        ("IgnoresLocalHitStore", "pd_prefix_hit_on_decode", "differs from what the", OPTIONS),
        ("SavesAfterFinishStore", "pd_long_prompts", "D loaded nothing", OPTIONS),
        ("OffersEveryToken", "pd_block_multiple", "rule one-token-computed", OPTIONS),
        (
            "KeepsLoadErrors",
            "corrupted_bytes_detected",
            "rule load-errors-name-loaded-blocks",
            OPTIONS,
        ),
        ("LeaksAtShutdown", "clean_shutdown", "threads still running after shutdown", OPTIONS),
        ("FixedStagingStore", "matrix", "differs from what the model wrote", ONE_CELL),
        ("ConvertsToHalfStore", "matrix", "cell dtype float32, block size 16", ONE_CELL),
        (
            "NoBfloat16Store",
            "matrix",
            "cell dtype bfloat16, block size 16: TypeError",
            SuiteOptions(fault_timeout_s=20, stall_timeout_s=5, dtypes=("bfloat16",)),
        ),
    ],
)
def test_a_broken_store_fails_the_suite_naming_the_rule(
    connector: str, caught_by: str, rule: str, options: SuiteOptions
) -> None:
    import kvx_broken_stores

    try:
        (result,) = run_suite(broken_store(connector), only=[caught_by], options=options)
    finally:
        for leaked in kvx_broken_stores.LEAKED:
            getattr(leaked, "set", getattr(leaked, "close", None))()
        kvx_broken_stores.LEAKED.clear()
    assert result.outcome == FAILED, f"{connector} passed {caught_by}: {result}"
    assert rule in result.message, result.message


@pytest.fixture
def redis_store() -> Iterator[str]:
    server = RedisProcess()
    try:
        yield f"redis://127.0.0.1:{server.port}/0"
    finally:
        server.kill()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("url", ["file", "redis"])
def test_the_built_in_store_passes_store_pd_and_the_matrix(
    url: str, request: pytest.FixtureRequest
) -> None:
    """The good store passes what the broken ones fail: P/D through the store (file:// and
    redis://), the local-hit mix, the matrix's long prompt, and the leak check."""
    storage = (
        STORE_EXTRA["storage_url"] if url == "file" else request.getfixturevalue("redis_store")
    )
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": storage},
    }
    scenarios = [
        "pd_long_prompts",
        "pd_prefix_hit_on_decode",
        "pd_block_multiple",
        "store_and_reuse",
        "clean_shutdown",
        "matrix",
    ]
    results = run_suite(config, only=scenarios, options=ONE_CELL)
    assert sorted((r.name, r.outcome, r.message) for r in results) == sorted(
        (name, PASSED, "") for name in scenarios
    )


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("broken_importable")
def test_a_scenario_never_loads_what_an_earlier_run_left_in_a_shared_store(
    redis_store: str,
) -> None:
    """A store every scenario reaches (one Redis, a process's LMCache tier) keeps what earlier
    scenarios saved; each scenario names its own model, so it finds none of it: a P that saves
    too late still fails, though the good store stored the same prompts there just before."""
    extra = {"storage_url": redis_store}
    good = {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": extra}
    late = {**broken_store("SavesAfterFinishStore"), "kv_connector_extra_config": extra}
    (first,) = run_suite(good, only=["pd_long_prompts"], options=OPTIONS)
    assert first.outcome == PASSED, first
    (result,) = run_suite(late, only=["pd_long_prompts"], options=OPTIONS)
    assert result.outcome == FAILED, f"passed on the earlier run's saves: {result}"
    assert "D loaded nothing" in result.message, result.message
