"""NixlConnector registers like a third-party plugin, lists without importing NIXL, and a
missing NIXL gives the install command, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvx
from kvx import get_registry

PROBE = """
import sys
{hide}
from kvx import EngineContext, KVCacheSpec, KVConnectorRole, KVTransferConfig, create_connector
import kvx
config = KVTransferConfig.from_dict({{"kv_connector": "NixlConnector", "kv_role": "kv_both"}})
names = list(kvx.get_registry().connectors())
assert "NixlConnector" in names, names
assert sys.modules.get("nixl") is None and "kvx.plugins.nixl.connector" not in sys.modules
ctx = EngineContext("e", "m", KVCacheSpec(("l0",), 4, 16, 16))
try:
    create_connector(config, KVConnectorRole.WORKER, ctx).shutdown()
except kvx.MissingDependencyError as exc:
    print("MISSING:", exc)
else:
    print("BUILT")
"""


def probe(hide: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(hide=hide)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


@pytest.mark.timeout(120)
def test_listed_lazily_and_built_with_nixl_installed() -> None:
    assert "BUILT" in probe("")


@pytest.mark.timeout(120)
def test_missing_nixl_names_the_install_command() -> None:
    out = probe("sys.modules['nixl'] = None  # as if NIXL were not installed")
    assert "MISSING:" in out and kvx.install_hint("nixl", "nixl") in out, out


def test_entry_point_is_the_plugin_module() -> None:
    spec = get_registry().connector("NixlConnector").spec
    assert spec.target == "kvx.plugins.nixl.connector:NixlConnector"
    assert spec.extra == "nixl" and spec.requires == ("nixl",)
