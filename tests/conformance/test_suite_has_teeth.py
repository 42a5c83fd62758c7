"""The conformance suite has teeth: every deliberately broken connector fails it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvx.conformance import run_suite
from kvx.conformance.runner import FAILED, PASSED

BROKEN_DIR = Path(__file__).resolve().parent / "broken"

# The good connector passes these; each broken one fails the scenario named below.
SCENARIOS = ["pd_block_multiple", "pd_long_prompts", "clean_shutdown"]


def broken(name: str) -> dict[str, object]:
    return {
        "kv_connector": name,
        "kv_connector_module_path": "kvx_broken_connectors",
        "kv_connector_extra_config": {"directory": "{tmp}", "load_timeout_s": 5},
    }


@pytest.fixture
def broken_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the broken connectors importable here and in spawned engine processes."""
    monkeypatch.syspath_prepend(str(BROKEN_DIR))
    monkeypatch.setenv("PYTHONPATH", str(BROKEN_DIR))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("connector", "caught_by"),
    [
        ("DropsBlock", "pd_long_prompts"),
        ("SwapsBlocks", "pd_long_prompts"),
        ("FinishesEarly", "pd_long_prompts"),
        ("NeverFrees", "pd_block_multiple"),
        ("WritesOtherHeads", "pd_block_multiple"),
        ("LeaksThread", "clean_shutdown"),
    ],
)
def test_broken_connector_fails_the_suite(
    broken_importable: None, connector: str, caught_by: str
) -> None:
    import kvx_broken_connectors

    try:
        (result,) = run_suite(broken(connector), only=[caught_by], fault_timeout_s=5)
    finally:
        for stop in kvx_broken_connectors.LEAKED_THREAD_STOPS:
            stop.set()
    assert result.outcome == FAILED, f"{connector} passed {caught_by}: {result}"


@pytest.mark.timeout(120)
def test_the_good_connector_passes_the_same_subset(broken_importable: None) -> None:
    config = broken("DropsBlock") | {
        "kv_connector": "ExamplePDConnector",
        "kv_connector_module_path": None,
    }
    config = {k: v for k, v in config.items() if v is not None}
    results = run_suite(config, only=SCENARIOS, fault_timeout_s=10)
    assert [r.outcome for r in results] == [PASSED] * len(SCENARIOS), results
