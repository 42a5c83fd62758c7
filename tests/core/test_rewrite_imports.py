"""tools/rewrite_imports.py: old kvx module paths to their wings (issue 30), for merges."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("rewrite_imports", ROOT / "tools/rewrite_imports.py")
assert _spec is not None and _spec.loader is not None
rw = importlib.util.module_from_spec(_spec)
sys.modules["rewrite_imports"] = rw
_spec.loader.exec_module(rw)

OLD = """from kvx import schema
from kvx import registry as registry_module
from kvx.contract import (
    Capability,
    KVConnectorBase_V1,
    KVConnectorStats,
)
from kvx.config import KVTransferConfig
import kvx.cli
from kvx.proxy.config import ProxyConfig

monkeypatch.setattr("kvx.registry._default", None)
role = kvx.contract.KVConnectorRole.WORKER
see = "kvx/config_yaml.py and kvx/storage.py, not plugins/storage/config.py"
"""

NEW = """from kvx.config import schema
from kvx.registry import core as registry_module
from kvx.contract.auxiliary import Capability
from kvx.contract.base import KVConnectorBase_V1
from kvx.contract.stats import KVConnectorStats
from kvx.config.transfer import KVTransferConfig
import kvx.cli.commands
from kvx.proxy.config import ProxyConfig

monkeypatch.setattr("kvx.registry.core._default", None)
role = kvx.contract.auxiliary.KVConnectorRole.WORKER
see = "kvx/config/yaml_files.py and kvx/storage/backend.py, not plugins/storage/config.py"
"""


def test_old_paths_become_new_ones_and_a_second_run_changes_nothing() -> None:
    assert rw.rewrite(OLD) == NEW
    assert rw.rewrite(NEW) == NEW


def test_a_wing_module_added_after_the_move_is_left_alone() -> None:
    """`kvx.contract` is both an old module and a wing: a wing's own module the table does not
    list (kvx.contract.groups came after the move) is not read as an old path."""
    text = (
        "from kvx.contract.groups import split_by_group\nx = kvx.contract.integrity.block_digests\n"
    )
    assert rw.rewrite(text) == text


def test_every_new_module_exists() -> None:
    targets = {*rw.MOVES.values(), *(m for names in rw.SPLITS.values() for m in names.values())}
    missing = [m for m in sorted(targets) if importlib.util.find_spec(m) is None]
    assert not missing


def test_the_tree_names_no_old_path() -> None:
    """kvx's own code, tests and docs are already rewritten (a new old path fails here)."""
    paths = [ROOT / d for d in ("kvx", "plugins", "layouts", "conformance", "tests", "docs")]
    here = Path(__file__).resolve()
    stale = [
        str(path.relative_to(ROOT))
        for path in rw._files(paths)
        if path.resolve() != here and rw.rewrite(text := path.read_text("utf-8")) != text
    ]
    assert not stale, f"old kvx module paths in {stale}: run tools/rewrite_imports.py"
