"""Connector facades only delegate (docs/architecture.md, "Connector shape"): the body of a
`RoleSplitConnector` subclass in a connector folder defines class-level answers and how its
halves are built, never a protocol method. Read from source with `ast`, so the check needs none
of the connectors' optional dependencies (nixl, lmcache)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import FunctionType

import pytest

from kvx import RoleSplitConnector

ROOT = Path(__file__).resolve().parents[2]
FACADE_FILES = sorted(ROOT.glob("plugins/*/connector.py")) + sorted(
    ROOT.glob("examples/*/*/connector.py")
)
CONSTRUCTION = frozenset({"build_scheduler", "build_worker"})
BASE_NAMES = frozenset(dir(RoleSplitConnector))
"""Every attribute of the facade base: contract methods, their delegations and helpers."""
BASE_METHODS = frozenset(
    name
    for name in BASE_NAMES
    if isinstance(
        inspect.getattr_static(RoleSplitConnector, name),
        FunctionType | classmethod | staticmethod | property,
    )
)


def _is_facade(node: ast.ClassDef) -> bool:
    for base in node.bases:
        target = base.value if isinstance(base, ast.Subscript) else base
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "RoleSplitConnector":
            return True
    return False


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {d.id for d in node.decorator_list if isinstance(d, ast.Name)}


def breaches(source: str) -> dict[str, list[str]]:
    """Each facade class in `source` and what its body defines beyond the rule: an instance
    method other than `build_scheduler` / `build_worker` and private helpers the base does not
    have (classmethods and staticmethods are class-level answers, asked before any half
    exists), or a class attribute that replaces a method of the base."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef) or not _is_facade(node):
            continue
        bad = found.setdefault(node.name, [])
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                name = item.name
                if _decorators(item) & {"classmethod", "staticmethod"} or name in CONSTRUCTION:
                    continue
                if name.startswith("_") and name not in BASE_NAMES:
                    continue
                kind = "property" if "property" in _decorators(item) else "method"
                bad.append(f"{kind} {name}")
            elif isinstance(item, ast.Assign | ast.AnnAssign):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                for target in targets:
                    name = getattr(target, "id", "")
                    if name in BASE_METHODS:
                        bad.append(f"attribute {name} (replaces the base's method)")
    return found


@pytest.fixture(scope="module")
def facades() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in FACADE_FILES:
        for name, bad in breaches(path.read_text()).items():
            found[f"{path.relative_to(ROOT)}:{name}"] = bad
    return found


def test_the_nixl_p2p_and_lmcache_facades_are_among_those_checked(
    facades: dict[str, list[str]],
) -> None:
    names = {key.rsplit(":", 1)[1] for key in facades}
    assert {"NixlConnector", "P2pNcclConnector", "LMCacheConnectorV1"} <= names
    assert {"SharedStorageConnector", "OffloadingConnector", "ExamplePDConnector"} <= names


def test_no_facade_overrides_a_half_method(facades: dict[str, list[str]]) -> None:
    assert {key: bad for key, bad in facades.items() if bad} == {}


def test_the_rule_catches_each_kind_of_patch() -> None:
    source = """
class Patched(kvx.RoleSplitConnector[S, W]):
    capabilities = frozenset()
    wait_for_save = print

    def set_xfer_handshake_metadata_pp_aware(self, metadata): ...
    def get_kv_connector_stats(self): ...
    def _metadata(self): ...
    @property
    def options(self): ...
    def extra(self): ...

    def build_worker(self): ...
    def _open(self): ...
    @classmethod
    def fault_wait_s(cls, config): ...

class NotAFacade(kvx.KVConnectorBase_V1):
    def wait_for_save(self): ...
"""
    assert breaches(source) == {
        "Patched": [
            "attribute wait_for_save (replaces the base's method)",
            "method set_xfer_handshake_metadata_pp_aware",
            "method get_kv_connector_stats",
            "method _metadata",
            "property options",
            "method extra",
        ]
    }
