"""Finding the class a vLLM KV transfer config names, with messages that say what to change.

vLLM's connector factory imports `kv_connector_module_path` and takes the `kv_connector`
attribute of it; when that fails its messages name neither what exists nor the fix. These
helpers do the same lookup and, on failure, say what was asked for, what exists (with a
did-you-mean) and how to make the module importable in vLLM's processes. They also name the kvx
connectors a config can select by name. No vLLM import here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from types import ModuleType
from typing import Any

from kvx.errors import did_you_mean, quote, quoted_list
from kvx.registry.core import Registry

RUN_IT_DOC = "docs/writing-a-connector.md#7-run-it-inside-vllm"
_MAX_LISTED = 12


def import_fix(missing: str) -> str:
    """How to make top-level module `missing` importable in every vLLM process."""
    return (
        f"install the package that provides {quote(missing)} into the Python vLLM runs "
        f"({sys.executable}): pip install <package>, or pip install -e <its source directory>; "
        f"or put the directory that contains {quote(missing)} on PYTHONPATH where vLLM starts "
        "(its engine and worker processes inherit it)"
    )


def registered_hint(registry: Registry) -> str:
    """How a connector becomes known by name, plus any kvx plugin that failed to load."""
    failed = "".join(
        f"; kvx plugin {quote(p.plugin)} failed to load: {p.message}" for p in registry.problems
    )
    return (
        "a connector package is known by name once installed into the Python vLLM runs "
        f"({sys.executable}) with its `kvx` entry point (`kvx list` shows what kvx finds); "
        'an unpackaged class runs by import path ("kv_connector_module_path": "<module>", '
        f'or kvx_connector "<module>:<Class>"; see {RUN_IT_DOC}){failed}'
    )


def known_names(registry: Registry, prefix: str = "") -> list[str]:
    catalog = registry.catalogs["connector"]
    return sorted(prefix + name for name in [*catalog.entries, *catalog.aliases])


def unknown_connector(name: str, registry: Registry, prefix: str = "") -> str:
    """`name` (with `prefix`, e.g. `kvx.`) is no registered kvx connector: what exists and how
    to make it exist."""
    known = known_names(registry, prefix)
    return (
        f"{quote(name)} is not a registered kvx connector{did_you_mean(name, known)}; known: "
        f"{quoted_list(known) or 'none'}; {registered_hint(registry)}"
    )


def import_module(module_path: str, field: str) -> ModuleType:
    """Import `module_path`; a module that cannot be found raises `ModuleNotFoundError` naming
    `field`, the closest existing module and the install or PYTHONPATH fix."""
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_path
        if not (module_path == missing or module_path.startswith(missing + ".")):
            root = missing.split(".")[0]
            raise ModuleNotFoundError(
                f"{field} {quote(module_path)} imports {quote(missing)}, which is not "
                f"installed: {import_fix(root)}",
                name=missing,
            ) from exc
        raise ModuleNotFoundError(
            f"{field} {quote(module_path)} cannot be imported: {_not_found(missing)}",
            name=missing,
        ) from None


def _not_found(missing: str) -> str:
    parent, _, leaf = missing.rpartition(".")
    if not parent:
        tops = sorted({m.name for m in pkgutil.iter_modules()} | set(sys.builtin_module_names))
        hint = did_you_mean(missing, tops)
        return f"no module named {quote(missing)}{hint}; {import_fix(missing)}"
    package = sys.modules.get(parent)
    paths = getattr(package, "__path__", None)
    if paths is None:
        return f"{quote(parent)} is a module, not a package: it has no {quote(leaf)}"
    siblings = sorted(f"{parent}.{m.name}" for m in pkgutil.iter_modules(paths))
    return (
        f"package {quote(parent)} ({', '.join(paths)}) has no module {quote(leaf)}"
        f"{did_you_mean(missing, siblings)}; its modules: {_listed(siblings)}"
    )


def class_in(module: ModuleType, module_path: str, name: str, field: str) -> Any:
    """`module.<name>`, or an `AttributeError` naming `field`, the connector classes the module
    has and the closest one."""
    try:
        return getattr(module, name)
    except AttributeError:
        pass
    classes = connector_classes(module)
    choices = classes or [n for n in vars(module) if not n.startswith("_")]
    what = "KV connector classes in it" if classes else "it has no KV connector class; names in it"
    raise AttributeError(
        f"{field} {quote(name)}: module {quote(module_path)} has no attribute {quote(name)}"
        f"{did_you_mean(name, choices)}; {what}: {_listed(choices)}"
    )


def connector_classes(module: ModuleType) -> list[str]:
    """Names of `module`'s attributes that are kvx or vLLM connector classes, without the base
    classes the others derive from (vLLM's base is recognised by name: no vLLM import here)."""
    from kvx.contract.base import KVConnectorBase_V1

    found = {}
    for attr, value in vars(module).items():
        if attr.startswith("_") or not inspect.isclass(value):
            continue
        bases = {b.__name__ for b in value.__mro__[1:]}
        if issubclass(value, KVConnectorBase_V1) or "KVConnectorBase" in bases:
            found[attr] = value
    derived_from = {base for cls in found.values() for base in cls.__mro__[1:]}
    return sorted(attr for attr, cls in found.items() if cls not in derived_from)


def is_kvx_connector_class(value: Any) -> bool:
    """A kvx connector class (it needs the adapter to run inside vLLM)."""
    contract = sys.modules.get(
        "kvx.contract.base"
    )  # a kvx class means kvx.contract.base was imported
    return (
        contract is not None
        and inspect.isclass(value)
        and issubclass(value, contract.KVConnectorBase_V1)
    )


def split_target(reference: str) -> tuple[str, str | None]:
    """(class or connector name, module path or None) of `"pkg.module:Class"` or a name."""
    module_path, sep, name = reference.rpartition(":")
    return (name, module_path) if sep else (reference, None)


def _listed(names: list[str]) -> str:
    if not names:
        return "none"
    shown = quoted_list(names[:_MAX_LISTED])
    return shown if len(names) <= _MAX_LISTED else f"{shown}, ... ({len(names)} in all)"
