"""What MultiConnector's scheduler side sends its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvx import KVConnectorMetadata


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    """Each child's own metadata, in child order, plus how many extra `finished_sending`
    reports of a request to swallow (children beyond the first that took async ownership)."""

    metadata: tuple[KVConnectorMetadata, ...] = ()
    extra_async_saves: dict[str, int] = field(default_factory=dict)
