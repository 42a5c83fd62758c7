"""A connector that never reports a finished send or receive fails every scenario it claims on
the stall limit, with the diagnosis (which request, which blocks, which report the engine
waits for), never on a scenario's 60-300 s timeout: whatever it claims (a store, a P/D
hand-off, every capability).

The runs use a 2 s stall limit (`--stall-timeout`, which every scenario honours) and one
scenario per way the suite waits (a P/D run, a single engine, a fault being handled, a step
before a fault, the matrix, the MLA, sliding-window and two-group engines), to keep CI short;
the whole suite fails the same way (docs/conformance.md, "Hangs fail fast", gives the command). A
failure on the stall limit takes the set-up plus that limit, so at the default 10 s a
scenario fails in well under 15 s on an idle machine (tests/conformance/test_suite_has_teeth.py
times one at the default).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvx.conformance import FAILED, NOT_CLAIMED, SuiteOptions, run_suite
from kvx.conformance.runner import load_scenarios

BROKEN_DIR = Path(__file__).resolve().parent / "broken"
STALL_S = 2
OPTIONS = SuiteOptions(stall_timeout_s=STALL_S, fault_timeout_s=20)
EXAMPLE_EXTRA = {"directory": "{tmp}", "load_timeout_s": 5}
STORE_EXTRA = {"storage_url": "file://{tmp}/store"}
# kind -> (connector, module, extra config, the scenarios run)
NEVER_FINISHING = {
    "store": (  # SharedStorageConnector's claims: P/D through the store, store reuse, ...
        "NeverFinishesStore",
        "kvx_broken_stores",
        STORE_EXTRA,
        [
            "pd_long_prompts",
            "abort_on_prefill",
            "idempotent_matching",
            "clean_shutdown",
            "store_and_reuse",
            "stored_hetero_tp",
            "roles_store_reuse",
            "mla_stored_hetero_tp",
            "window_store_reuse",
            "groups_store_reuse",
            "matrix",
        ],
    ),
    "pd": (  # the example connector's: a P/D hand-off, loads asynchronous
        "NeverFinishes",
        "kvx_broken_connectors",
        EXAMPLE_EXTRA,
        ["pd_short_prompt", "pd_prefill_block_pressure", "abort_on_decode_while_loading"],
    ),
    "everything": (  # every capability claimed, so the offload and MLA scenarios run too
        "ClaimsEverythingNeverFinishes",
        "kvx_broken_connectors",
        EXAMPLE_EXTRA,
        [
            "pd_interleaved_local",
            "abort_on_decode_while_decoding",
            "stats_and_events_shape",
            "offload_and_reload",
            "mla_offload_and_reload",
            "window_offload",
            "matrix",
        ],
    ),
}
# What the engine waits for, as the diagnosis names it.
MISSING_REPORT = ("to report it in finished_sending", "to report it in finished_recving")


@pytest.fixture
def broken_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the broken connectors importable here and in spawned engine processes."""
    monkeypatch.syspath_prepend(str(BROKEN_DIR))
    monkeypatch.setenv("PYTHONPATH", str(BROKEN_DIR))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("broken_importable")
@pytest.mark.parametrize("kind", sorted(NEVER_FINISHING))
def test_a_connector_that_never_finishes_fails_every_claimed_scenario_on_the_stall_limit(
    kind: str,
) -> None:
    name, module, extra, scenarios = NEVER_FINISHING[kind]
    config = {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_connector_extra_config": extra,
    }
    suite = run_suite(config, only=scenarios, options=OPTIONS)
    assert [r.name for r in suite if r.outcome != NOT_CLAIMED] == [
        n for n in load_scenarios() if n in scenarios
    ]
    wrong = []
    for result in suite:
        message = result.message
        diagnosed = (
            result.outcome == FAILED
            and re.search(rf"EngineStall\W+no progress for {STALL_S}s \(waiting until ", message)
            and "request " in message
            and "blocks [" in message
            and any(report in message for report in MISSING_REPORT)
        )
        if not diagnosed:
            wrong.append(f"{result.name} ({result.outcome}, {result.seconds:.0f}s): {message}")
    assert not wrong, "\n".join(wrong)
