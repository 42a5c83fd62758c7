"""Plugins in, catalogs out: pluggy's `PluginManager("kvx")`, entry-point discovery, and the
validation that refuses a bad plugin whole before its records reach the catalogs.

Environment: `KVX_DISABLE_PLUGIN_AUTOLOAD=1` skips entry-point discovery;
`KVX_BLOCKED_PLUGINS=a,b` blocks plugins by entry-point name.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from kvx.errors import RegistryError, did_you_mean, quoted_list
from kvx.hooks import hookspecs
from kvx.hooks.specs import (
    CommandSpec,
    ConnectorSpec,
    LayoutSpec,
    StorageBackendSpec,
    TransformSpec,
)
from kvx.registry.catalog import Catalog, Registered, copy_catalog

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvx"
DISABLE_AUTOLOAD_ENV = "KVX_DISABLE_PLUGIN_AUTOLOAD"
BLOCKED_PLUGINS_ENV = "KVX_BLOCKED_PLUGINS"


@dataclass(frozen=True)
class PluginProblem:
    """A plugin that could not be loaded or whose registrations were refused."""

    plugin: str
    message: str


_HOOKS: dict[str, tuple[str, type]] = {
    "connector": ("kvx_connectors", ConnectorSpec),
    "layout": ("kvx_layouts", LayoutSpec),
    "transform": ("kvx_transforms", TransformSpec),
    "storage backend": ("kvx_storage_backends", StorageBackendSpec),
    "command": ("kvx_cli_commands", CommandSpec),
}


class PluginCatalogs:
    """A pluggy `PluginManager("kvx")` plus catalogs of what its plugins provide (by kind:
    connector, layout, transform, storage backend, command); `Registry` looks them up."""

    def __init__(self, *, autoload: bool | None = None, blocked: Iterable[str] = ()) -> None:
        self.pm = pluggy.PluginManager("kvx")
        self.pm.add_hookspecs(hookspecs)
        self.problems: list[PluginProblem] = []
        self._sources: dict[str, str] = {}
        self.catalogs: dict[str, Catalog[Any]] = {kind: Catalog(kind) for kind in _HOOKS}
        env_blocked = os.environ.get(BLOCKED_PLUGINS_ENV, "")
        for name in {*blocked, *(b.strip() for b in env_blocked.split(",") if b.strip())}:
            self.pm.set_blocked(name)
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("1", "true", "yes")
        if autoload:
            self.load_entry_points()

    # -- plugins -----------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Load every plugin of the `kvx` entry-point group; failures are recorded, not raised."""
        seen: set[str] = set()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in seen or self.pm.is_blocked(ep.name) or self.pm.has_plugin(ep.name):
                continue
            seen.add(ep.name)
            dist = ep.dist
            source = f"{dist.name} {dist.version}" if dist is not None else ep.name
            try:
                plugin = ep.load()
                self.register_plugin(plugin, name=ep.name, source=source)
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}"
                logger.debug("kvx plugin %r (%s) was not loaded: %s", ep.name, source, message)
                self.problems.append(PluginProblem(ep.name, message))

    def register_plugin(
        self, plugin: object, name: str | None = None, source: str | None = None
    ) -> str:
        """Register a plugin object or module with pluggy, or refuse it whole.

        As pluggy's own `register` / `check_pending`: hook implementations are found by their
        `@kvx.hookimpl` marker and checked against the hook specs. Refused, with a
        `RegistryError` naming the plugin and the problem: an unmarked `kvx_*` function, a
        `kvx_*` name that is no hook, arguments the hook does not provide, a hook returning
        anything but its list of specs, a name another plugin owns.
        """
        name = name or self.pm.get_canonical_name(plugin)
        if self.pm.is_blocked(name):
            raise RegistryError(f"plugin {name!r} is blocked")
        if self.pm.has_plugin(name):
            raise RegistryError(f"a plugin named {name!r} is already registered")
        _refuse_unmarked_hooks(self.pm, plugin, name)
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()  # marked implementations of hooks that do not exist
            trial = {kind: copy_catalog(cat) for kind, cat in self.catalogs.items()}
            for kind, entry in self._specs_of(name, source or name):
                trial[kind].add(entry)
        except pluggy.PluginValidationError as exc:
            self._forget(name)
            raise RegistryError(_validation_message(self.pm, name, exc)) from None
        except BaseException:
            self._forget(name)
            raise
        self.catalogs = trial
        self._sources[name] = source or name
        return name

    def _forget(self, name: str) -> None:
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)

    def unregister_plugin(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._sources.pop(name, None)
        self.catalogs = {kind: Catalog(kind) for kind in _HOOKS}
        for plugin_name, plugin in self.pm.list_name_plugin():
            if plugin is None:  # blocked
                continue
            for kind, entry in self._specs_of(plugin_name, self._sources[plugin_name]):
                self.catalogs[kind].add(entry)

    def _specs_of(self, name: str, source: str) -> list[tuple[str, Registered[Any]]]:
        """What plugin `name` provides, each hook called through pluggy for it alone."""
        others = [p for n, p in self.pm.list_name_plugin() if n != name and p is not None]
        found: list[tuple[str, Registered[Any]]] = []
        for kind, (hook_name, spec_type) in _HOOKS.items():
            for specs in self.pm.subset_hook_caller(hook_name, remove_plugins=others)():
                if not isinstance(specs, (list, tuple)):
                    raise RegistryError(
                        f"plugin {name!r}: {hook_name}() must return a list of "
                        f"{spec_type.__name__}, got {type(specs).__name__}"
                    )
                for spec in specs:
                    if not isinstance(spec, spec_type):
                        raise RegistryError(
                            f"plugin {name!r}: {hook_name}() returned "
                            f"{spec!r}; expected {spec_type.__name__}"
                        )
                    found.append((kind, Registered(spec, name, source)))
        return found


def _refuse_unmarked_hooks(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Refuse `kvx_*` functions pluggy would skip silently: unmarked hooks and misspellings."""
    hooks = _hook_names(pm)
    for attr in dir(plugin):
        if not attr.startswith("kvx_") or pm.parse_hookimpl_opts(plugin, attr) is not None:
            continue
        if not callable(getattr(plugin, attr, None)):
            continue
        if attr in hooks:
            raise RegistryError(
                f"plugin {name!r}: {attr} is not marked @kvx.hookimpl, so pluggy would never "
                "call it; mark it"
            )
        raise RegistryError(
            f"plugin {name!r}: {attr} is not a kvx hook{did_you_mean(attr, hooks)}; hooks: "
            f"{quoted_list(hooks)} (names starting with kvx_ are reserved for hooks)"
        )


def _hook_names(pm: pluggy.PluginManager) -> list[str]:
    return sorted(name for name, hook in vars(pm.hook).items() if hook.has_spec())


def _validation_message(
    pm: pluggy.PluginManager, name: str, exc: pluggy.PluginValidationError
) -> str:
    """pluggy's refusal of plugin `name`, on one line and with kvx's hook names."""
    text = str(exc)
    if text.startswith("unknown hook"):  # check_pending: a marked kvx_* that is no hook
        hook = text.split("'")[1]
        hooks = _hook_names(pm)
        return (
            f"plugin {name!r}: {hook} is marked @kvx.hookimpl but is not a kvx hook"
            f"{did_you_mean(hook, hooks)}; hooks: {quoted_list(hooks)}"
        )
    details = " ".join(line.strip() for line in text.splitlines()[1:])
    return f"plugin {name!r}: {details or text} (kvx hooks take no arguments)"
