"""StorageStats: the storage worker's counters, and the thread-safe tally its IO threads add to."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from kvx import KVConnectorStats, TransferFigures
from kvx.plugins.storage.blockformat import BlockFormatError, NotStoredError


def failure_kind(exc: BaseException) -> str:
    """The shared failure kind of a failed read: a missing value is a store miss, a torn or
    corrupt one a checksum failure, anything else (the store's IO) a transport failure."""
    if isinstance(exc, NotStoredError):
        return "store_miss"
    if isinstance(exc, BlockFormatError):
        return "checksum"
    return "transport"


class StorageStats(KVConnectorStats):
    """Summed across workers: `loaded_tokens`, `loaded_blocks`, `loaded_bytes` (KV bytes; the
    stored values' headers are not counted), `load_errors`
    (engine blocks), `load_failed_<kind>` (loads cut short, by `failure_kind` of the read),
    `saved_blocks`, `saved_bytes`, `save_errors` (failed writes or unsaved steps); and
    `load_seconds` / `save_seconds`, one entry per step's loads and per write group."""

    def figures(self) -> TransferFigures:
        d = self.data
        failures = {
            kind: int(d.get(f"load_failed_{kind}", 0))
            for kind in ("transport", "checksum", "store_miss")
        }
        failures["transport"] += int(d.get("save_errors", 0))
        return TransferFigures(
            bytes={"saved": int(d.get("saved_bytes", 0)), "loaded": int(d.get("loaded_bytes", 0))},
            blocks={
                "saved": int(d.get("saved_blocks", 0)),
                "loaded": int(d.get("loaded_blocks", 0)),
            },
            seconds={
                "saved": list(d.get("save_seconds", [])),
                "loaded": list(d.get("load_seconds", [])),
            },
            hits={"storage": int(d.get("loaded_tokens", 0))},
            failures=failures,
        )


class Tally:
    """Counters and durations added to from several threads; `take` drains them."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._times: dict[str, list[float]] = {}
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

    def timed(self, key: str, seconds: float) -> None:
        """One more duration under `key` (a list in the stats)."""
        with self._lock:
            self._times.setdefault(key, []).append(seconds)

    def take(self) -> StorageStats | None:
        """The counts since the last call, or None if nothing was counted."""
        with self._lock:
            data: dict[str, Any] = dict(self._counts)
            data.update(self._times)
            self._counts, self._times = Counter(), {}
        return StorageStats(data) if data else None
