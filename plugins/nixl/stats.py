"""NixlKVConnectorStats: per-transfer figures, merged across workers (as vLLM's class
of that name in `kv_connector/v1/nixl_connector.py`)."""

from __future__ import annotations

from typing import Any

from kvx import KVConnectorStats, TransferFigures

LIST_KEYS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors")
COUNT_KEYS = (
    "num_failed_transfers",
    "num_failed_notifications",
    "num_failed_handshakes",
    "num_kv_expired_reqs",
    "num_notifications_after_expiry",
    "num_refused_notifications",
    "num_unknown_notifications_dropped",
    "num_checksum_failures",
    "num_handshakes",
    "num_preconnects",
)
GAUGE_KEYS = ("held_requests", "held_oldest_seconds")
"""P's holds at the time of the report: merged by maximum, not summed (every TP rank holds
its shard of the same requests)."""
MB = float(1 << 20)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class NixlKVConnectorStats(KVConnectorStats):
    """`data`: one entry per successful transfer in the lists (seconds, bytes, descriptors)
    and counters for failures, expired leases and late notifications (matches vLLM's
    `NixlKVConnectorStats`)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=dict(data) if data else {})
        for key in LIST_KEYS:
            self.data.setdefault(key, [])
        for key in COUNT_KEYS:
            self.data.setdefault(key, 0)

    def record_transfer(self, seconds: float, post_seconds: float, nbytes: int, descs: int) -> None:
        self.data["transfer_duration"].append(seconds)
        self.data["post_duration"].append(post_seconds)
        self.data["bytes_transferred"].append(nbytes)
        self.data["num_descriptors"].append(descs)

    def count(self, key: str, n: int = 1) -> None:
        self.data[key] += n

    def set_held(self, requests: int, oldest_seconds: float) -> None:
        """P's requests held for D now, and how long the oldest has been held."""
        self.data["held_requests"] = requests
        self.data["held_oldest_seconds"] = oldest_seconds

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        gauges = {k: max(self.data.get(k, 0), other.data.get(k, 0)) for k in GAUGE_KEYS}
        present = any(k in self.data or k in other.data for k in GAUGE_KEYS)
        super().aggregate(type(other)({k: v for k, v in other.data.items() if k not in GAUGE_KEYS}))
        if present:
            self.data.update(gauges)
        return self

    def figures(self) -> TransferFigures:
        d = self.data
        held = d.get("held_requests")
        return TransferFigures(
            bytes={"received": sum(d["bytes_transferred"])},
            seconds={"received": list(d["transfer_duration"])},
            failures={
                "transport": d["num_failed_transfers"]
                + d["num_failed_notifications"]
                + d["num_failed_handshakes"],
                "timeout": d["num_kv_expired_reqs"],
                "refused": d["num_refused_notifications"],
                "checksum": d["num_checksum_failures"],
            },
            held_requests=None if held is None else int(held),
            held_oldest_seconds=d.get("held_oldest_seconds"),
        )

    def reset(self) -> None:
        self.data = NixlKVConnectorStats().data

    def is_empty(self) -> bool:
        """No transfer, failure or held-requests report."""
        return (
            not self.data["transfer_duration"]
            and not any(self.data[k] for k in COUNT_KEYS)
            and "held_requests" not in self.data
        )

    def clone_and_reset(self) -> KVConnectorStats:
        clone = NixlKVConnectorStats(self.data)
        self.reset()
        return clone

    def reduce(self) -> dict[str, int | float]:
        durations = self.data["transfer_duration"]
        posts = self.data["post_duration"]
        nbytes = self.data["bytes_transferred"]
        n = len(durations)
        total_s = sum(durations)
        out: dict[str, int | float] = {
            "Num successful transfers": n,
            "Avg xfer time (ms)": 1e3 * total_s / n if n else 0.0,
            "P90 xfer time (ms)": 1e3 * _p90(durations) if n else 0.0,
            "Avg post time (ms)": 1e3 * sum(posts) / n if n else 0.0,
            "P90 post time (ms)": 1e3 * _p90(posts) if n else 0.0,
            "Avg MB per transfer": sum(nbytes) / MB / n if n else 0.0,
            "Throughput (MB/s)": sum(nbytes) / MB / total_s if total_s > 0 else 0.0,
            "Avg number of descriptors": sum(self.data["num_descriptors"]) / n if n else 0.0,
            "Num failed transfers": self.data["num_failed_transfers"]
            + self.data["num_failed_handshakes"]
            + self.data["num_failed_notifications"],
            "Num failed handshakes": self.data["num_failed_handshakes"],
            "Num handshakes": self.data["num_handshakes"],
            "Num preconnects": self.data["num_preconnects"],
            "Num KV expired reqs": self.data["num_kv_expired_reqs"],
            "Num notifs after expiry": self.data["num_notifications_after_expiry"],
        }
        return out
