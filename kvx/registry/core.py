"""The plugin registry: connectors, layouts, transforms, storage backends and subcommands.

Plugins are found through the `kvx` entry-point group (kvx's built-ins are entry points of its own
`pyproject.toml`, exactly like a third party's) or registered by hand
(`kvx.registry.plugin_catalogs` takes them in). Listing never imports an implementation: each
record names a lazy `"module:attribute"` target that is imported on first use, and a missing
optional dependency produces an install hint instead of a traceback.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import replace
from typing import Any

from kvx.config.schema import join_path
from kvx.config.transfer import ExtraConfigTarget, KVTransferConfig, set_default_resolver
from kvx.contract.auxiliary import KVConnectorRole, supports_hma
from kvx.contract.base import KVConnectorBase_V1
from kvx.contract.types import EngineContext, PluginRegistry
from kvx.errors import (
    ConfigError,
    ConfigProblem,
    RegistryError,
    did_you_mean,
    quote,
    quoted_list,
)
from kvx.hooks.specs import (
    CommandSpec,
    ConnectorSpec,
    KVLayout,
    LayoutSpec,
    StorageBackendSpec,
    TransformSpec,
)
from kvx.registry.catalog import Registered
from kvx.registry.loading import load_target
from kvx.registry.plugin_catalogs import PluginCatalogs
from kvx.registry.target_check import check_target, contract_problem, schema_problem, target_problem
from kvx.storage.backend import StorageBackend, StorageBackendOptions, open_backend

logger = logging.getLogger(__name__)


class Registry(PluginCatalogs):
    """The plugins' catalogs (see `PluginCatalogs`), looked up by name, and connectors built
    from them."""

    # -- lookups -------------------------------------------------------------------------------

    def connectors(self) -> dict[str, Registered[ConnectorSpec]]:
        return dict(self.catalogs["connector"].entries)

    def layouts(self) -> dict[str, Registered[LayoutSpec]]:
        return dict(self.catalogs["layout"].entries)

    def transforms(self) -> dict[str, Registered[TransformSpec]]:
        return dict(self.catalogs["transform"].entries)

    def storage_backends(self) -> dict[str, Registered[StorageBackendSpec]]:
        return dict(self.catalogs["storage backend"].entries)

    def connector(self, name: str) -> Registered[ConnectorSpec]:
        try:
            return self.catalogs["connector"].get(name)
        except RegistryError as exc:
            raise RegistryError(f"{exc}{self._problem_note()}") from None

    def _problem_note(self) -> str:
        if not self.problems:
            return ""
        failed = "; ".join(f"{p.plugin}: {p.message}" for p in self.problems)
        return f" (plugins that failed to load: {failed})"

    def layout(self, name: str) -> Registered[LayoutSpec]:
        return self.catalogs["layout"].get(name)

    def transform(self, name: str) -> Registered[TransformSpec]:
        return self.catalogs["transform"].get(name)

    def storage_backend(self, name: str) -> Registered[StorageBackendSpec]:
        return self.catalogs["storage backend"].get(name)

    def storage_backend_for_url(self, url: str) -> Registered[StorageBackendSpec]:
        """The backend registered for the scheme of `url` (`file://...` -> `file`); a chained
        URL's (fsspec's `simplecache::s3://...`) is its first protocol's."""
        first = url.split("::", 1)[0]
        scheme = first.split("://", 1)[0] if "://" in url else "file"
        entries = list(self.catalogs["storage backend"].entries.values())
        for entry in entries:
            if scheme in entry.spec.schemes:
                return entry
        fallbacks = [e for e in entries if e.spec.other_schemes is not None]
        for entry in fallbacks:
            check = load_target(
                str(entry.spec.other_schemes), what=f"storage backend {entry.name!r}'s schemes"
            )
            if callable(check) and check(scheme):
                return entry
        known = sorted(s for e in entries for s in e.spec.schemes)
        also = "".join(f" (and those {e.name!r} knows)" for e in fallbacks)
        raise RegistryError(
            f"no storage backend for URL scheme {scheme!r} (from {url!r})"
            f"{did_you_mean(scheme, known)}; known schemes: "
            f"{quoted_list(known) or 'none'}{also}"
        )

    def commands(self) -> dict[str, Registered[CommandSpec]]:
        return dict(self.catalogs["command"].entries)

    def import_problem(self, kind: str, name: str) -> str | None:
        """None if the target of `kind` `name` looks usable, else what stops it; checked
        without running its module (kvx.registry.target_check): for `kvx list` and `kvx validate`. A
        connector's config schema, a light module, is imported and must be a schema type."""
        entry = self.catalogs[kind].get(name)
        what = f"{kind} {entry.name!r}"
        problem = target_problem(
            entry.spec.target,
            what=what,
            requires=getattr(entry.spec, "requires", ()),
            extra=getattr(entry.spec, "extra", None),
            connector_origin=f"{what} ({entry.spec.target})" if kind == "connector" else None,
        )
        config_schema = getattr(entry.spec, "config_schema", None)
        if problem is None and config_schema:
            problem = schema_problem(config_schema, what=f"config schema of {what}")
        return problem

    def get_layout(self, name: str) -> KVLayout:
        """The layout registered as `name` (or an alias) through the `kvx_layouts` hook: kvx's
        one layout lookup (`kvx.get_layout` and `kvx.layouts.get_layout` come here)."""
        entry = self.layout(name)
        layout = load_target(entry.spec.target, what=f"layout {entry.name!r}")
        if not isinstance(layout, KVLayout):
            raise RegistryError(
                f"layout {name!r} resolves to {type(layout).__name__}, which is not a layout "
                "(no name, shape, memory, blocks_dim and sizes_of)"
            )
        return layout

    def load_transform(self, name: str) -> Any:
        entry = self.transform(name)
        return load_target(entry.spec.target, what=f"transform {entry.name!r}")

    def load_storage_backend(self, name: str) -> Any:
        entry = self.storage_backend(name)
        return load_target(
            entry.spec.target,
            what=f"storage backend {entry.name!r}",
            requires=entry.spec.requires,
            extra=entry.spec.extra,
        )

    # -- connectors ---------------------------------------------------------------------------

    def check_connector_class(self, name: str) -> None:
        """Raise what `load_connector_class` would, as far as the class's source shows, without
        importing it (kvx.registry.target_check): for `kvx validate` without `--check`."""
        entry = self.connector(name)
        what = f"connector {entry.name!r}"
        check_target(
            entry.spec.target,
            what=what,
            requires=entry.spec.requires,
            extra=entry.spec.extra,
            connector_origin=f"{what} ({entry.spec.target})",
        )

    def load_connector_class(self, name: str) -> type[KVConnectorBase_V1]:
        """Import a registered connector's class (lazily) and check its contract version."""
        entry = self.connector(name)
        cls = load_target(
            entry.spec.target,
            what=f"connector {entry.name!r}",
            requires=entry.spec.requires,
            extra=entry.spec.extra,
        )
        return check_connector_class(cls, f"connector {entry.name!r} ({entry.spec.target})")

    def resolve_connector_class(self, config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        """The class a config selects: `kv_connector_module_path` wins over the registry
        (matches vLLM's factory resolution order)."""
        if config.kv_connector is None:
            raise RegistryError("kv_connector is not set in the KV transfer config")
        if config.kv_connector_module_path == "":
            raise RegistryError("kv_connector_module_path cannot be an empty string")
        if config.kv_connector_module_path:
            return load_module_path_class(config.kv_connector_module_path, config.kv_connector)
        return self.load_connector_class(config.kv_connector)

    def extra_config_target(
        self, connector: str, module_path: str | None, config_path: str = ""
    ) -> ExtraConfigTarget:
        """How to validate the extra config of `connector`; raise ConfigError if unknown.
        `config_path` locates the config being checked (for nested MultiConnector children)."""
        path = join_path(config_path, "kv_connector")
        if module_path:
            try:
                cls = load_module_path_class(module_path, connector)
            except RegistryError as exc:
                raise ConfigError(
                    [ConfigProblem(join_path(config_path, "kv_connector_module_path"), str(exc))]
                ) from None
            schema = getattr(cls, "extra_config_schema", None)
            if schema is None:  # a registered connector's class, loaded by its module path
                registered = self._registered_as(cls)
                if registered is not None:
                    return self.extra_config_target(registered, None, config_path)
            return ExtraConfigTarget(
                connector, schema, getattr(cls, "child_configs_key", None), schema is None
            )
        try:
            entry = self.connector(connector)
        except RegistryError:
            known = sorted(
                [*self.catalogs["connector"].entries, *self.catalogs["connector"].aliases]
            )
            raise ConfigError(
                [
                    ConfigProblem(
                        path,
                        f"{quote(connector)} is not a registered connector"
                        f"{did_you_mean(connector, known)}; known: {quoted_list(known) or 'none'} "
                        "(or set kv_connector_module_path to load an external class)",
                    )
                ]
            ) from None
        schema = None
        if entry.spec.config_schema:
            try:
                schema = load_target(
                    entry.spec.config_schema, what=f"config schema of connector {entry.name!r}"
                )
            except RegistryError as exc:
                raise ConfigError([ConfigProblem(path, str(exc))]) from None
        return ExtraConfigTarget(entry.name, schema, entry.spec.child_configs_key)

    def _registered_as(self, cls: type) -> str | None:
        """The registered name of connector class `cls`, if any (only targets naming a class
        of the same name are imported)."""
        for name, entry in self.catalogs["connector"].entries.items():
            if entry.spec.target.rpartition(":")[2] != cls.__name__:
                continue
            try:
                if load_target(entry.spec.target, what=f"connector {name!r}") is cls:
                    return name
            except RegistryError:
                continue
        return None

    def supports_hma_config(self, config: KVTransferConfig) -> bool:
        """True if the config's connector (and, for composites, every child) supports HMA."""
        cls = self.resolve_connector_class(config)
        if not supports_hma(cls):
            return False
        key = None
        if not config.kv_connector_module_path and config.kv_connector:
            key = self.connector(config.kv_connector).spec.child_configs_key
        if key is None:
            return True
        children = config.kv_connector_extra_config.get(key) or []
        return bool(children) and all(
            self.supports_hma_config(KVTransferConfig.from_dict(c, registry=self)) for c in children
        )


def load_module_path_class(module_path: str, class_name: str) -> type[KVConnectorBase_V1]:
    """Import `class_name` from `module_path` (vLLM's `kv_connector_module_path`) and check it
    is a connector class of this contract taking `(config, role, ctx)`."""
    cls = load_target(f"{module_path}:{class_name}", what=f"connector {class_name!r}")
    cls = check_connector_class(cls, f"{module_path}.{class_name}")
    try:
        inspect.signature(cls).bind(None, None, None)
    except TypeError:
        raise RegistryError(
            f"{module_path}.{class_name} must accept (config, role, ctx); its constructor "
            f"{inspect.signature(cls)} does not (the 2-argument form is not supported)"
        ) from None
    return cls


def check_connector_class(cls: Any, origin: str) -> type[KVConnectorBase_V1]:
    """Refuse anything that is not a `KVConnectorBase_V1` of this contract major."""
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise RegistryError(f"{origin} is not a subclass of kvx.KVConnectorBase_V1")
    problem = contract_problem(getattr(cls, "contract_version", None), origin)
    if problem is not None:
        raise RegistryError(problem)
    return cls


def create_connector(
    config: KVTransferConfig,
    role: KVConnectorRole,
    ctx: EngineContext,
    *,
    registry: Registry | None = None,
) -> KVConnectorBase_V1:
    """Validate `config`, resolve its connector class and build it for `role`.

    Matches vLLM's `KVConnectorFactory.create_connector`, including the refusal of connectors
    without `SupportsHMA` when the engine runs the hybrid memory allocator. The registry is
    `registry`, else the one `ctx` carries, else the process-wide one; the connector gets it in
    its `ctx.registry`, so what it builds (a composite's children, a storage backend, layouts)
    comes from the same registry.
    """
    found: Registry
    if registry is not None:
        found = registry
    elif isinstance(ctx.registry, Registry):
        found = ctx.registry
    else:
        found = get_registry()
    if ctx.registry is not found:
        ctx = replace(ctx, registry=found)
    if not isinstance(config, KVTransferConfig):
        raise TypeError(f"config must be a KVTransferConfig, got {type(config).__name__}")
    if not isinstance(role, KVConnectorRole):
        raise TypeError(f"role must be a KVConnectorRole, got {role!r}")
    if config.kv_connector is None:
        raise RegistryError("kv_connector is not set in the KV transfer config")
    KVTransferConfig.from_dict(config.to_dict(), registry=found)
    cls = found.resolve_connector_class(config)
    if ctx.enable_hma and not found.supports_hma_config(config):
        raise RegistryError(
            f"connector {config.kv_connector!r} does not support HMA but HMA is enabled; "
            "disable the hybrid memory allocator (vLLM: --disable-hybrid-kv-cache-manager)"
        )
    logger.info(
        "creating KV connector %s (%s) for engine %s",
        config.kv_connector,
        role.name,
        config.engine_id,
    )
    return cls(config, role, ctx)


_default: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built (and plugins discovered) on first use."""
    global _default
    if _default is None:
        _default = Registry()
    return _default


set_default_resolver(lambda: get_registry())  # the getter is looked up when called


def get_layout(name: str, registry: PluginRegistry | None = None) -> KVLayout:
    """The layout registered as `name` (or an alias) in `registry` (default: the process-wide
    one; `kvx list` shows them): `Registry.get_layout`."""
    return (registry or get_registry()).get_layout(name)


def open_storage_backend(
    url: str, options: StorageBackendOptions, registry: PluginRegistry | None = None
) -> StorageBackend:
    """The backend registered for `url`'s scheme in `registry` (default: the process-wide one;
    a connector passes its `ctx.registry`), opened on `url`."""
    return open_backend(url, options, registry or get_registry())


def reset_registry() -> None:
    """Forget the process-wide registry so the next `get_registry()` rediscovers plugins."""
    global _default
    _default = None
