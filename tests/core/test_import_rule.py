"""The layering rule (docs/architecture.md), read from every module's imports with `ast`.

- Core (`kvx/`) never imports `kvx.plugins`, `kvx.layouts` or `kvx.conformance`: not at module
  level, not inside a function, not under TYPE_CHECKING, not by a literal `import_module` name.
- Plugins (`plugins/`, `layouts/`) and the example connector use only kvx's public API: the
  names in `__all__` of the public modules below, besides their own package's modules.
- `conformance/` imports no plugin (it finds connectors through the registry, as users do).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"kvx": "kvx", "plugins": "kvx.plugins", "layouts": "kvx.layouts"}
FOLDERS |= {"conformance": "kvx.conformance"}
OUTSIDE_CORE = ("kvx.plugins", "kvx.layouts", "kvx.conformance")
PUBLIC_MODULES = (
    "kvx",
    "kvx.topology",
    "kvx.wire",
    "kvx.discovery",
    "kvx.engine",
    "kvx.layouts",
    "kvx.conformance",
    "kvx.conformance.kit",
)
"""kvx's public API: these modules, each by its `__all__` (documented in docs/architecture.md)."""


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _modules(folder: str) -> Iterator[tuple[Path, str]]:
    """(file, import name) of every module below `folder` (import names for the example)."""
    base = ROOT / folder
    for path in sorted(base.rglob("*.py")):
        if folder == "examples":
            package = path.relative_to(base).parts[1]  # examples/<project>/<package>/...
            parts = [*path.relative_to(base).with_suffix("").parts[1:]]
        else:
            package = FOLDERS[folder]
            parts = [package, *path.relative_to(base).with_suffix("").parts]
        yield path, ".".join(p for p in parts if p != "__init__") or package


def _imports(path: Path, module: str) -> Iterator[tuple[int, str, str | None]]:
    """(line, module, name or None) of every import in `path`, however it is written:
    `import a.b` -> (a.b, None); `from a import b` -> (a, b); relative ones made absolute;
    `importlib.import_module("a.b")` with a literal name -> (a.b, None); `kvx.name` attribute
    reads after `import kvx` -> (kvx, name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    kvx_aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
                if alias.name == "kvx":
                    kvx_aliases.add(alias.asname or "kvx")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *filter(None, [node.module])])
            for alias in node.names:
                yield node.lineno, base, alias.name
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
                yield node.lineno, str(first.value), None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in kvx_aliases
        ):
            yield node.lineno, "kvx", node.attr


@cache
def _public_names(module: str) -> set[str]:
    """The literal `__all__` of `module`, read from its source (nothing is imported)."""
    top = module.split(".")[1] if "." in module else "kvx"
    folder = {v: k for k, v in FOLDERS.items()}.get(f"kvx.{top}", "kvx")
    rest = module.split(".")[2 if folder != "kvx" else 1 :]
    base = ROOT / folder / Path(*rest) if rest else ROOT / folder
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {ast.literal_eval(e) for e in node.value.elts}
    raise AssertionError(f"{module} must declare its public names in __all__")


def _private_use(imported: str, name: str | None, own: str) -> str | None:
    """Why importing `name` from `imported` breaks the public-API rule for a module of package
    `own`, or None when it is allowed."""
    if not _under(imported, "kvx") or _under(imported, own):
        return None
    if imported in PUBLIC_MODULES:
        if name is None or name in _public_names(imported):
            return None
        if f"{imported}.{name}" in PUBLIC_MODULES:  # from kvx import wire
            return None
        return f"{name!r} is not in {imported}.__all__"
    return f"{imported} is not a public module (public: {', '.join(PUBLIC_MODULES)})"


def test_core_never_imports_plugins_layouts_or_conformance() -> None:
    breaches = [
        f"{path.relative_to(ROOT)}:{line}: imports {imported}"
        for path, module in _modules("kvx")
        for line, imported, name in _imports(path, module)
        if any(_under(f"{imported}.{name}" if name else imported, o) for o in OUTSIDE_CORE)
    ]
    assert breaches == []


@pytest.mark.parametrize("folder", ["plugins", "layouts", "examples"])
def test_plugins_and_examples_use_only_the_public_api(folder: str) -> None:
    breaches = []
    for path, module in _modules(folder):
        # a plugin's own package: kvx.plugins.<name>, kvx.layouts, or the example's package
        own = ".".join(module.split(".")[:3]) if folder == "plugins" else module.split(".")[0]
        own = "kvx.layouts" if folder == "layouts" else own
        for line, imported, name in _imports(path, module):
            why = _private_use(imported, name, own)
            if why:
                breaches.append(f"{path.relative_to(ROOT)}:{line}: {why}")
    assert breaches == []


def test_conformance_imports_no_plugin() -> None:
    breaches = [
        f"{path.relative_to(ROOT)}:{line}: imports {imported}"
        for path, module in _modules("conformance")
        for line, imported, name in _imports(path, module)
        if _under(f"{imported}.{name}" if name else imported, "kvx.plugins")
    ]
    assert breaches == []


def test_the_rule_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself: each way of writing an import is found (else the rule is vacuous)."""
    source = tmp_path / "mod.py"
    source.write_text(
        "import kvx\nimport kvx.layouts as L\nfrom kvx.plugins import storage\n"
        "from . import sibling\nfrom ..wire import encode\n"
        "def f():\n    import importlib\n    importlib.import_module('kvx.conformance.runner')\n"
        "    return kvx.get_registry, kvx._private\n",
        encoding="utf-8",
    )
    found = {(imported, name) for _, imported, name in _imports(source, "kvx.plugins.x.mod")}
    assert {
        ("kvx", None),
        ("kvx.layouts", None),
        ("kvx.plugins", "storage"),
        ("kvx.plugins.x", "sibling"),
        ("kvx.plugins.wire", "encode"),
        ("kvx.conformance.runner", None),
        ("kvx", "get_registry"),
        ("kvx", "_private"),
    } <= found
    assert _private_use("kvx", "_private", "kvx.plugins.x") == "'_private' is not in kvx.__all__"
    assert _private_use("kvx.config.transfer", "load_cli_arg", "kvx.plugins.x") is not None
    assert _private_use("kvx.plugins.other", None, "kvx.plugins.x") is not None
    assert _private_use("kvx.plugins.x.y", None, "kvx.plugins.x") is None
    assert _private_use("kvx.wire", "decode", "kvx.plugins.x") is None
