"""`kvx demo` tells the truth: a run that moved no KV between the engines fails and says why,
`{tmp}` is expanded, a bad flag is a bad flag, and NIXL's log lines stay out of the table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

KVX = Path(sys.executable).parent / "kvx"
# NIXL's INFO lines: its Python logger ("2026-11-25 22:06:59 NIXL INFO    _api.py:405 Backend UCX
# was instantiated", on stdout) and its C++ one (abseil's "I1125 22:10:00.123456 1234 file.cc:12]")
NIXL_INFO_LINE = re.compile(
    r"^(.* NIXL INFO .*|I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\].*)$", re.MULTILINE
)


def kvx(
    *args: str, cwd: Path | None = None, timeout: float = 100, **env: str
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb", **env}
    return subprocess.run(
        [str(KVX), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
        check=False,
    )


def summary_row(stdout: str, metric: str) -> str:
    """The value of `metric` in the demo's summary table."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(f"│ {metric} ")]
    return line.split("│")[-2].strip()


def demo(
    kv: dict[str, object], cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return kvx(
        "demo",
        "--kv-transfer-config",
        json.dumps(kv),
        "--prompts",
        "3",  # prompts of 5, 16 and 24 tokens: two fill a block
        "--max-tokens",
        "2",
        cwd=cwd,
        **env,
    )


def assert_nothing_moved_is_a_failure(result: subprocess.CompletedProcess[str], why: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert summary_row(result.stdout, "KV blocks moved") == "0"
    assert summary_row(result.stdout, "KV byte checks") != "passed"
    assert summary_row(result.stdout, "outputs identical to baseline") != "yes"
    assert "warning: no KV moved from prefill to decode" in output
    assert why in output
    assert "Traceback" not in output


@pytest.mark.timeout(120)
def test_memory_storage_moves_nothing_and_says_it_is_per_process() -> None:
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": f"memory://kvx-demo-{os.getpid()}"},
    }
    assert_nothing_moved_is_a_failure(
        demo(kv), "memory:// storage lives in each process's own memory"
    )


@pytest.mark.timeout(120)
def test_offloading_connector_never_crosses_engines() -> None:
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24},
    }
    assert_nothing_moved_is_a_failure(
        demo(kv), "OffloadingConnector claims neither 'remote_prefill' nor 'store_reuse'"
    )


@pytest.mark.timeout(120)
def test_tmp_placeholder_is_expanded(tmp_path: Path) -> None:
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": "file://{tmp}/kv"},
    }
    result = demo(kv, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert int(summary_row(result.stdout, "KV blocks moved")) > 0
    assert summary_row(result.stdout, "outputs identical to baseline") == "yes"
    assert list(tmp_path.iterdir()) == []  # no literal "{tmp}" directory in the working dir


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--block-size", "--prompts", "--max-tokens"])
def test_non_positive_sizes_are_bad_flags(flag: str) -> None:
    result = kvx("demo", flag, "0", timeout=50)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"argument {flag}: '0' is not allowed: use a whole number of 1 or more" in result.stderr
    assert "invalid KV transfer config" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_nixl_info_lines_stay_out_of_the_summary() -> None:
    kv = {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"kv_lease_duration": 10}}
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    result = subprocess.run(
        [str(KVX), "demo", "--kv-transfer-config", json.dumps(kv), "--prompts", "3"],
        capture_output=True,
        text=True,
        timeout=100,
        env={**env, "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb"},
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert int(summary_row(result.stdout, "KV blocks moved")) > 0
    assert NIXL_INFO_LINE.findall(output) == []


@pytest.mark.timeout(120)
def test_a_store_saving_after_finish_is_named_as_the_cause(tmp_path: Path) -> None:
    """Prefill plans its saves after request_finished, and stops stepping once its requests
    finished: the hint names saving in the forward first, not only "check both engines reach
    the same storage". (When such saves do land later, the hint says decode looked before
    they did: `why_nothing_moved` with `stored_after`.)"""
    broken = Path(__file__).resolve().parents[1] / "conformance" / "broken"
    kv = {
        "kv_connector": "SavesAfterFinishStore",
        "kv_connector_module_path": "kvx_broken_stores",
        "kv_connector_extra_config": {"storage_url": f"file://{tmp_path}/store"},
    }
    result = demo(kv, PYTHONPATH=str(broken))
    assert_nothing_moved_is_a_failure(
        result, "saves planned after request_finished never run once prefill stops stepping"
    )


def test_the_hint_for_saves_that_land_after_decode_looked() -> None:
    from kvx import Capability
    from kvx.cli.demo import why_nothing_moved

    kv = {"kv_connector": "SlowStore"}
    hint = why_nothing_moved(kv, {Capability.STORE_REUSE}, stored_after=48)
    assert hint.startswith("prefill saved nothing before its requests finished"), hint
    assert "48 of their tokens are stored now" in hint, hint
