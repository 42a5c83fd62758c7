"""`kvx list` and `kvx validate` say what they checked and stay cheap: targets and config schemas
are checked without running connector modules (no torch), `validate --check` names what it
tried for each connector and what it could not, and a wrong config schema is not `ok`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvx import ConnectorSpec
from kvx.cli.commands import main
from kvx.registry.catalog import Registered
from kvx.registry.core import Registry

pytestmark = pytest.mark.timeout(120)

STORE = {
    "kv_connector": "SharedStorageConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"storage_url": "file:///tmp/kvx-never-opened"},
}
HEAVY = ("torch", "numpy")
PROBE = """
import json, sys
from kvx.cli.commands import main
code = main(sys.argv[1:])
heavy = [m for m in HEAVY if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
""".replace("HEAVY", repr(HEAVY))


def cold(*args: str) -> dict[str, object]:
    """Run `kvx ARGS` in a fresh interpreter; its exit code and which heavy modules it loaded."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60
    )
    result: dict[str, object] = json.loads(done.stderr.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "args",
    [
        ("list",),
        ("list", "--json"),
        ("validate", "--kv-transfer-config", json.dumps(STORE)),
        (
            "validate",
            "--kv-transfer-config",
            json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}),
        ),
        ("--help",),
    ],
    ids=["list", "list-json", "validate-storage", "validate-nixl", "help"],
)
def test_list_and_validate_do_not_import_torch(args: tuple[str, ...]) -> None:
    assert cold(*args) == {"code": 0, "heavy": []}


def test_check_imports_what_validate_only_reads(tmp_path: Path) -> None:
    store = {**STORE, "kv_connector_extra_config": {"storage_url": f"file://{tmp_path}/kv"}}
    result = cold("validate", "--check", "--kv-transfer-config", json.dumps(store))
    assert result == {"code": 0, "heavy": list(HEAVY)}


def test_check_says_what_it_tried(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = {**STORE, "kv_connector_extra_config": {"storage_url": f"file://{tmp_path}/kv"}}
    code = main(["validate", "--check", "--kv-transfer-config", json.dumps(store)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.strip() == (
        "check: SharedStorageConnector imports; its config_checks passed: open the store "
        "(creating a local directory) and close it"
    )


def test_check_of_a_connector_without_checks_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "kv_connector": "ExamplePDConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"directory": "/proc/kv"},  # not writable: never tried
    }
    code = main(["validate", "--check", "--kv-transfer-config", json.dumps(config)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.strip() == (
        "check: ExamplePDConnector imports; NOT checked: it defines no config_checks, so "
        "nothing its config names (paths, stores, addresses, ports) was tried"
    )
    assert "the storage opens" not in err and "the ports bind" not in err


def test_check_of_a_composite_reports_each_child(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = {"kv_connector": "SharedStorageConnector"}
    store["kv_connector_extra_config"] = {"storage_url": f"file://{tmp_path}/kv"}  # type: ignore[assignment]
    config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [store, {"kv_connector": "ExamplePDConnector"}]
        },
    }
    code = main(["validate", "--check", "--kv-transfer-config", json.dumps(config)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 0, lines
    assert lines[0] == "check: MultiConnector imports; its connectors:"
    assert lines[1].startswith(
        "check: kv_connector_extra_config.connectors[0]: SharedStorageConnector imports; its "
        "config_checks passed"
    )
    assert lines[2].startswith(
        "check: kv_connector_extra_config.connectors[1]: ExamplePDConnector imports; NOT checked"
    )


def add_connector(registry: Registry, spec: ConnectorSpec) -> None:
    registry.catalogs["connector"].add(Registered(spec, "kvx_test_plugin", "kvx-test-plugin"))


def test_list_status_checks_the_config_schema(plugin_registry: Registry) -> None:
    target = "kvx_test_plugin.connectors:EchoConnector"
    add_connector(
        plugin_registry,
        ConnectorSpec("WrongSchemaName", target, config_schema="kvx_test_plugin.schemas:NoSuch"),
    )
    add_connector(
        plugin_registry,
        ConnectorSpec("NotASchema", target, config_schema="kvx_test_plugin.connectors:identity"),
    )
    add_connector(
        plugin_registry,
        ConnectorSpec("RightSchema", target, config_schema="kvx_test_plugin.schemas:EchoConfig"),
    )
    assert plugin_registry.import_problem("connector", "WrongSchemaName") == (
        "config schema of connector 'WrongSchemaName': 'kvx_test_plugin.schemas' has no "
        "attribute 'NoSuch'"
    )
    problem = plugin_registry.import_problem("connector", "NotASchema")
    assert problem is not None and "is not a schema type" in problem
    assert plugin_registry.import_problem("connector", "RightSchema") is None


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("BrokenTarget", "'kvx_test_plugin.connectors' has no attribute 'NoSuchClass'"),
        ("NotAConnector", "is not a subclass of kvx.KVConnectorBase_V1"),
        ("FutureContractConnector", "implements kvx connector contract 2.0"),
        ("ImportsMissingDependency", "needs 'kvx_test_never_installed_dependency'"),
        ("EchoConnector", None),
    ],
)
def test_targets_are_judged_from_their_source(
    plugin_registry: Registry, name: str, problem: str | None
) -> None:
    found = plugin_registry.import_problem("connector", name)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found
