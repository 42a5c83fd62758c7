"""What a plugin marks its hook implementations with, and `provides`, which writes the usual one.

Most plugins only list records: their hook implementations are a marked function returning a
constant list. `provides` builds that function from the records, so a plugin module reads as
its table:

    kvx_connectors = kvx.provides(kvx.ConnectorSpec(name="MyConnector", target="pkg.mod:Cls"))

A connector folder laid out as kvx's are (`connector.py`, `config.py`) needs only its names:

    kvx_connectors = kvx.provides_connector(__package__, "MyConnector", "MyConfig", needs="mylib")

It is exactly the hand-written `@kvx.hookimpl def kvx_connectors(): return [...]`: the module
attribute's name picks the hook, and the registry checks it like any other implementation (a
misspelt name, or records of the wrong kind for the hook, refuse the plugin, naming both).
Records name lazy targets, so nothing the records point at is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pluggy

from kvx.hooks.specs import (
    CommandSpec,
    ConnectorSpec,
    LayoutSpec,
    StorageBackendSpec,
    TransformSpec,
)

hookimpl = pluggy.HookimplMarker("kvx")
"""Marks a plugin's implementation of a `kvx_*` hook (see `kvx.hooks.hookspecs`)."""

S = TypeVar("S", ConnectorSpec, LayoutSpec, TransformSpec, StorageBackendSpec, CommandSpec)


def provides(*specs: S) -> Callable[[], list[S]]:
    """A hook implementation (marked `@kvx.hookimpl`) that returns `specs`, in order."""
    records = list(specs)

    def hook() -> list[S]:
        return list(records)

    return hookimpl(hook)


def provides_connector(
    package: str | None, name: str, config: str | None = None, **fields: Any
) -> Callable[[], list[ConnectorSpec]]:
    """`provides(ConnectorSpec.in_package(package, name, config, **fields))`: the whole
    `kvx_connectors` hook of a connector folder laid out as kvx's are."""
    return provides(ConnectorSpec.in_package(package, name, config, **fields))
