"""Shared fixtures: a real third-party plugin package installed for the test session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvx.registry import core as registry_module
from kvx.registry.core import Registry

# Tools the Makefile installs into the venv (redis-server from PyPI where Debian's package cannot
# be had) are found like system ones, by this process and its children.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

TESTS_DIR = Path(__file__).resolve().parent
# Helper modules shared across test folders (kvx_test_services). Only that folder goes on
# sys.path: the test folders themselves are named like the packages they test (lmcache, vllm).
sys.path.insert(0, str(TESTS_DIR / "helpers"))
PLUGIN_SOURCE = TESTS_DIR / "plugin_pkg"
TEST_PLUGIN_MODULE = "kvx_test_plugin"


@pytest.fixture(scope="session")
def test_plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Install `tests/plugin_pkg` with pip into a fresh directory (real dist-info, real entry
    points) and return that directory; put it on sys.path / PYTHONPATH to make it visible."""
    build = tmp_path_factory.mktemp("plugin-build") / "src"
    shutil.copytree(PLUGIN_SOURCE, build)
    site = tmp_path_factory.mktemp("plugin-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(build),
        ],
        check=True,
        timeout=180,
        capture_output=True,
    )
    assert (site / TEST_PLUGIN_MODULE / "plugin.py").exists()
    return site


def _forget_test_plugin_modules() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == TEST_PLUGIN_MODULE]:
        del sys.modules[name]


@pytest.fixture
def plugin_env(test_plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test plugin visible to this process and to child processes."""
    monkeypatch.syspath_prepend(str(test_plugin_site))
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(test_plugin_site), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    monkeypatch.delenv("KVX_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("KVX_BLOCKED_PLUGINS", raising=False)
    _forget_test_plugin_modules()
    registry_module.reset_registry()
    yield test_plugin_site
    _forget_test_plugin_modules()
    registry_module.reset_registry()


@pytest.fixture
def plugin_registry(plugin_env: Path) -> Registry:
    """A registry that discovered the installed test plugin through its entry points."""
    registry = registry_module.get_registry()
    assert "EchoConnector" in registry.connectors(), registry.problems
    return registry
