"""Configs an attacker or a careless operator writes, through the API and `kvx validate --check`:
only kvx's own errors (ConfigError; exit 0 or 2), at any depth, for any URL a check opens.

The fuzz is seeded and bounded for CI (1,000 API configs, 100 through `--check`);
KVX_CONFIG_FUZZ_FULL=1 runs the issue's counts (10,000 and 1,000)."""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from kvx.cli.commands import main
from kvx.config.transfer import KVTransferConfig
from kvx.errors import ConfigError

pytestmark = pytest.mark.timeout(600)

FULL = os.environ.get("KVX_CONFIG_FUZZ_FULL") == "1"
API_CONFIGS = 10_000 if FULL else 1_000
CHECK_CONFIGS = 1_000 if FULL else 100


def nested(depth: int, kind: str = "list") -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def check(capsys: pytest.CaptureFixture[str], config: Any) -> tuple[int, str]:
    code = main(["validate", "--check", "--kv-transfer-config", json.dumps(config)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    return code, err


@pytest.mark.parametrize("kind", ["list", "dict"])
@pytest.mark.parametrize(
    "where",
    ["kv_role", "extra", "extra.storage_url", "child.extra", "child.kv_connector"],
)
def test_a_value_nested_5000_deep_is_a_config_error(where: str, kind: str) -> None:
    deep = nested(5000, kind)
    config: dict[str, Any] = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage_url": "memory://kv"},
    }
    expected = {
        "kv_role": "kv_role",
        "extra": "kv_connector_extra_config.x",
        "extra.storage_url": "kv_connector_extra_config.storage_url",
        "child.extra": "kv_connector_extra_config.connectors[0].kv_connector_extra_config.y",
        "child.kv_connector": "kv_connector_extra_config.connectors[0].kv_connector",
    }[where]
    if where == "kv_role":
        config["kv_role"] = deep
    elif where == "extra":
        config["kv_connector_extra_config"]["x"] = deep
    elif where == "extra.storage_url":
        config["kv_connector_extra_config"]["storage_url"] = deep
    else:
        child = copy.deepcopy(config)
        if where == "child.extra":
            child["kv_connector_extra_config"]["y"] = deep
        else:
            child["kv_connector"] = deep
        config = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [child]},
        }
    with pytest.raises(ConfigError) as raised:
        KVTransferConfig.from_dict(config)
    [problem] = raised.value.problems
    assert problem.path.startswith(expected), problem
    assert "nested deeper than 64 levels" in problem.message


def test_a_value_that_contains_itself_is_a_config_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": loop})


@pytest.mark.parametrize(
    "url", ["dir://x", "reference://x", "simplecache::dir://x", "blockcache::reference://x"]
)
@pytest.mark.parametrize("key", ["storage_url", "disk_url"])
def test_check_maps_every_failure_to_open_a_url_to_exit_2_naming_the_key(
    capsys: pytest.CaptureFixture[str], key: str, url: str
) -> None:
    if key == "storage_url":
        config = {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"storage_url": url},
        }
    else:
        config = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": 1 << 20,
                "disk_url": url,
                "disk_bytes_to_use": 1 << 20,
            },
        }
    code, err = check(capsys, config)
    assert code == 2, err
    assert f"kv_connector_extra_config.{key}: cannot open {url!r}" in err, err


def test_a_multiconnector_child_naming_no_connector_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "NixlConnector"}, {"kv_role": "kv_both"}]
        },
    }
    code = main(["validate", "--kv-transfer-config", json.dumps(config)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert (
        "kv_connector_extra_config.connectors[1].kv_connector: a child connector needs "
        "kv_connector" in err
    ), err


BASES: list[dict[str, Any]] = [
    {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage_url": "memory://kv", "timeout_s": 5},
    },
    {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 1 << 20,
            "disk_url": "memory://disk",
            "disk_bytes_to_use": 1 << 20,
        },
    },
    {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": 0},
    },
    {
        "kv_connector": "P2pNcclConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"send_type": "PUT_ASYNC"},
    },
    {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector"},
                {
                    "kv_connector": "SharedStorageConnector",
                    "kv_connector_extra_config": {"storage_url": "memory://m"},
                },
            ]
        },
    },
]
KEYS = [
    "kv_connector",
    "kv_role",
    "engine_id",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "kv_load_failure_policy",
    "storage_url",
    "disk_url",
    "shared_storage_path",
    "side_channel_port",
    "side_channel_host",
    "shared_secret",
    "connectors",
    "timeout_s",
    "send_type",
    "cpu_bytes_to_use",
    "\ud800",
    "",
]
URLS = [
    "dir://x",
    "reference://x",
    "zip://x",
    "tar://x",
    "simplecache::dir://x",
    "blockcache::reference://x",
    "memory://",
    "file://",
    "file:///",
    "ftp://256.0.0.1",
    "redis://127.0.0.1:0/0",
    "redis://:x@/99999",
    "s3://",
    "abc::def",
    "file://\x00x",
    "file://\ud800",
    "local://" + "x" * 300,
]


def hostile_value(rng: random.Random, workdir: Path) -> Any:
    choice = rng.randrange(14)
    if choice == 0:
        return nested(rng.choice([65, 999, 5000]), rng.choice(["list", "dict"]))
    if choice == 1:
        return rng.choice(URLS)
    if choice == 2:
        return f"file://{workdir}/{rng.randrange(4)}"
    if choice == 3:
        return rng.choice([1e308, -1e308, 2**64, -1, 0, 2**31, 1.5, True, None])
    if choice == 4:
        return "".join(chr(rng.randrange(0x10FFFF)) for _ in range(rng.randrange(8)))
    if choice == 5:
        return rng.choice(["NixlConnector", "MultiConnector", "os", "kvx", "", "x" * 1000])
    if choice == 6:
        return {"env": rng.choice(["HOME", "KVX_NO_SUCH_VAR", ""])}
    if choice == 7:
        return {"file": rng.choice(["/dev/null", "/nonexistent", str(workdir), "/proc/self/mem"])}
    if choice == 8:
        return [hostile_value(rng, workdir) for _ in range(rng.randrange(3))]
    if choice == 9:
        return {rng.choice(KEYS): hostile_value(rng, workdir) for _ in range(rng.randrange(3))}
    if choice == 10:
        return rng.choice(["kv_both", "kv_producer", "kv_consumer", "recompute", "fail"])
    if choice == 11:
        return [{"kv_role": "kv_both"}]  # a child naming no connector
    if choice == 12:
        return rng.choice(["127.0.0.1", "::1", "256.1.1.1", "localhost", "0.0.0.0"])
    return rng.choice([0, 1, 65535, 65536, -5])


def mutated(rng: random.Random, workdir: Path) -> Any:
    config = copy.deepcopy(rng.choice(BASES))
    for _ in range(rng.randrange(1, 4)):
        target = config
        for _ in range(rng.randrange(3)):
            children = [v for v in target.values() if isinstance(v, dict)]
            children += [c for v in target.values() if isinstance(v, list) for c in v]
            children = [c for c in children if isinstance(c, dict)]
            if not children:
                break
            target = rng.choice(children)
        if rng.random() < 0.2 and target:
            del target[rng.choice(sorted(target))]
        else:
            target[rng.choice(KEYS)] = hostile_value(rng, workdir)
    return config


def test_fuzzed_configs_through_the_api_give_only_config_errors(tmp_path: Path) -> None:
    rng = random.Random(33)
    kinds: dict[str, int] = {}
    for _ in range(API_CONFIGS):
        config = mutated(rng, tmp_path)
        try:
            KVTransferConfig.from_dict(config)
            kinds["valid"] = kinds.get("valid", 0) + 1
        except ConfigError:
            kinds["error"] = kinds.get("error", 0) + 1
    assert kinds.get("valid", 0) > 0 and kinds.get("error", 0) > API_CONFIGS // 2, kinds


def test_fuzzed_configs_through_validate_check_exit_0_or_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative shared_storage_path lands here
    rng = random.Random(3333)
    codes: dict[int, int] = {}
    for _ in range(CHECK_CONFIGS):
        config = mutated(rng, tmp_path)
        try:
            text = json.dumps(config)
        except (ValueError, RecursionError):
            continue  # not JSON text a command line could carry
        code = main(["validate", "--check", "--kv-transfer-config", text])
        err = capsys.readouterr().err
        assert code in (0, 2), f"exit {code} for {text[:300]!r}: {err[-2000:]}"
        assert "Traceback" not in err and "internal error" not in err, err
        codes[code] = codes.get(code, 0) + 1
    assert codes.get(0, 0) > 0 and codes.get(2, 0) > 0, codes
