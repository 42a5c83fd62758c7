"""The example third-party connector passes the whole conformance suite, through every entry
point: the Python API, `kvx conformance` and the pytest plugin."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvx_package_tests import run_package_tests

from kvx.conformance import SCENARIOS, run_suite
from kvx.conformance.runner import FAILED, NOT_CLAIMED, PASSED, load_scenarios

CONFIG = {
    "kv_connector": "ExamplePDConnector",
    "kv_connector_extra_config": {"directory": "{tmp}", "load_timeout_s": 5},
}
UNCLAIMED = {
    "store_and_reuse",
    "corrupted_bytes_detected",
    "offload_and_reload",
    "hetero_tp",
    "block_size_mismatch",
    "layout_conversion",
    "stored_hetero_tp",
    "stored_block_size_mismatch",
    "stored_layout_conversion",
    "roles_store_reuse",
    "stats_and_events_shape_stored",
    "stats_and_events_shape_offloaded",
    "mla_pd",
    "mla_pd_hetero_tp",
    "mla_stored_hetero_tp",
    "mla_offload_and_reload",
    "window_store_reuse",
    "window_offload",
    "store_pd_prefill_killed",
    "groups_pd",
    "groups_store_reuse",
    "groups_offload",
}
KVX = shutil.which("kvx", path=str(Path(sys.executable).parent))
EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "kvx-example-connector"


@pytest.mark.timeout(600)
def test_full_suite_passes_with_unclaimed_reported() -> None:
    results = run_suite(CONFIG, fault_timeout_s=20)
    assert [r.name for r in results] == list(load_scenarios())
    assert len(results) == len(SCENARIOS) >= 25
    outcomes = {r.name: r.outcome for r in results}
    failed = {r.name: r.message for r in results if r.outcome == FAILED}
    assert not failed
    assert {n for n, o in outcomes.items() if o == NOT_CLAIMED} == UNCLAIMED
    assert all(o == PASSED for n, o in outcomes.items() if n not in UNCLAIMED)


@pytest.mark.timeout(1200)
def test_its_own_tests_pass_composed_with_a_redis_store() -> None:
    """The example's own kit tests, as its author runs them, for the class that composes it with
    kvx's shared-storage connector on Redis: every scenario the composition claims passes (the
    Redis store's corrupted_bytes_detected is the one expected failure, an xfail)."""
    result = run_package_tests(EXAMPLE_DIR, "-q", "-k", "TestExampleWithRedisStore", timeout=1150)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    composed = re.search(r"MultiConnector: (\d+) passed", output)
    assert composed and int(composed.group(1)) >= 25, output[-4000:]  # the whole suite ran


@pytest.mark.timeout(300)
def test_cli_writes_a_report(tmp_path: Path) -> None:
    assert KVX is not None
    report = tmp_path / "report.md"
    result = subprocess.run(
        [
            KVX,
            "conformance",
            "--kv-transfer-config",
            json.dumps(CONFIG),
            "--report",
            str(report),
            "--scenario",
            "pd_short_prompt",
            "--scenario",
            "hetero_tp",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "1 passed, 0 failed, 1 not claimed; KV transfers tested by: pd_short_prompt"
        in result.stdout
    )
    text = report.read_text()
    assert "| pd_short_prompt | P kv_producer, D kv_consumer | passed |" in text
    assert "| hetero_tp | P kv_producer, D kv_consumer | not claimed |" in text
    assert "needs hetero_tp" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-transfer-config", '{"kv_connector": "NoSuch"}'], "is not a registered connector"),
        (
            ["--kv-transfer-config", json.dumps(CONFIG), "--scenario", "nope"],
            "unknown scenario(s) ['nope']",
        ),
        (
            ["--kv-transfer-config", json.dumps(CONFIG), "--stall-timeout", "-1"],
            "argument --stall-timeout: -1 is not a positive number of seconds",
        ),
    ],
)
def test_cli_bad_input_exits_2(args: list[str], needle: str) -> None:
    assert KVX is not None
    result = subprocess.run(
        [KVX, "conformance", *args], capture_output=True, text=True, timeout=50, check=False
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(300)
def test_pytest_plugin(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "kvx.conformance",
            "--kvx-config",
            json.dumps(CONFIG),
            "-k",
            "pd_short_prompt or (hetero_tp and not stored and not mla) or abort_on_prefill",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        cwd=tmp_path,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "2 passed, 1 skipped" in out
    assert "not claimed: needs hetero_tp" in out


def test_docs_list_every_scenario() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "conformance.md").read_text()
    missing = [name for name in load_scenarios() if f"| `{name}` |" not in text]
    assert not missing, f"docs/conformance.md does not describe {missing}"


@pytest.mark.timeout(600)
def test_the_example_packages_own_tests_run_the_kit_on_two_configs(tmp_path: Path) -> None:
    """The example package's three-line test file runs the kit from plain pytest, once with the
    connector alone and once composed with a store on a Redis server its conftest starts."""
    chosen = "pd_short_prompt or pd_prefill_block_pressure or roles_store_reuse or claims_cover"
    base = str(tmp_path / "base")
    result = run_package_tests(EXAMPLE_DIR, "-k", chosen, "-rs", "--basetemp", base, timeout=580)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "7 passed, 1 skipped" in out, out
    assert "not claimed: needs store_reuse" in out, out
    assert (
        "MultiConnector: 3 passed; KV transfers tested by pd_prefill_block_pressure, "
        "pd_short_prompt, roles_store_reuse" in out
    ), out
