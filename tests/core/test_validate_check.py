"""`kvx validate --check` tries the config on this machine: each connector imports, each
secret reads, the store opens, the ports bind. Each failure is exit 2 naming the key."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

import kvx
from kvx.cli.commands import main


def validate(capsys: pytest.CaptureFixture[str], config: dict[str, Any]) -> tuple[int, str, str]:
    code = main(["validate", "--check", "--kv-transfer-config", json.dumps(config)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def storage(url: str) -> dict[str, Any]:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage_url": url},
    }


def nixl(**extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def test_a_working_config_passes_and_its_store_is_opened(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = validate(capsys, storage(f"file://{tmp_path}/kv"))
    assert code == 0, err
    assert "check: SharedStorageConnector imports; its config_checks passed: open the store" in err
    assert (tmp_path / "kv").is_dir() and json.loads(out)["kv_connector"]
    code, _, err = validate(capsys, nixl(side_channel_host="127.0.0.1", side_channel_port=0))
    assert code == 0, err


def test_a_store_that_cannot_be_opened(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    code, out, err = validate(capsys, storage(f"file://{tmp_path}/file/kv"))
    assert (code, out) == (2, "")
    assert f"kv_connector_extra_config.storage_url: cannot open 'file://{tmp_path}/file/kv'" in err
    assert "Traceback" not in err


def test_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, out, err = validate(capsys, nixl(side_channel_port=port))
    assert (code, out) == (2, "")
    assert f"kv_connector_extra_config.side_channel_port: cannot listen on 127.0.0.1:{port}" in err
    assert "pick a free port (0: any)" in err


def test_an_address_this_machine_does_not_have(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = validate(capsys, nixl(side_channel_host="192.0.2.77"))
    assert code == 2
    assert "kv_connector_extra_config.side_channel_host: cannot listen on 192.0.2.77:0" in err


def test_a_child_connector_that_does_not_import_is_refused(
    capsys: pytest.CaptureFixture[str], plugin_env: Path, tmp_path: Path
) -> None:
    config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [storage(f"file://{tmp_path}/kv"), {"kv_connector": "BrokenTarget"}]
        },
    }
    code = main(["validate", "--kv-transfer-config", json.dumps(config)])
    assert code == 2  # a child is imported like the top connector, --check or not
    assert capsys.readouterr().err.startswith(
        "error: the config is valid but the connector at kv_connector_extra_config.connectors[1] "
        "cannot be used: connector 'BrokenTarget'"
    )
    code, out, err = validate(capsys, config)  # --check: the same
    assert (code, out) == (2, "")
    assert "connectors[1] cannot be used: connector 'BrokenTarget': 'kvx_test_plugin" in err


def test_an_offloading_disk_tier_that_cannot_be_opened(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("not a directory")
    extra = {"cpu_bytes_to_use": 1 << 24, "disk_bytes_to_use": 1 << 24}
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    code, _, err = validate(
        capsys,
        {**config, "kv_connector_extra_config": {**extra, "disk_url": f"file://{tmp_path}/d"}},
    )
    assert code == 0, err
    assert (tmp_path / "d").is_dir()
    bad = f"file://{tmp_path}/file/d"
    code, _, err = validate(
        capsys, {**config, "kv_connector_extra_config": {**extra, "disk_url": bad}}
    )
    assert code == 2
    assert f"kv_connector_extra_config.disk_url: cannot open {bad!r}" in err


def test_a_missing_optional_dependency_is_a_note_but_fails_the_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}  # no lmcache in .venv
    hint = kvx.install_hint("lmcache", "lmcache")
    code = main(["validate", "--kv-transfer-config", json.dumps(config)])
    assert code == 0  # the config may run where lmcache is installed
    assert f"note: connector 'LMCacheConnectorV1' needs lmcache to run: {hint}" in (
        capsys.readouterr().err
    )
    code, _, err = validate(capsys, config)
    assert code == 2
    assert "kv_connector: cannot be used: connector 'LMCacheConnectorV1' needs 'lmcache'" in err
    assert hint in err
