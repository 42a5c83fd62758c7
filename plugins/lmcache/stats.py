"""LMCacheConnectorV1's stats: counters and seconds that add up across workers and steps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvx import KVConnectorStats, TransferFigures


class LMCacheStats(KVConnectorStats):
    """`data`: per kind (`store`, `load`, `lookup`), the count, the tokens and bytes moved, the
    seconds spent (`<kind>_seconds`) and one duration per call (`<kind>_durations`); plus
    `load_errors` (requests whose load came back short: LMCache lacked the tokens)."""

    def count(self, key: str, amount: float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + amount

    @contextmanager
    def timed(self, kind: str, tokens: int, token_bytes: int = 0) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.moved(kind, tokens, token_bytes)
            self.count(f"{kind}_seconds", seconds)
            self.data.setdefault(f"{kind}_durations", []).append(seconds)

    def moved(self, kind: str, tokens: int, token_bytes: int) -> None:
        """One call of `kind` moved `tokens` tokens of `token_bytes` each."""
        self.count(f"{kind}s")
        self.count(f"{kind}_tokens", tokens)
        self.count(f"{kind}_bytes", tokens * token_bytes)

    def figures(self) -> TransferFigures:
        d = self.data
        return TransferFigures(
            bytes={"saved": int(d.get("store_bytes", 0)), "loaded": int(d.get("load_bytes", 0))},
            seconds={
                "saved": list(d.get("store_durations", [])),
                "loaded": list(d.get("load_durations", [])),
            },
            hits={"lmcache": int(d.get("load_tokens", 0))},
            failures={"store_miss": int(d.get("load_errors", 0))},
        )
