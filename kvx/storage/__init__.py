"""The storage backend author's wing: the key -> bytes store API and its optional abilities.

Modules:

- `backend`: `StorageBackend`, `SupportsHashedIO`, `open_backend`
- `listing`: `SupportsListing` (for `kvx store`)
- `userdirs`: where kvx keeps a user's files; private directories

Re-exports the public names (`kvx.__all__`) that live here.
"""

from __future__ import annotations

from kvx.storage.backend import (
    StorageBackend,
    StorageBackendOptions,
    StorageRegionTable,
    SupportsHashedIO,
    copy_into,
    supports_hashed_io,
)
from kvx.storage.listing import (
    StoredEntry,
    SupportsListing,
    supports_listing,
)
from kvx.storage.userdirs import (
    make_private_dirs,
    user_cache_dir,
)

__all__ = [
    "StorageBackend",
    "StorageBackendOptions",
    "StorageRegionTable",
    "StoredEntry",
    "SupportsHashedIO",
    "SupportsListing",
    "copy_into",
    "make_private_dirs",
    "supports_hashed_io",
    "supports_listing",
    "user_cache_dir",
]
