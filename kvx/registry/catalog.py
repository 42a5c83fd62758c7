"""Catalogs of plugin records: each name owned by one plugin, aliases resolved, no override
unless asked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvx.errors import RegistryError, did_you_mean, quoted_list
from kvx.hooks.specs import (
    CommandSpec,
    ConnectorSpec,
    LayoutSpec,
    StorageBackendSpec,
    TransformSpec,
)
from kvx.registry.loading import install_hint, missing_requirements

S = TypeVar("S", ConnectorSpec, LayoutSpec, TransformSpec, StorageBackendSpec, CommandSpec)


@dataclass(frozen=True)
class Registered(Generic[S]):
    """A spec together with where it came from."""

    spec: S
    plugin: str
    source: str  # "<distribution> <version>" or "<plugin name>" for hand-registered plugins

    @property
    def name(self) -> str:
        return self.spec.name

    def missing(self) -> list[str]:
        """Optional dependencies of this entry that are not installed."""
        return missing_requirements(getattr(self.spec, "requires", ()))

    def install_hint(self) -> str | None:
        missing = self.missing()
        if not missing:
            return None
        return install_hint(getattr(self.spec, "extra", None), missing[0])


class Catalog(Generic[S]):
    """Names and aliases of one kind of plugin record, refusing silent overrides."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: dict[str, Registered[S]] = {}
        self.aliases: dict[str, str] = {}

    def check(self, entry: Registered[S]) -> None:
        """Raise `RegistryError` if `entry` would take a name another plugin owns."""
        for name in (entry.spec.name, *entry.spec.aliases):
            owner = self.aliases.get(name, name if name in self.entries else None)
            if owner is None:
                continue
            current = self.entries[owner]
            if entry.spec.override and name == entry.spec.name:
                continue
            raise RegistryError(
                f"{self.kind} name {name!r} from plugin {entry.plugin!r} ({entry.source}) is "
                f"already registered by plugin {current.plugin!r} ({current.source}); "
                "set override=True in the spec to replace it deliberately"
            )

    def add(self, entry: Registered[S]) -> None:
        self.check(entry)
        self.entries[entry.spec.name] = entry
        for alias in entry.spec.aliases:
            self.aliases[alias] = entry.spec.name

    def get(self, name: str) -> Registered[S]:
        canonical = self.aliases.get(name, name)
        try:
            return self.entries[canonical]
        except KeyError:
            known = sorted([*self.entries, *self.aliases])
            raise RegistryError(
                f"{name!r} is not a registered {self.kind}{did_you_mean(name, known)}; "
                f"known: {quoted_list(known) or 'none'}"
            ) from None


def copy_catalog(catalog: Catalog[Any]) -> Catalog[Any]:
    copy: Catalog[Any] = Catalog(catalog.kind)
    copy.entries = dict(catalog.entries)
    copy.aliases = dict(catalog.aliases)
    return copy
