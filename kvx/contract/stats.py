"""Connector statistics: what workers measure, merged across workers, reduced for logging, and
`TransferFigures`, the one shape every connector's stats reduce to for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DIRECTIONS = ("saved", "loaded", "sent", "received")
"""Which way KV moved: into a store or tier (`saved`), back from one (`loaded`), to a peer
engine (`sent`) or from one (`received`)."""

FAILURE_KINDS = ("transport", "timeout", "checksum", "refused", "store_miss")
"""Why a transfer failed: the transport or store broke (`transport`), a deadline or a lease ran
out (`timeout`), the bytes did not match their checksum (`checksum`), the peer refused
(`refused`), the store lacked what was expected (`store_miss`)."""


def _check_keys(what: str, given: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in given:
        if key not in allowed:
            raise ValueError(
                f"TransferFigures.{what}: {key!r} is not allowed; use one of {', '.join(allowed)}"
            )


@dataclass
class TransferFigures:
    """What one connector moved since its last report, in the shape every connector shares.

    `bytes`, `blocks` and `seconds` are keyed by direction (`DIRECTIONS`); `seconds` holds one
    duration per transfer (for histograms). `hits` counts the tokens each source or tier
    served (in whole blocks where a connector only knows blocks); `failures` counts failures
    by kind (`FAILURE_KINDS`). `held_requests` and `held_oldest_seconds` are gauges: requests
    whose blocks are held for a peer right now and how long the oldest has been held (None:
    this connector holds none for a peer)."""

    bytes: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    held_requests: int | None = None
    held_oldest_seconds: float | None = None

    def __post_init__(self) -> None:
        _check_keys("bytes", self.bytes, DIRECTIONS)
        _check_keys("blocks", self.blocks, DIRECTIONS)
        _check_keys("seconds", self.seconds, DIRECTIONS)
        _check_keys("failures", self.failures, FAILURE_KINDS)

    def is_empty(self) -> bool:
        """Nothing moved, hit, failed or is held."""
        return not (
            any(self.bytes.values())
            or any(self.blocks.values())
            or any(self.seconds.values())
            or any(self.hits.values())
            or any(self.failures.values())
            or self.held_requests
        )


@dataclass
class KVConnectorStats:
    """Per-connector statistics collected since the last report.

    `data` holds plain, serialisable values: numbers are summed when workers are aggregated,
    lists are concatenated (e.g. one duration per transfer). Connectors subclass this to give
    `reduce()` meaning (averages, percentiles); matches vLLM's `KVConnectorStats` protocol.
    """

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Merge `other` into `self` (same stats type required) and return `self`."""
        if type(other) is not type(self):
            raise TypeError(
                f"cannot aggregate {type(other).__name__} into {type(self).__name__}: "
                "stats of one connector must share one type"
            )
        for key, value in other.data.items():
            mine = self.data.get(key)
            if mine is None:
                self.data[key] = list(value) if isinstance(value, list) else value
            elif isinstance(mine, list) and isinstance(value, list):
                mine.extend(value)
            elif isinstance(mine, (int, float)) and isinstance(value, (int, float)):
                self.data[key] = mine + value
            else:
                raise TypeError(
                    f"stats key {key!r}: cannot merge {type(value).__name__} into "
                    f"{type(mine).__name__}"
                )
        return self

    def reduce(self) -> dict[str, int | float]:
        """Summarise for logging: numbers as they are, lists of numbers summed."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, (int, float)):
                out[key] = value
            elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                out[key] = sum(value)
        return out

    def figures(self) -> TransferFigures:
        """These stats in the shared shape; connectors override it (the base knows no keys)."""
        return TransferFigures()

    def figures_by_connector(self, name: str) -> dict[str, TransferFigures]:
        """`figures()` keyed by connector name (`name`: this connector's); a composite
        connector gives one entry per child instead."""
        return {name: self.figures()}

    def clone_and_reset(self) -> KVConnectorStats:
        """Return a copy of the current figures and start counting afresh."""
        clone = type(self)(data=self.data)
        self.data = {}
        return clone
