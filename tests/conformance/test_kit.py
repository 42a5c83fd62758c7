"""The conformance kit inside an author's own pytest (pytester runs real pytest sessions):
item ids that re-run, counts in the header and --collect-only, per-scenario xfail, several
configs in one session, --strict-markers without pytest-timeout, and the `-p kvx.conformance
--kvx-config` wrapper."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvx.conformance import load_scenarios
from kvx.conformance.kit import AllScenarios, PDScenarios

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(400)

BROKEN_DIR = Path(__file__).resolve().parent / "broken"
EXAMPLE = {
    "kv_connector": "ExamplePDConnector",
    "kv_connector_extra_config": {"directory": "{tmp}", "load_timeout_s": 5},
}
# Fast scenarios: two the example connector passes, one it does not claim.
FAST = "pd_short_prompt or pd_block_multiple or test_hetero_tp"
NO_TIMEOUT_PLUGIN = ("-p", "no:timeout", "-p", "no:cacheprovider", "--strict-markers")

CONFTEST = f"""
import pytest

@pytest.fixture(params=["first", "second"])
def kvx_config(request):
    config = {json.dumps(EXAMPLE)}
    config["kv_connector_extra_config"]["load_timeout_s"] = 5 if request.param == "first" else 6
    return config
"""

THREE_LINES = """
from kvx.conformance.kit import AllScenarios
class TestExample(AllScenarios):
    pass
"""


def outcomes(result: pytest.RunResult) -> dict[str, int]:
    return result.parseoutcomes()


def test_every_scenario_is_a_method_of_its_group() -> None:
    scenarios = load_scenarios()
    methods = {n.removeprefix("test_") for n in dir(AllScenarios) if n.startswith("test_")}
    assert methods == set(scenarios) | {"claims_cover_a_transfer"}
    assert {n.removeprefix("test_") for n in dir(PDScenarios) if n.startswith("test_")} == {
        name for name, s in scenarios.items() if s.group == "pd"
    } | {"claims_cover_a_transfer"}


def test_collect_only_counts_and_ids(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_example=THREE_LINES)
    result = pytester.runpytest_subprocess("--collect-only", "-q", *NO_TIMEOUT_PLUGIN)
    per_config = len(load_scenarios()) + 1
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "test_example.py::TestExample::test_pd_short_prompt[[]first[]]",
            "test_example.py::TestExample::test_pd_short_prompt[[]second[]]",
            f"{2 * per_config} tests collected*",
        ]
    )


def test_two_configs_pass_skip_unclaimed_and_rerun_by_id(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_example=THREE_LINES)
    result = pytester.runpytest_subprocess("-k", FAST, "-rs", *NO_TIMEOUT_PLUGIN)
    assert result.ret == 0, result.stdout.str()
    assert outcomes(result) == {
        "passed": 4,
        "skipped": 2,
        "deselected": outcomes(result)["deselected"],
    }
    header = re.search(
        r"collected (\d+) items / (\d+) deselected / (\d+) selected", result.stdout.str()
    )
    assert header is not None and int(header.group(3)) == 6, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*= kvx conformance =*",
            "ExamplePDConnector: 4 passed, 2 not claimed; KV transfers tested by pd_block_*",
            "*not claimed: needs hetero_tp*",
        ]
    )
    again = pytester.runpytest_subprocess(
        "test_example.py::TestExample::test_pd_short_prompt[second]", *NO_TIMEOUT_PLUGIN
    )
    assert again.ret == 0 and outcomes(again) == {"passed": 1}, again.stdout.str()


def test_xfail_per_scenario_and_failures_name_the_rule(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_example=f"""
        import pytest
        from kvx.conformance.kit import PDScenarios

        class TestWrongDirectory(PDScenarios):
            kvx_xfail = {{"pd_short_prompt": "D reads another directory"}}

            @pytest.fixture
            def kvx_config(self, tmp_path):
                return {json.dumps(EXAMPLE)} | {{"kv_connector": "NoSuchConnector"}}
        """
    )
    result = pytester.runpytest_subprocess(
        "-k", "pd_short_prompt or pd_block_multiple", *NO_TIMEOUT_PLUGIN
    )
    assert outcomes(result) == {
        "failed": 1,
        "xfailed": 1,
        "deselected": outcomes(result)["deselected"],
    }
    result.stdout.fnmatch_lines(["*kvx_config*NoSuchConnector*is not a registered connector*"])
    assert "During handling" not in result.stdout.str()


def test_fail_fast_skips_the_failed_configs_other_scenarios_only(
    pytester: pytest.Pytester,
) -> None:
    broken = EXAMPLE | {"kv_connector": "NoSuchConnector"}
    pytester.makeconftest(
        f"""
        import pytest

        @pytest.fixture(params=["broken", "good"])
        def kvx_config(request):
            return {json.dumps(broken)} if request.param == "broken" else {json.dumps(EXAMPLE)}
        """
    )
    pytester.makepyfile(test_example=THREE_LINES)
    result = pytester.runpytest_subprocess(
        "-k", "pd_short_prompt or pd_block_multiple", "-rs", "--kvx-fail-fast", *NO_TIMEOUT_PLUGIN
    )
    assert outcomes(result) == {
        "failed": 1,
        "passed": 2,
        "skipped": 1,
        "deselected": outcomes(result)["deselected"],
    }, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "NoSuchConnector: 1 failed, 1 not run; NO KV transfer tested",
            "SKIPPED * not run: --kvx-fail-fast, pd_short_prompt failed first",
        ]
    )


def test_a_connector_claiming_nothing_fails_unless_allowed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(BROKEN_DIR))
    pytester.makepyfile(
        test_example="""
        import pytest
        from kvx.conformance.kit import ContractScenarios

        class TestNothing(ContractScenarios):
            @pytest.fixture
            def kvx_config(self):
                return {"kv_connector": "DoesNothing",
                        "kv_connector_module_path": "kvx_broken_connectors"}
        """
    )
    result = pytester.runpytest_subprocess("-k", "claims_cover", *NO_TIMEOUT_PLUGIN)
    assert result.ret == 1 and outcomes(result)["failed"] == 1, result.stdout.str()
    result.stdout.fnmatch_lines(["*NO KV transfer was tested: DoesNothing claims nothing*"])
    allowed = pytester.runpytest_subprocess(
        "-k", "claims_cover", "--kvx-allow-no-transfer", *NO_TIMEOUT_PLUGIN
    )
    assert allowed.ret == 0, allowed.stdout.str()


def test_no_config_says_how_to_give_one(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_example=THREE_LINES)
    result = pytester.runpytest_subprocess("-k", "claims_cover", *NO_TIMEOUT_PLUGIN)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*no connector config: define a `kvx_config` fixture*"])


def test_the_p_wrapper_collects_items_that_rerun_by_id(pytester: pytest.Pytester) -> None:
    config = ("-p", "kvx.conformance", "--kvx-config", json.dumps(EXAMPLE))
    collected = pytester.runpytest_subprocess(*config, "--collect-only", "-q", *NO_TIMEOUT_PLUGIN)
    assert collected.ret == 0, collected.stdout.str()
    collected.stdout.fnmatch_lines([f"{len(load_scenarios()) + 1} tests collected*"])
    item = next(line for line in collected.stdout.lines if line.endswith("::test_pd_short_prompt"))
    assert item == "kvx_conformance.py::TestKvxConformance::test_pd_short_prompt"
    again = pytester.runpytest_subprocess(*config, item, *NO_TIMEOUT_PLUGIN)
    assert again.ret == 0 and outcomes(again) == {"passed": 1}, again.stdout.str()


def test_the_p_wrapper_refuses_a_bad_config(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "-p", "kvx.conformance", "--kvx-config", '{"kv_connector": "NoSuch"}', *NO_TIMEOUT_PLUGIN
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvx-config:*NoSuch*is not a registered connector*"])


def test_the_example_packages_own_tests_pass(pytester: pytest.Pytester) -> None:
    """The example's tests, as docs/conformance.md points authors at them (a real redis-server
    for the composed class) and its failed-load test: the scenario Redis cannot run is an
    expected failure there only."""
    tests = Path(__file__).resolve().parents[2] / "examples/kvx-example-connector/tests"
    result = pytester.runpytest_subprocess(
        str(tests),
        "-k",
        "corrupted_bytes_detected or claims_cover or load_errors",
        "-rsx",
        *NO_TIMEOUT_PLUGIN,
    )
    counts = {k: v for k, v in outcomes(result).items() if k not in ("warnings", "deselected")}
    assert counts == {"passed": 3, "skipped": 1, "xfailed": 1}, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "SKIPPED * not claimed: needs detects_corruption, store_reuse",
            "XFAIL *TestExampleWithRedisStore::test_corrupted_bytes_detected*",
        ]
    )
