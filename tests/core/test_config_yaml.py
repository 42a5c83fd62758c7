"""YAML config files (`@kv.yaml`, `@kv.yml`): the same validation as JSON, YAML-only values
refused, syntax errors located, alias bombs bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvx import ConfigError, KVTransferConfig, load_cli_arg
from kvx.cli.commands import main
from kvx.config.yaml_files import MAX_YAML_VALUES

pytestmark = pytest.mark.timeout(60)

YAML = """\
# a comment: YAML's reason to exist
kv_connector: SharedStorageConnector
kv_role: kv_both
kv_connector_extra_config:
  storage_url: file:///tmp/kvx-kv
  io_threads: 3
"""
SAME_JSON = {
    "kv_connector": "SharedStorageConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"storage_url": "file:///tmp/kvx-kv", "io_threads": 3},
}


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return f"@{path}"


def _problem(arg: str) -> str:
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_cli(arg)
    return str(info.value)


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".YAML"])
def test_yaml_file_reads_as_the_same_config_as_json(tmp_path: Path, suffix: str) -> None:
    arg = _write(tmp_path, f"kv{suffix}", YAML)
    assert load_cli_arg(arg) == SAME_JSON
    from_yaml = KVTransferConfig.from_cli(arg).to_dict()
    from_json = KVTransferConfig.from_dict(SAME_JSON).to_dict()
    from_yaml.pop("engine_id"), from_json.pop("engine_id")  # random per config
    assert from_yaml == from_json


def test_a_json_file_is_still_parsed_as_json(tmp_path: Path) -> None:
    # YAML would read `{kv_role: x}`; the .json suffix keeps JSON's stricter grammar
    assert "not valid JSON" in _problem(_write(tmp_path, "kv.json", "{kv_role: kv_both}"))


def test_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    text = "kv_connector: SharedStorageConnector\nkv_role: [kv_both\n"
    message = _problem(_write(tmp_path, "bad.yaml", text))
    assert "bad.yaml" in message and "is not valid YAML" in message
    assert "line 3 column 1" in message, message


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("2024-01-01", "a YAML date or timestamp ('2024-01-01')"),
        ("2024-01-01 10:00:00", "a YAML date or timestamp"),
        ("!!binary aGVsbG8=", "YAML binary data (!!binary)"),
        ("!!set {a, b}", "a YAML set (!!set)"),
        ("!!omap [{a: 1}]", "ordered map"),
        (".nan", "use a finite number"),
        ("-.inf", "use a finite number"),
        ("{1: x}", "key 1 (int)"),
        ("{null: x}", "key None (NoneType)"),
    ],
)
def test_yaml_only_values_are_refused_with_their_path(
    tmp_path: Path, value: str, needle: str
) -> None:
    text = f"kv_connector: SharedStorageConnector\nkv_connector_extra_config:\n  field: {value}\n"
    message = _problem(_write(tmp_path, "kv.yaml", text))
    assert "kv_connector_extra_config.field" in message and needle in message, message
    assert "kv.yaml" in message


def test_after_parsing_the_json_validation_applies(tmp_path: Path) -> None:
    message = _problem(_write(tmp_path, "kv.yml", "kv_role: kv_bth\n"))
    assert "kv_role" in message and "kv_bth" in message and "kv_both" in message, message
    assert "object" in _problem(_write(tmp_path, "list.yaml", "- a\n- b\n"))


def test_alias_bomb_is_bounded(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    message = _problem(_write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n"))
    assert f"expands to more than {MAX_YAML_VALUES} values" in message, message


def test_self_referencing_alias_is_refused(tmp_path: Path) -> None:
    message = _problem(_write(tmp_path, "loop.yaml", "kv_connector_extra_config: &a [*a]\n"))
    assert "nested deeper than" in message, message


def test_python_tags_are_not_constructed(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = f"kv_connector: !!python/object/apply:os.system ['touch {marker}']\n"
    message = _problem(_write(tmp_path, "evil.yaml", text))
    assert "is not valid YAML" in message and "python/object/apply" in message, message
    assert not marker.exists()


def test_cli_validate_and_dotted_overrides_read_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arg = _write(tmp_path, "kv.yaml", YAML)
    assert main(["validate", "--kv-transfer-config", arg, "--kv-transfer-config.kv_rank=1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kv_connector_extra_config"]["io_threads"] == 3 and printed["kv_rank"] == 1
    bad = _write(tmp_path, "bad.yml", "kv_role: [\n")
    assert main(["validate", "--kv-transfer-config", bad]) == 2
    err = capsys.readouterr().err
    assert "bad.yml" in err and "line 2 column 1" in err and "Traceback" not in err
