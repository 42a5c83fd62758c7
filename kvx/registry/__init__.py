"""The registry maintainer's wing: plugins in, catalogs out, targets loaded lazily.

Modules:

- `core`: `Registry`, `create_connector`, `get_layout`, `open_storage_backend`, `get_registry`
- `plugin_catalogs`: pluggy's plugin manager, entry-point discovery, validation
- `catalog`: per-kind catalogs refusing silent overrides
- `loading`: lazy `"module:attr"` targets with install hints
- `target_check`: a target checked from its source without importing it

Re-exports the public names (`kvx.__all__`) that live here.
"""

from __future__ import annotations

from kvx.registry.core import (
    Registry,
    create_connector,
    get_layout,
    get_registry,
    open_storage_backend,
)
from kvx.registry.loading import (
    install_hint,
)

__all__ = [
    "Registry",
    "create_connector",
    "get_layout",
    "get_registry",
    "install_hint",
    "open_storage_backend",
]
