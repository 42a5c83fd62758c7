"""The typed schema: LMCache's option names pass through; unknown, misspelt or out-of-range
options are errors that name the key and what is allowed."""

from __future__ import annotations

from typing import Any

import pytest

from kvx import ConfigError, KVTransferConfig
from kvx.plugins.lmcache.config import LMCacheConfig


def _config(extra: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


def _error(extra: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        _config(extra).extra_config_as(LMCacheConfig)
    return str(info.value)


def test_lmcache_options_pass_through() -> None:
    options = _config(
        {"chunk_size": 64, "local_disk": "file:///tmp/kv", "max_local_disk_size": 1.5}
    ).extra_config_as(LMCacheConfig)
    passed = options.lmcache_options()
    assert passed["chunk_size"] == 64
    assert passed["local_disk"] == "/tmp/kv/"
    assert passed["max_local_disk_size"] == 1.5
    assert passed["enable_kv_events"] is True
    from lmcache.v1.config import LMCacheEngineConfig

    built = LMCacheEngineConfig.from_defaults(**passed)  # every name is one LMCache knows
    assert built.chunk_size == 64


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"chunk_sise": 16}, ["chunk_sise", "chunk_size"]),
        ({"remote_url": "fs:///tmp/x"}, ["remote_url", "fs:///tmp/x", "redis://host:port"]),
        ({"remote_url": "redis://127.0.0.1"}, ["remote_url", "lm://host:port"]),
        ({"local_disk": "/tmp/x"}, ["max_local_disk_size"]),
        ({"local_cpu": False}, ["no LMCache backend"]),
        ({"chunk_size": 0}, ["chunk_size", ">= 1"]),
        ({"cache_policy": "LRX"}, ["cache_policy", "LRU"]),
    ],
)
def test_bad_options_name_the_key(extra: dict[str, Any], words: list[str]) -> None:
    message = _error(extra)
    for word in words:
        assert word in message, message
