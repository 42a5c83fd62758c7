"""P2pKVConnectorStats: what moved, what failed and what was refused, merged across workers."""

from __future__ import annotations

import threading
from typing import Any

from kvx import KVConnectorStats, TransferFigures

COUNT_KEYS = (
    "puts",
    "put_bytes",
    "gets",
    "get_bytes",
    "received_bytes",
    "served_bytes",
    "failed_transfers",
    "failed_loads",
    "checksum_failures",
    "refused_puts",
    "refused_messages",
    "spilled",
)
DURATION_KEYS = ("transfer_duration", "sent_duration", "received_duration")
MB = float(1 << 20)


class P2pKVConnectorStats(KVConnectorStats):
    """`data`: counters (`COUNT_KEYS`; `failed_loads` counts every failed load, of which
    `checksum_failures` are slices whose bytes differed from P's digests), `transfer_duration`
    (seconds per PUT or GET) and the same split by direction (`sent_duration`: PUTs,
    `received_duration`: GETs). Background threads count through `count` (locked)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=dict(data) if data else {})
        for key in DURATION_KEYS:
            self.data.setdefault(key, [])
        for key in COUNT_KEYS:
            self.data.setdefault(key, 0)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """vLLM ships stats from worker to engine core by value: the data, never the lock."""
        with self._lock:
            return {"data": self.data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = state["data"]
        self._lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.data[key] += n

    def record(self, seconds: float, direction: str) -> None:
        """One PUT (`direction` "sent") or GET ("received") took `seconds`."""
        with self._lock:
            self.data["transfer_duration"].append(seconds)
            self.data[f"{direction}_duration"].append(seconds)

    def reset(self) -> None:
        with self._lock:
            self.data = P2pKVConnectorStats().data

    def is_empty(self) -> bool:
        return not self.data["transfer_duration"] and not any(self.data[k] for k in COUNT_KEYS)

    def clone_and_reset(self) -> KVConnectorStats:
        with self._lock:
            clone = P2pKVConnectorStats(self.data)
            self.data = P2pKVConnectorStats().data
        return clone

    def figures(self) -> TransferFigures:
        d = self.data
        return TransferFigures(
            bytes={
                "sent": d["put_bytes"] + d["served_bytes"],
                "received": d["get_bytes"] + d["received_bytes"],
            },
            seconds={"sent": list(d["sent_duration"]), "received": list(d["received_duration"])},
            failures={
                "transport": d["failed_transfers"] + d["failed_loads"] - d["checksum_failures"],
                "checksum": d["checksum_failures"],
                "refused": d["refused_puts"] + d["refused_messages"],
            },
        )

    def reduce(self) -> dict[str, int | float]:
        durations = self.data["transfer_duration"]
        moved = self.data["put_bytes"] + self.data["get_bytes"]
        total = sum(durations)
        out: dict[str, int | float] = {
            "Num transfers": len(durations),
            "Avg xfer time (ms)": 1e3 * total / len(durations) if durations else 0.0,
            "Throughput (MB/s)": moved / MB / total if total > 0 else 0.0,
        }
        out.update({key: self.data[key] for key in COUNT_KEYS})
        return out
