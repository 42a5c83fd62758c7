"""vLLM's spellings that mean what kvx's do are accepted and mapped, with a note in
`kvx validate`: OffloadingConnector's num_cpu_blocks / spec_name, the NIXL side channel's
environment variables, "localhost", and the `--kv-transfer-config.KEY` dot notation."""

from __future__ import annotations

import json
import socket

import pytest

import kvx
from kvx.cli.commands import main
from kvx.config.dotted import merge_dotted_args
from kvx.engine import Engine, EngineConfig
from kvx.plugins.nixl.config import NixlConfig, side_channel_address
from kvx.plugins.offload.scheduler import OffloadScheduler


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def offload(extra: dict[str, object]) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


def test_num_cpu_blocks_and_spec_name_are_accepted_with_notes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys,
        "validate",
        "--kv-transfer-config",
        offload({"num_cpu_blocks": 6, "spec_name": "CPUOffloadingSpec"}),
    )
    assert code == 0, err
    assert json.loads(out)["kv_connector_extra_config"]["num_cpu_blocks"] == 6
    assert "note: kv_connector_extra_config.num_cpu_blocks: 6 (vLLM's name) is mapped to " in err
    assert "computed when the connector is built on the engine" in err
    assert "note: kv_connector_extra_config.spec_name: 'CPUOffloadingSpec' (vLLM's name)" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"num_cpu_blocks": 6, "spec_name": "NPUOffloadingSpec"},
            "spec_name: 'NPUOffloadingSpec' is not allowed; allowed: 'CPUOffloadingSpec'",
        ),
        (
            {"num_cpu_blocks": 6, "spec_module_path": "vllm_ascend.kv_offload.npu"},
            "spec_module_path: 'vllm_ascend.kv_offload.npu' names a vLLM Python class",
        ),
        (
            {"num_cpu_blocks": 6, "cpu_bytes_to_use": 1 << 20},
            "num_cpu_blocks: give cpu_bytes_to_use (1048576) or vLLM's num_cpu_blocks (6), "
            "not both",
        ),
        ({}, "cpu_bytes_to_use: required key is missing; expected an integer > 0 (bytes of the"),
        ({"num_cpu_blocks": 0}, "num_cpu_blocks: 0 (integer) is out of range"),
    ],
)
def test_offloading_spellings_that_cannot_map(
    capsys: pytest.CaptureFixture[str], extra: dict[str, object], message: str
) -> None:
    code, out, err = run(capsys, "validate", "--kv-transfer-config", offload(extra))
    assert (code, out) == (2, "")
    assert f"kv_connector_extra_config.{message}" in err, err


def test_num_cpu_blocks_becomes_bytes_on_the_engine() -> None:
    config = kvx.KVTransferConfig.from_json(offload({"num_cpu_blocks": 5, "blocks_per_chunk": 2}))
    engine = Engine(EngineConfig(kv_transfer_config=config))
    try:
        connector = engine.scheduler_connector
        assert isinstance(connector, kvx.RoleSplitConnector)
        assert isinstance(connector.scheduler, OffloadScheduler)
        assert connector.scheduler.per_chunk == 2
        assert connector.scheduler.manager.num_slots == 5  # vLLM's count of offloaded blocks
    finally:
        engine.shutdown()
    too_many = kvx.KVTransferConfig.from_json(offload({"num_cpu_blocks": 1 << 40}))
    with pytest.raises(kvx.ConfigError, match="num_cpu_blocks: 1099511627776 offloaded blocks of"):
        Engine(EngineConfig(kv_transfer_config=too_many))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_nixl_side_channel_from_vllm_environment_variables() -> None:
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "localhost", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"}
    from_env = side_channel_address(NixlConfig(), env)
    assert (from_env.host, from_env.port) == ("127.0.0.1", 5611)
    assert (from_env.host_from, from_env.port_from) == tuple(env)
    config_wins = side_channel_address(NixlConfig("127.0.0.2", 5612), env)
    assert (config_wins.host, config_wins.port, config_wins.host_from) == (
        "127.0.0.2",
        5612,
        "config",
    )
    default = side_channel_address(NixlConfig(), {})
    assert (default.host, default.port, default.port_from) == ("127.0.0.1", 0, "default")
    with pytest.raises(kvx.ConfigError, match="side_channel_port: VLLM_NIXL_SIDE_CHANNEL_PORT='x'"):
        side_channel_address(NixlConfig(), {"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"})
    with pytest.raises(kvx.ConfigError, match="side_channel_host: VLLM_NIXL_SIDE_CHANNEL_HOST="):
        side_channel_address(NixlConfig(), {"VLLM_NIXL_SIDE_CHANNEL_HOST": "example.com"})


def test_validate_says_which_side_channel_source_was_used(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(port))
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    code, _, err = run(capsys, "validate", "--check", "--kv-transfer-config", json.dumps(nixl))
    assert code == 0, err
    assert (
        "note: kv_connector_extra_config.side_channel_host: 127.0.0.1 from "
        "VLLM_NIXL_SIDE_CHANNEL_HOST=localhost" in err
    )
    assert f"side_channel_port: {port} from VLLM_NIXL_SIDE_CHANNEL_PORT={port}" in err
    nixl["kv_connector_extra_config"] = {"side_channel_host": "localhost", "side_channel_port": 0}
    code, _, err = run(capsys, "validate", "--kv-transfer-config", json.dumps(nixl))
    assert code == 0, err
    assert "from VLLM_NIXL" not in err  # the config wins
    assert 'side_channel_host: "localhost" is 127.0.0.1' in err


def test_dot_notation_sets_keys_and_nested_extra_config(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    code, out, err = run(
        capsys,
        "validate",
        "--kv-transfer-config",
        '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}',
        "--kv-transfer-config.kv_role=kv_both",
        "--kv-transfer-config.kv_connector_extra_config.side_channel_port",
        "0",
        '--kv-transfer-config.kv_connector_extra_config.backends=["UCX"]',
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kv_role"] == "kv_both"  # the dotted flag wins over the JSON
    assert doc["kv_connector_extra_config"]["side_channel_port"] == 0
    assert doc["kv_connector_extra_config"]["backends"] == ["UCX"]
    code, out, err = run(
        capsys,
        "validate",
        "--kv-transfer-config.kv_connector=OffloadingConnector",
        "--kv-transfer-config.kv_role=kv_both",
        "--kv-transfer-config.kv_connector_extra_config.num_cpu_blocks=4",
    )
    assert code == 0, err
    assert json.loads(out)["kv_connector_extra_config"]["num_cpu_blocks"] == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--kv-transfer-config.kv_role"],
            "kv_role: --kv-transfer-config.kv_role is given "
            "without a value; use --kv-transfer-config.kv_role=VALUE",
        ),
        (
            ["--kv-transfer-config.kv_role..x=1"],
            "kv_role..x: --kv-transfer-config.kv_role..x: empty key name",
        ),
        (
            ["--kv-transfer-config.kv_role=kv_both", "--kv-transfer-config.kv_role.x=1"],
            'kv_role: is "kv_both", not an object',
        ),
        (["--kv-transfer-config.kv_rol=kv_both"], 'kv_rol: unknown key (did you mean "kv_role"?)'),
    ],
)
def test_dot_notation_mistakes_name_the_key(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(capsys, "validate", *args)
    assert (code, out) == (2, ""), err
    assert message in err, err


def test_dot_notation_reaches_every_command_taking_the_flag() -> None:
    argv = ["demo", "--kv-transfer-config.kv_connector=NixlConnector", "--prompts", "2"]
    merged = merge_dotted_args(argv)
    assert merged[:3] == ["demo", "--prompts", "2"]
    assert merged[3] == "--kv-transfer-config"
    assert json.loads(merged[4]) == {"kv_connector": "NixlConnector"}
    assert merge_dotted_args(["list"]) == ["list"]
