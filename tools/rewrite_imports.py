"""Rewrite old kvx module paths to their wings (issue 30) in a tree: imports, strings, file paths.

`kvx/` was regrouped into sub-packages by reader (`kvx.config` -> `kvx.config.transfer`,
`kvx.specs` -> `kvx.hooks.specs`, ...; the table is `MOVES`). A branch written before the move
still names the old paths; run this on it (after merging, or on its own files):

    python tools/rewrite_imports.py [--check] [PATH ...]   # default: the repository root

It rewrites, in .py/.md/.toml/.txt/.cfg/.ini/.yaml/.yml/.sh files and Makefiles:
- dotted names `kvx.<old>` (imports, `kvx.<old>.attr` reads, monkeypatch strings, docs);
- `from kvx import <old> [as alias]` -> `from kvx.<wing> import <module> as <alias>`;
- file paths `kvx/<old>.py` -> `kvx/<wing>/<module>.py` (docs).
- imports of names a split module no longer holds (`SPLITS`) -> the module that holds them.
It is idempotent (a path already moved is left alone) and prints each file it changed; run
`ruff check --fix` and `ruff format` after it (an import split in two is one line each).
`--check` changes nothing and exits 1 if something would change.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

MOVES: dict[str, str] = {
    # the connector author's contract
    "kvx.contract": "kvx.contract.base",
    "kvx.types": "kvx.contract.types",
    "kvx.rolesplit": "kvx.contract.rolesplit",
    "kvx.handshake": "kvx.contract.handshake",
    "kvx.planning": "kvx.contract.planning",
    "kvx.events": "kvx.contract.events",
    "kvx.stats": "kvx.contract.stats",
    # the storage backend author's
    "kvx.storage": "kvx.storage.backend",
    "kvx.storage_listing": "kvx.storage.listing",
    "kvx.userdirs": "kvx.storage.userdirs",
    # the operator's config (and the schema checks connectors' configs go through)
    "kvx.config": "kvx.config.transfer",
    "kvx.config_yaml": "kvx.config.yaml_files",
    "kvx.schema": "kvx.config.schema",
    "kvx.secrets": "kvx.config.secrets",
    "kvx.dotted": "kvx.config.dotted",
    # what a plugin author writes against
    "kvx.specs": "kvx.hooks.specs",
    "kvx.hookspecs": "kvx.hooks.hookspecs",
    "kvx.hookimpls": "kvx.hooks.hookimpls",
    # the registry maintainer's
    "kvx.registry": "kvx.registry.core",
    "kvx.plugin_catalogs": "kvx.registry.plugin_catalogs",
    "kvx.catalog": "kvx.registry.catalog",
    "kvx.loading": "kvx.registry.loading",
    "kvx.target_check": "kvx.registry.target_check",
    # the CLI operator's
    "kvx.cli": "kvx.cli.commands",
    "kvx.cli_list": "kvx.cli.listing",
    "kvx.completion": "kvx.cli.completion",
    "kvx.demo": "kvx.cli.demo",
    "kvx.checks": "kvx.cli.checks",
}
"""Old module -> new module."""

SPLITS: dict[str, dict[str, str]] = {
    "kvx.contract.base": {
        **dict.fromkeys(
            [
                "CONTRACT_VERSION",
                "KVX_RELEASES_FOR_CONTRACT_MAJOR",
                "Capability",
                "ANY_GEOMETRY",
                "KVConnectorRole",
                "KVConnectorMetadata",
                "KVConnectorWorkerMetadata",
                "KVTransferResults",
                "KVConnectorTransferResults",
                "KVConnectorOutput",
                "CopyBlocksOp",
                "SupportsHMA",
                "supports_hma",
            ],
            "kvx.contract.auxiliary",
        ),
        "KVConnectorHandshakeMetadata": "kvx.contract.handshake",
        "KVCacheEvent": "kvx.contract.events",
        "KVConnectorKVEvents": "kvx.contract.events",
        "KVConnectorStats": "kvx.contract.stats",
    },
}
"""A module split in two: name -> the module it now lives in (names not listed stayed)."""

SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml", ".sh", ".pyi"}
SKIP_DIRS = {".git", ".venv", ".venv-vllm", "build", "dist", "__pycache__", ".mypy_cache"}
SKIP_FILES = {"pyproject.toml"}  # its module paths are entry points and wing packages: by hand
SELF = Path(__file__).resolve()

_NEW = sorted(
    {*MOVES.values(), *(m for names in SPLITS.values() for m in names.values())},
    key=len,
    reverse=True,
)
_DOTTED = re.compile(
    r"(?<![\w.])kvx\.("
    + "|".join(sorted((m[4:] for m in MOVES), key=len, reverse=True))
    + r")(?!\w)"
)
_IMPORTED = re.compile(r"[ \t]+import[ \t]+\(?\s*(\w+)")
_FROM_KVX = re.compile(r"^(\s*)from kvx import (\w+)(?: as (\w+))?[ \t]*$", re.MULTILINE)
_PATH = re.compile(
    r"(?<![\w./])kvx/("
    + "|".join(sorted((m[4:] for m in MOVES), key=len, reverse=True))
    + r")\.py\b"
)


_SUBMODULE = re.compile(r"\.(\w+)")
ROOT = SELF.parents[1]


def _is_module(dotted: str, name: str) -> bool:
    """Whether `dotted.name` is a module of the current tree (a wing's module this table does
    not list, e.g. one added after the move; a native one by its `.pyi`), so `dotted` is a
    wing, not an old module."""
    folder = ROOT.joinpath(*dotted.split("."))
    files = (f"{name}.py", f"{name}.pyi", f"{name}/__init__.py")
    return any((folder / file).is_file() for file in files)


def _dotted(match: re.Match[str]) -> str:
    text = match.string
    for new in _NEW:  # already a new path (a wing named like the module it replaced)
        if text.startswith(new, match.start()):
            end = match.start() + len(new)
            if end == len(text) or not (text[end].isalnum() or text[end] == "_"):
                return match.group(0)
    after = _SUBMODULE.match(text, match.end())  # `kvx.<wing>.<a module of it>`
    if after and _is_module(match.group(0), after.group(1)):
        return match.group(0)
    imported = _IMPORTED.match(text, match.end())  # `from kvx.<wing> import <its module>`
    if imported and (
        f"{match.group(0)}.{imported.group(1)}" in _NEW
        or _is_module(match.group(0), imported.group(1))
    ):
        return match.group(0)
    return MOVES[match.group(0)]


def _from_kvx(match: re.Match[str]) -> str:
    indent, name, alias = match.groups()
    new = MOVES.get(f"kvx.{name}")
    if new is None:
        return match.group(0)
    package, _, module = new.rpartition(".")
    alias = "" if (alias or name) == module else f" as {alias or name}"
    return f"{indent}from {package} import {module}{alias}"


def _path(match: re.Match[str]) -> str:
    return MOVES[f"kvx.{match.group(1)}"].replace(".", "/") + ".py"


_SPLIT_FROM = re.compile(
    r"^(?P<indent>[ \t]*)from (?P<module>"
    + "|".join(re.escape(m) for m in SPLITS)
    + r") import (?:\((?P<many>[^)]*)\)|(?P<one>[^\n(]+))$",
    re.MULTILINE,
)
_SPLIT_ATTR = re.compile(
    r"(?<![\w.])(?P<module>" + "|".join(re.escape(m) for m in SPLITS) + r")\.(?P<name>\w+)"
)


def _split_from(match: re.Match[str]) -> str:
    """`from <split module> import a, b` -> one import per module the names now live in."""
    module, indent = match["module"], match["indent"]
    names = [n.strip() for n in (match["many"] or match["one"]).split(",") if n.strip()]
    by_module: dict[str, list[str]] = {}
    for name in names:
        by_module.setdefault(SPLITS[module].get(name.split(" as ")[0], module), []).append(name)
    if list(by_module) == [module]:
        return match.group(0)
    return "\n".join(
        f"{indent}from {home} import {', '.join(found)}" for home, found in by_module.items()
    )


def _split_attr(match: re.Match[str]) -> str:
    return f"{SPLITS[match['module']].get(match['name'], match['module'])}.{match['name']}"


def rewrite(text: str) -> str:
    """`text` with every old module path replaced by its new one."""
    text = _FROM_KVX.sub(_from_kvx, text)
    text = _DOTTED.sub(_dotted, text)
    text = _PATH.sub(_path, text)
    text = _SPLIT_FROM.sub(_split_from, text)
    return _SPLIT_ATTR.sub(_split_attr, text)


def _files(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for root in paths:
        candidates = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in candidates:
            if SKIP_DIRS & set(path.parts) or path.name in SKIP_FILES or path.resolve() == SELF:
                continue
            if not path.is_file():
                continue
            if path.suffix in SUFFIXES or path.name == "Makefile":
                found.append(path)
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[SELF.parent.parent])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on a change")
    args = parser.parse_args(argv)
    changed = 0
    for path in _files(args.paths):
        try:
            old = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        new = rewrite(old)
        if new != old:
            changed += 1
            print(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
