"""The `kvx` command: real subprocesses of the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvx

pytestmark = pytest.mark.timeout(120)

KVX = shutil.which("kvx", path=str(Path(sys.executable).parent))

FAKE_HINT = kvx.install_hint("fake-extra", "x")  # for the way kvx is installed here


def kvx_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    assert KVX is not None, "the kvx console script is not installed next to this Python"
    return subprocess.run([KVX, *args], capture_output=True, text=True, timeout=60, check=False)


def test_version() -> None:
    result = kvx_cmd("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvx {kvx.__version__} (connector contract 1.0)"


def test_list_shows_sources_status_and_problems(plugin_env: Path) -> None:
    result = kvx_cmd("list")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "EchoConnector" in out and "kvx-test-plugin 0.0.1" in out and "TestEcho" in out
    assert f"missing kvx_test_never_installed_dependency: {FAKE_HINT}" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert "│ ok " in rows["EchoConnector"]
    # "ok" only for targets that import: one naming a missing class says what is wrong
    assert "│ ok " not in rows["BrokenTarget"]
    assert "'kvx_test_plugin.connectors' has no attribute 'NoSuchClass'" in rows["BrokenTarget"]
    assert "not a subclass of kvx.KVConnectorBase_V1" in rows["NotAConnector"]
    assert "warning: plugin 'kvx_test_plugin_broken' not loaded: RuntimeError" in result.stderr
    assert "Traceback" not in result.stderr


def test_list_json(plugin_env: Path) -> None:
    result = kvx_cmd("list", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    connectors = {c["name"]: c for c in doc["connectors"]}
    assert connectors["EchoConnector"] == {
        "name": "EchoConnector",
        "aliases": ["TestEcho"],
        "source": "kvx-test-plugin 0.0.1",
        "plugin": "kvx_test_plugin",
        "importable": True,
        "status": "ok",
        "install_hint": None,
        "summary": "does nothing, answers every hook",
    }
    assert connectors["NeedsMissingDependency"]["importable"] is False
    assert connectors["BrokenTarget"]["importable"] is False
    assert connectors["BrokenTarget"]["status"] == (
        "connector 'BrokenTarget': 'kvx_test_plugin.connectors' has no attribute 'NoSuchClass'"
    )
    assert {
        "plugin": "kvx_test_plugin_broken",
        "message": "RuntimeError: this plugin is broken on purpose",
    } in doc["plugin_problems"]
    assert set(doc) == {
        "connectors",
        "layouts",
        "transforms",
        "storage backends",
        "plugin_problems",
    }


def test_validate_prints_normalised_config(plugin_env: Path) -> None:
    config = {
        "kv_connector": "TestEcho",
        "kv_role": "kv_producer",
        "engine_id": "p0",
        "kv_connector_extra_config": {"mode": "async"},
    }
    result = kvx_cmd("validate", "--kv-transfer-config", json.dumps(config))
    assert result.returncode == 0, result.stderr
    normalised = json.loads(result.stdout)
    assert normalised["engine_id"] == "p0"
    assert normalised["kv_load_failure_policy"] == "fail"
    assert normalised["kv_connector_extra_config"] == {
        "storage_path": "/tmp/echo",
        "num_threads": 4,
        "mode": "async",
        "tags": [],
    }
    assert result.stderr == ""


def test_validate_reads_a_file_and_notes_missing_extras(plugin_env: Path, tmp_path: Path) -> None:
    path = tmp_path / "kv.json"
    path.write_text(
        json.dumps({"kv_connector": "NeedsMissingDependency", "kv_role": "kv_consumer"})
    )
    result = kvx_cmd("validate", "--kv-transfer-config", f"@{path}")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kv_role"] == "kv_consumer"
    assert result.stderr.strip() == (
        "note: connector 'NeedsMissingDependency' needs kvx_test_never_installed_dependency to "
        f"run: {FAKE_HINT}"
    )


def test_validate_errors_exit_2_without_traceback(plugin_env: Path) -> None:
    config = {
        "kv_connector": "CompositeConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "EchoConnector"},
                {"kv_connector": "EchoConnector", "kv_role": "kv_prodcer"},
            ]
        },
    }
    result = kvx_cmd("validate", "--kv-transfer-config", json.dumps(config))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip() == (
        "error: invalid KV transfer config: kv_connector_extra_config.connectors[1].kv_role: "
        '"kv_prodcer" (string) is not allowed; allowed: "kv_both", "kv_consumer", "kv_producer" '
        '(did you mean "kv_producer"?)'
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("validate", "--kv-transfer-config", "{oops"), "not valid JSON"),
        (("validate", "--kv-transfer-config", "@/nonexistent/kv.json"), "cannot read config"),
        (("validate",), "the following arguments are required: --kv-transfer-config"),
        (("frobnicate",), "invalid choice: 'frobnicate'"),
        ((), "the following arguments are required: COMMAND"),
    ],
)
def test_usage_errors_exit_2(args: tuple[str, ...], needle: str) -> None:
    result = kvx_cmd(*args)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_help_exits_0() -> None:
    result = kvx_cmd("--help")
    assert result.returncode == 0
    assert "validate" in result.stdout and "list" in result.stdout


def test_validate_refuses_a_connector_whose_target_does_not_import(plugin_env: Path) -> None:
    result = kvx_cmd(
        "validate", "--kv-transfer-config", '{"kv_connector": "BrokenTarget", "kv_role": "kv_both"}'
    )
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == (
        "error: the config is valid but its connector cannot be used: connector 'BrokenTarget': "
        "'kvx_test_plugin.connectors' has no attribute 'NoSuchClass'"
    )


def test_plugins_register_subcommands(plugin_env: Path) -> None:
    result = kvx_cmd("echo-args", "--anything", "goes", "-h")
    assert (result.returncode, result.stdout) == (3, "kvx echo-args --anything goes -h\n")
    assert "echo-args" in kvx_cmd("--help").stdout
    unknown = kvx_cmd("list", "--no-such-flag")
    assert unknown.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in unknown.stderr
