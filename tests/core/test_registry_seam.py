"""The registry seam (issue 30): everything built under a custom `Registry` comes from it.

A fresh `Registry` that holds only the plugins this test registers builds every built-in
connector (MultiConnector with its children included) in every role, through the reference
engine (which also finds its cache layout there) and through `create_connector`, while the
process-wide registry is never created: its getter raises, and its slot stays empty.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvx
import kvx.registry.core
from kvx import EngineContext, KVCacheSpec, KVConnectorRole, KVTransferConfig, Registry
from kvx.engine import Engine, EngineConfig

BUILT_IN_PLUGINS = ("layouts", "storage", "multi", "offload", "nixl", "p2p", "lmcache")


@pytest.fixture
def fresh() -> Registry:
    """A registry holding only kvx's built-in plugin modules, registered here by hand."""
    registry = Registry(autoload=False)
    for name in BUILT_IN_PLUGINS:
        package = "kvx.layouts" if name == "layouts" else f"kvx.plugins.{name}"
        registry.register_plugin(importlib.import_module(f"{package}._plugin"), name=f"t-{name}")
    return registry


@pytest.fixture
def no_global(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process-wide registry may not be created or asked while the test runs."""

    def refuse() -> Registry:
        raise AssertionError("the process-wide registry was asked for")

    monkeypatch.setattr(kvx.registry.core, "_default", None)
    monkeypatch.setattr(kvx.registry.core, "get_registry", refuse)
    monkeypatch.setattr(kvx, "get_registry", refuse)
    yield
    assert kvx.registry.core._default is None, "the process-wide registry was created"


def _configs(tmp_path: Path) -> dict[str, dict[str, Any]]:
    storage = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": f"file://{tmp_path}/store"},
    }
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22},
    }
    return {
        "SharedStorageConnector": storage,
        "OffloadingConnector": offload,
        "NixlConnector": {
            "kv_connector": "NixlConnector",
            "kv_connector_extra_config": {"handshake_timeout_s": 2, "transfer_timeout_s": 5},
        },
        "P2pNcclConnector": {
            "kv_connector": "P2pNcclConnector",
            "kv_port": 0,  # GET: every P worker listens on an ephemeral port
            "kv_connector_extra_config": {"send_type": "GET", "transfer_timeout_s": 5},
        },
        "LMCacheConnectorV1": {
            "kv_connector": "LMCacheConnectorV1",
            "kv_connector_extra_config": {"chunk_size": 16, "max_local_cpu_size": 0.05},
        },
        "MultiConnector": {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [offload, storage]},
        },
    }


def _registries(connector: kvx.KVConnectorBase_V1) -> Iterator[object]:
    """The registry of `connector` and of each MultiConnector child, recursively."""
    yield connector._ctx.registry
    for child in getattr(connector, "children", ()):
        yield from _registries(child)


# LMCache is installed only in .venv-vllm: `make pytest-lmcache` runs its case there.
CONNECTORS = [
    name
    for name in sorted(_configs(Path("/")))
    if name != "LMCacheConnectorV1" or importlib.util.find_spec("lmcache") is not None
]


@pytest.mark.timeout(600)  # LMCache's start alone takes minutes on a loaded machine
@pytest.mark.parametrize("name", CONNECTORS)
def test_engine_builds_every_connector_from_its_registry_only(
    name: str, fresh: Registry, no_global: None, tmp_path: Path
) -> None:
    config = KVTransferConfig.from_dict(
        {**_configs(tmp_path)[name], "kv_role": "kv_both"}, registry=fresh
    )
    engine = Engine(EngineConfig(kv_transfer_config=config, num_blocks=16), registry=fresh)
    try:
        built = [engine.scheduler_connector, *(w.connector for w in engine.workers)]
        assert all(c is not None for c in built)
        assert {id(r) for c in built if c for r in _registries(c)} == {id(fresh)}
        if name == "MultiConnector":
            assert engine.scheduler_connector is not None
            assert len(getattr(engine.scheduler_connector, "children", ())) == 2
        engine.add_request("r", list(range(1, 40)), max_tokens=2)  # saves go through it
        finished = []
        for _ in range(50):
            finished += [o for o in engine.step() if o.finished]
            if not engine.has_pending_work():
                break
        assert [o.request_id for o in finished] == ["r"]
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", list(KVConnectorRole))
def test_create_connector_builds_multi_children_from_the_given_registry(
    role: KVConnectorRole, fresh: Registry, no_global: None, tmp_path: Path
) -> None:
    config = KVTransferConfig.from_dict(
        {**_configs(tmp_path)["MultiConnector"], "kv_role": "kv_both"}, registry=fresh
    )
    spec = KVCacheSpec(("layer.0",), 2, 8, 16, "float32", "HND", False, 16)
    ctx = EngineContext(engine_id="e", model_name="m", cache=spec)
    connector = kvx.create_connector(config, role, ctx, registry=fresh)
    try:
        assert [type(c).__name__ for c in getattr(connector, "children", ())] == [
            "OffloadingConnector",
            "SharedStorageConnector",
        ]
        assert {id(r) for r in _registries(connector)} == {id(fresh)}
    finally:
        connector.shutdown()


def test_a_connector_missing_from_the_registry_is_not_found_elsewhere(
    no_global: None, tmp_path: Path
) -> None:
    """The seam has teeth: a registry without the storage plugin cannot build Multi's storage
    child, although the process-wide registry would have it."""
    registry = Registry(autoload=False)
    for module in ("kvx.layouts._plugin", "kvx.plugins.multi._plugin"):
        registry.register_plugin(importlib.import_module(module))
    registry.register_plugin(importlib.import_module("kvx.plugins.offload._plugin"))
    with pytest.raises(kvx.ConfigError, match='"SharedStorageConnector" is not a registered'):
        KVTransferConfig.from_dict(
            {**_configs(tmp_path)["MultiConnector"], "kv_role": "kv_both"}, registry=registry
        )
