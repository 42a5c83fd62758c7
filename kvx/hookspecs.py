"""Hook specifications of kvx's plugin system: signatures and docstrings only.

A plugin is any module or object with functions marked `@kvx.hookimpl` and named like the hooks
below. It is found through the `kvx` entry-point group (built-ins too) or registered by hand with
`Registry.register_plugin`. Each hook returns a list of records from `kvx.specs`.
"""

from __future__ import annotations

import pluggy

from kvx.specs import ConnectorSpec, LayoutSpec, StorageBackendSpec, TransformSpec

hookspec = pluggy.HookspecMarker("kvx")


@hookspec
def kvx_connectors() -> list[ConnectorSpec]:
    """Return the connectors this plugin provides."""
    raise NotImplementedError


@hookspec
def kvx_layouts() -> list[LayoutSpec]:
    """Return the KV cache layouts this plugin provides."""
    raise NotImplementedError


@hookspec
def kvx_transforms() -> list[TransformSpec]:
    """Return the block transforms (layout / block-size conversions) this plugin provides."""
    raise NotImplementedError


@hookspec
def kvx_storage_backends() -> list[StorageBackendSpec]:
    """Return the storage backends (by URL scheme) this plugin provides."""
    raise NotImplementedError
