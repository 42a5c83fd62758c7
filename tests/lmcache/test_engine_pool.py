"""The process's LMCache engines (plugins/lmcache/engine.py): a local-tier engine outlives its
kvx engine for a restart to find, and is destroyed before any other engine is built (each
allocates its whole CPU tier up front)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from lmcache.v1.cache_engine import LMCacheEngineBuilder

from kvx import KVTransferConfig
from kvx.engine.engine import Engine, EngineConfig
from kvx.plugins.lmcache import engine as pool

pytestmark = pytest.mark.timeout(300)

EXTRA = {"chunk_size": 16, "save_unfull_chunk": True, "max_local_cpu_size": 0.05}
PROMPT = list(range(40))


def _config(model: str) -> EngineConfig:
    ktc = KVTransferConfig.from_dict(
        {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": "kv_both",
            "kv_connector_extra_config": EXTRA,
        }
    )
    return EngineConfig(model_name=model, num_blocks=32, kv_transfer_config=ktc)


def _run(config: EngineConfig) -> dict[str, int]:
    """One request on a fresh engine, shut down after; returns its stats."""
    engine = Engine(config)
    try:
        engine.add_request("r", PROMPT, 2)
        while engine.has_pending_work():
            engine.step()
        assert not engine.check_kv()
        return engine.stats()
    finally:
        engine.shutdown()


def _instances(model: str) -> list[str]:
    return [p.instance for k, p in pool._pool.items() if f'"{model}"' in k]


def test_an_idle_engine_serves_a_restart_and_is_freed_before_another_is_built() -> None:
    config = _config("pool-a")
    _run(config)
    (idle,) = _instances("pool-a")
    again = _run(replace(config, engine_id="restarted"))
    assert again["external_tokens"] > 0  # the restarted engine found the idle one's chunks
    assert _instances("pool-a") == [idle]
    _run(_config("pool-b"))
    assert _instances("pool-a") == []
    assert LMCacheEngineBuilder.get(idle) is None
