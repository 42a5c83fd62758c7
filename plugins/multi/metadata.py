"""What MultiConnector's scheduler side sends its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvx import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    """Each child's own metadata, in child order, plus how many extra `finished_sending`
    reports of a request to swallow (children beyond the first that took async ownership)."""

    metadata: tuple[KVConnectorMetadata, ...] = ()
    extra_async_saves: dict[str, int] = field(default_factory=dict)


@dataclass
class MultiKVConnectorWorkerMetadata(KVConnectorWorkerMetadata):
    """Each child's worker metadata (None where a child has none), in child order."""

    metadata: tuple[KVConnectorWorkerMetadata | None, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, MultiKVConnectorWorkerMetadata):
            raise TypeError(
                f"cannot aggregate {type(other).__name__} into MultiKVConnectorWorkerMetadata"
            )
        merged = []
        for mine, theirs in zip(self.metadata, other.metadata, strict=True):
            if mine is None or theirs is None:
                merged.append(mine if theirs is None else theirs)
            else:
                merged.append(mine.aggregate(theirs))
        self.metadata = tuple(merged)
        return self
