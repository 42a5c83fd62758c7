"""Check a registered `"module:attribute"` target without running its module, for `kvx list` and
`kvx validate`: nearly every connector module imports torch, which alone takes seconds.

What is checked: the target's form; its declared dependencies are installed; its module is
found; the modules it imports at top level (outside `try` and `if TYPE_CHECKING`) are
installed; the attribute is defined at its top level; for a connector class, it has base
classes and does not declare another contract major. What only an import can show (code that
fails when it runs, a base class that is not `KVConnectorBase_V1`) is left to
`kvx validate --check`, which imports the target. A module without Python source (a C
extension) is imported: that costs nothing.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvx._version import __version__
from kvx.contract.auxiliary import CONTRACT_VERSION, KVX_RELEASES_FOR_CONTRACT_MAJOR
from kvx.errors import MissingDependencyError, RegistryError
from kvx.registry.loading import install_hint, load_target, missing_requirements


def target_problem(
    target: str,
    *,
    what: str,
    requires: Iterable[str] = (),
    extra: str | None = None,
    connector_origin: str | None = None,
) -> str | None:
    """None when `target` looks usable, else what stops it (see `check_target`)."""
    try:
        check_target(
            target, what=what, requires=requires, extra=extra, connector_origin=connector_origin
        )
    except RegistryError as exc:
        return str(exc)
    return None


def check_target(
    target: str,
    *,
    what: str,
    requires: Iterable[str] = (),
    extra: str | None = None,
    connector_origin: str | None = None,
) -> None:
    """Raise what importing `target` would (`MissingDependencyError` for a dependency that is
    not installed, `RegistryError` otherwise, with `load_target`'s and the registry's texts)
    as far as its source shows. `connector_origin`: the target is a connector class, named so
    in messages."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise RegistryError(f"{what}: target {target!r} is not of the form 'package.module:name'")
    missing = missing_requirements(tuple(requires))
    if missing:
        raise MissingDependencyError(
            f"{what} needs {', '.join(repr(m) for m in missing)}, which is not installed: "
            f"{install_hint(extra, missing[0])}"
        )
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise RegistryError(f"{what}: cannot import {module_name!r}: {exc}") from None
    if spec is None:
        raise RegistryError(
            f"{what}: cannot import {module_name!r}: No module named {module_name!r}"
        )
    origin = spec.origin
    if origin is None or not origin.endswith(".py"):  # an extension or namespace: just import
        load_target(target, what=what, requires=requires, extra=extra)
        return
    try:
        tree = ast.parse(Path(origin).read_bytes(), origin)
    except (OSError, SyntaxError, ValueError) as exc:
        raise RegistryError(
            f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    own_root = module_name.split(".")[0]
    for root in _top_level_imports(tree.body):
        if root != own_root and missing_requirements([root]):
            raise MissingDependencyError(
                f"{what} needs {root!r}, which is not installed: {install_hint(extra, root)}"
            )
    names = dict(_top_level_names(tree.body))
    if attr not in names and "__getattr__" not in names and "*" not in names:
        raise RegistryError(f"{what}: {module_name!r} has no attribute {attr!r}")
    node = names.get(attr)
    if connector_origin is not None and isinstance(node, ast.ClassDef):
        problem = _class_problem(node, connector_origin)
        if problem is not None:
            raise RegistryError(problem)


def _class_problem(node: ast.ClassDef, origin: str) -> str | None:
    if not node.bases:
        return f"{origin} is not a subclass of kvx.KVConnectorBase_V1"
    for item in node.body:
        if (
            isinstance(item, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "contract_version" for t in item.targets)
        ) or (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and item.target.id == "contract_version"
            and item.value is not None
        ):
            try:
                declared = ast.literal_eval(item.value)  # type: ignore[arg-type]
            except ValueError:
                return None  # computed: only an import tells
            return contract_problem(declared, origin)
    return None


def _bodies(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run when the module is imported, `if` branches included (not those
    under `if TYPE_CHECKING`), `try` blocks excluded from imports by `_top_level_imports`."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and not _is_type_checking(node.test):
            yield from _bodies(node.body)
            yield from _bodies(node.orelse)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt]) -> Iterator[str]:
    """Root modules the module imports unconditionally (relative imports are its own)."""
    for node in _bodies(body):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def _top_level_names(body: list[ast.stmt]) -> Iterator[tuple[str, ast.stmt]]:
    """(name, defining statement) of every name the module's top level binds."""
    for node in body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        yield name.id, node
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            yield node.target.id, node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                yield (alias.asname or alias.name.split(".")[0]), node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _top_level_names(node.orelse)
        elif isinstance(node, ast.If | ast.Try):
            for part in ("body", "orelse", "finalbody"):
                yield from _top_level_names(getattr(node, part, []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level_names(handler.body)


def schema_problem(target: str, *, what: str) -> str | None:
    """None when `target` imports (schema modules are light) and is a schema type: a msgspec
    Struct, a dataclass or a TypedDict, as `kvx validate` needs; else why not."""
    import msgspec.inspect as mi

    try:
        schema = load_target(target, what=what)
    except RegistryError as exc:
        return str(exc)
    try:
        info = mi.type_info(schema)
    except (TypeError, ValueError) as exc:
        return f"{what}: {target} is not a schema type: {exc}"
    if not isinstance(info, mi.StructType | mi.DataclassType | mi.TypedDictType):
        return f"{what}: {target} is not a msgspec Struct, dataclass or TypedDict"
    return None


def contract_problem(declared: object, origin: str) -> str | None:
    """None when `declared` (a class's `contract_version`) is this contract major, else why not."""
    if (
        not isinstance(declared, tuple)
        or len(declared) != 2
        or not all(isinstance(v, int) for v in declared)
    ):
        return (
            f"{origin}: contract_version must be a (major, minor) tuple of ints, got {declared!r}"
        )
    if declared[0] != CONTRACT_VERSION[0]:
        fits = KVX_RELEASES_FOR_CONTRACT_MAJOR.get(
            declared[0],
            f"a kvx release implementing contract {declared[0]}.x (none is known "
            f"to kvx {__version__})",
        )
        return (
            f"{origin} implements kvx connector contract {declared[0]}.{declared[1]}, but kvx "
            f"{__version__} implements contract {CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]}; "
            f"use {fits} for this connector, or port it to contract {CONTRACT_VERSION[0]}.x"
        )
    return None
