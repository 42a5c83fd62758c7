"""Connector statistics: what workers measure, merged across workers, reduced for logging."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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

    def clone_and_reset(self) -> KVConnectorStats:
        """Return a copy of the current figures and start counting afresh."""
        clone = type(self)(data=self.data)
        self.data = {}
        return clone
