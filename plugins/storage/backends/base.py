"""The backend API as the built-in backends name it: kvx's public `StorageBackend` and its
helpers (third-party backends import them from `kvx` directly)."""

from __future__ import annotations

from kvx import StorageBackend, StorageBackendOptions, StorageRegionTable, copy_into

BackendOptions = StorageBackendOptions
RegionTable = StorageRegionTable

__all__ = ["BackendOptions", "RegionTable", "StorageBackend", "copy_into"]
