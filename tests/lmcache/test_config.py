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
        ({"remote_url": "redis://a:1,b:2"}, ["remote_url", "redis-cluster://host:port"]),
        ({"remote_url": "redis-cluster://a:1,b:99999"}, ["remote_url", "99999", "1-65535"]),
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


def test_a_redis_cluster_url_names_one_or_more_nodes() -> None:
    for url in ("redis-cluster://127.0.0.1:7000", "redis-cluster://h1:7000,h2:7001,h3:7002"):
        options = _config({"remote_url": url}).extra_config_as(LMCacheConfig)
        assert options.lmcache_options()["remote_url"] == url
        assert options.medium() == "REDIS-CLUSTER"
