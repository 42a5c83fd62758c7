"""Lazy `"module:attribute"` targets: import on first use, with an install hint on failure."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
from collections.abc import Iterable
from urllib.parse import unquote

from kvx.errors import MissingDependencyError, RegistryError


def install_hint(extra: str | None, missing: str) -> str:
    """The command that installs kvx's `extra` (or, without one, the module `missing`) for the
    way kvx itself was installed: `pip install 'kvx[extra]'` from a package index,
    `pip install -e '/path/to/checkout[extra]'` from a source checkout (kvx is on no index)."""
    if not extra:
        return f"pip install {missing}"
    source = _install_source()
    if source is None:
        return f"pip install 'kvx[{extra}]'"
    directory, editable = source
    return f"pip install {'-e ' if editable else ''}'{directory}[{extra}]'"


@functools.cache
def _install_source() -> tuple[str, bool] | None:
    """The local directory kvx was installed from and whether editably (pip's
    `direct_url.json`, PEP 610); None when it came from a package index or a wheel file."""
    # every kvx distribution visible (a build's kvx.egg-info in the working directory too):
    # the installed one is the one pip recorded
    for dist in importlib.metadata.distributions(name="kvx"):
        try:
            info = json.loads(dist.read_text("direct_url.json") or "null")
        except ValueError:
            continue
        if not isinstance(info, dict) or not isinstance(info.get("dir_info"), dict):
            continue
        url = info.get("url")
        if isinstance(url, str) and url.startswith("file://"):
            return unquote(url.removeprefix("file://")), bool(info["dir_info"].get("editable"))
    return None


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
