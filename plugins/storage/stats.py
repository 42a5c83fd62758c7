"""StorageStats: the storage worker's counters, and the thread-safe tally its IO threads add to."""

from __future__ import annotations

import threading
from collections import Counter

from kvx import KVConnectorStats


class StorageStats(KVConnectorStats):
    """Counters summed across workers: `loaded_tokens`, `loaded_bytes`, `load_errors` (engine
    blocks), `saved_blocks`, `saved_bytes`, `save_errors` (failed writes or unsaved steps)."""


class Tally:
    """Counters added to from several threads; `take` drains them."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._failed: list[tuple[tuple[str, ...], str]] = []
        self._lock = threading.Lock()

    def failed(self, block_keys: list[str], reason: str) -> None:
        """Storing these blocks failed (`save_errors` counts the failed writes)."""
        with self._lock:
            self._failed.append((tuple(block_keys), reason))

    def take_failures(self) -> list[tuple[tuple[str, ...], str]]:
        """(block keys, reason) of each failed save since the last call."""
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def add(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def take(self) -> StorageStats | None:
        """The counts since the last call, or None if nothing was counted."""
        with self._lock:
            data, self._counts = dict(self._counts), Counter()
        return StorageStats(data) if data else None
