"""`SupportsListing`: the optional ability of a `StorageBackend` to enumerate and delete its
keys (what `kvx store ls` / `info` / `evict` need; a connector never lists a store).

A backend declares it by mixing the class in before `StorageBackend` and overriding both
methods; `supports_listing` tells whether it did. Built in: local files, fsspec (memory://,
object stores) and Redis (SCAN).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredEntry:
    """One stored value: its key, its size in bytes, and when it was last written (Unix
    seconds; None where the store does not keep it, as Redis)."""

    key: str
    size: int
    modified: float | None = None


class SupportsListing:
    """Enumerate and delete keys. Both methods must be overridden."""

    def list_keys(self, prefix: str = "") -> Iterator[StoredEntry]:
        """Every stored value whose key starts with `prefix`, in no particular order."""
        raise NotImplementedError(f"{type(self).__name__} declares listing but cannot list")

    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove `keys` (absent ones are skipped); how many were removed."""
        raise NotImplementedError(f"{type(self).__name__} declares listing but cannot delete")


def supports_listing(backend: Any) -> bool:
    """True if `backend` (a class or an instance) declares `SupportsListing`."""
    cls = backend if isinstance(backend, type) else type(backend)
    return issubclass(cls, SupportsListing)
