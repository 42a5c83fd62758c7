"""Lazy `"module:attribute"` targets: import on first use, with an install hint on failure."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable

from kvx.errors import MissingDependencyError, RegistryError


def install_hint(extra: str | None, missing: str) -> str:
    if extra:
        return f"pip install 'kvx[{extra}]'"
    return f"pip install {missing}"


def missing_requirements(requires: Iterable[str]) -> list[str]:
    """Top-level modules of `requires` that cannot be found (checked without importing them)."""
    missing = []
    for module in requires:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    return missing


def load_target(
    target: str, *, what: str, requires: Iterable[str] = (), extra: str | None = None
) -> object:
    """Import `"pkg.module:attr"` and return the attribute.

    A missing optional dependency raises `MissingDependencyError` naming the extra to install;
    any other failure raises `RegistryError` naming `what` and the target.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise RegistryError(f"{what}: target {target!r} is not of the form 'package.module:name'")
    requires = tuple(requires)
    missing = missing_requirements(requires)
    if missing:
        raise MissingDependencyError(
            f"{what} needs {', '.join(repr(m) for m in missing)}, which is not installed: "
            f"{install_hint(extra, missing[0])}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root and root != module_name.split(".")[0]:
            raise MissingDependencyError(
                f"{what} needs {root!r}, which is not installed: {install_hint(extra, root)}"
            ) from exc
        raise RegistryError(f"{what}: cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:
        raise RegistryError(
            f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RegistryError(f"{what}: {module_name!r} has no attribute {attr!r}") from None
