"""The plugin author's wing: what a plugin returns from its hooks and how it marks them.

Modules:

- `specs`: the records (`ConnectorSpec`, `LayoutSpec`, ...) and `KVLayout`
- `hookspecs`: the pluggy hook signatures
- `hookimpls`: `hookimpl`, `provides`, `provides_connector`

Re-exports the public names (`kvx.__all__`) that live here.
"""

from __future__ import annotations

from kvx.hooks.hookimpls import (
    hookimpl,
    provides,
    provides_connector,
)
from kvx.hooks.specs import (
    CommandSpec,
    ConnectorSpec,
    KVLayout,
    LayoutSpec,
    StorageBackendSpec,
    TransformSpec,
)

__all__ = [
    "CommandSpec",
    "ConnectorSpec",
    "KVLayout",
    "LayoutSpec",
    "StorageBackendSpec",
    "TransformSpec",
    "hookimpl",
    "provides",
    "provides_connector",
]
