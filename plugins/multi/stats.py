"""Per-child statistics of a MultiConnector."""

from __future__ import annotations

from typing import Any

from kvx import KVConnectorStats, TransferFigures


class MultiKVConnectorStats(KVConnectorStats):
    """`data` maps each child's connector name to that child's stats object."""

    def to_dict(self) -> dict[str, Any]:
        return {name: stats.to_dict() for name, stats in self.data.items()}

    def is_empty(self) -> bool:
        return all(stats.is_empty() for stats in self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, MultiKVConnectorStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into MultiKVConnectorStats")
        for name, stats in other.data.items():
            if name in self.data:
                self.data[name].aggregate(stats)
            else:
                self.data[name] = stats
        return self

    def figures_by_connector(self, name: str) -> dict[str, TransferFigures]:
        """One entry per child, keyed by the child's name (not `name`: the children are the
        connectors that moved the bytes)."""
        return {
            key: figures
            for child, stats in self.data.items()
            for key, figures in stats.figures_by_connector(child).items()
        }

    def reduce(self) -> dict[str, int | float]:
        """Each child's reduced figures, keyed `<child>.<figure>`."""
        return {
            f"{name}.{key}": value
            for name, stats in self.data.items()
            for key, value in stats.reduce().items()
        }

    def clone_and_reset(self) -> KVConnectorStats:
        clone = MultiKVConnectorStats(data=self.data)
        self.data = {}
        return clone
