"""LMCacheConnectorV1's stats: counters and seconds that add up across workers and steps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvx import KVConnectorStats


class LMCacheStats(KVConnectorStats):
    """`data`: per kind (`store`, `load`, `lookup`), the count, the tokens moved and the
    seconds spent; plus `load_errors` (requests whose load came back short)."""

    def count(self, key: str, amount: float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + amount

    @contextmanager
    def timed(self, kind: str, tokens: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.count(f"{kind}s")
            self.count(f"{kind}_tokens", tokens)
            self.count(f"{kind}_seconds", time.perf_counter() - start)
