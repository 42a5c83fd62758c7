"""Hook specifications of kvx's plugin system: signatures and docstrings only.

A plugin is any module or object with functions marked `@kvx.hookimpl` and named like the hooks
below. It is found through the `kvx` entry-point group (built-ins too) or registered by hand with
`Registry.register_plugin`. Each hook takes no argument and returns a list of records from
`kvx.hooks.specs`. Names starting with `kvx_` are reserved for hooks: a plugin with an unmarked
`kvx_*` function, a `kvx_*` name that is no hook (a misspelling), or an implementation whose
arguments the hook does not provide is refused whole.
"""

from __future__ import annotations

import pluggy

from kvx.hooks.specs import (
    CommandSpec,
    ConnectorSpec,
    LayoutSpec,
    StorageBackendSpec,
    TransformSpec,
)

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


@hookspec
def kvx_cli_commands() -> list[CommandSpec]:
    """Return the `kvx` subcommands this plugin provides."""
    raise NotImplementedError
