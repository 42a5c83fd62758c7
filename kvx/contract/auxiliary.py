"""The contract's vocabulary around the connector class: its version, capabilities, roles,
the metadata markers, what workers report each step, and the HMA ability.

Behaviour-compatible with the vLLM types of the same names (`kvx.contract.base` holds the
connector class that speaks them).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvx.contract.events import KVConnectorKVEvents
from kvx.contract.stats import KVConnectorStats

if TYPE_CHECKING:
    import torch

    from kvx.contract.types import Request

CONTRACT_VERSION: tuple[int, int] = (1, 0)
"""(major, minor) of this contract. Minor releases only add methods with defaults; a connector
built for another major is refused by the registry."""

KVX_RELEASES_FOR_CONTRACT_MAJOR: dict[int, str] = {1: "kvx>=0.1,<2"}
"""Which kvx releases implement each contract major (named in the registry's refusal message)."""


class Capability(enum.StrEnum):
    """What a connector claims; the conformance suite runs the scenarios of each claim and
    reports the others as "not claimed"."""

    REMOTE_PREFILL = "remote_prefill"  # P/D hand-off through request_finished params
    STORE_REUSE = "store_reuse"  # saves KV that later requests (any engine) load
    STORE_PD = "store_pd"  # P/D through the store: P (kv_producer) saves, D (kv_consumer) loads
    ASYNC_LOAD = "async_load"  # loads across steps (WAITING_FOR_REMOTE_KVS)
    LAYERWISE = "layerwise"  # real work in wait_for_layer_load / save_kv_layer
    HETERO_TP = "hetero_tp"  # P and D with different TP sizes
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"  # P and D with different block sizes
    LAYOUT_CONVERSION = "layout_conversion"  # P and D with different KV layouts
    HMA = "hma"  # several KV-cache groups
    MLA = "mla"  # MLA caches: one latent per token, no heads, the same on every TP rank
    DETECTS_CORRUPTION = "detects_corruption"  # verifies stored bytes, reports bad blocks
    OFFLOAD = "offload"  # keeps KV in a slower tier and reloads it into the same engine


ANY_GEOMETRY: frozenset[Capability] = frozenset(
    {Capability.HETERO_TP, Capability.BLOCK_SIZE_MISMATCH, Capability.LAYOUT_CONVERSION}
)
"""The claims of a connector whose two sides may differ in TP size, block size and layout."""


class KVConnectorRole(enum.Enum):
    """Which side of the engine a connector instance lives on."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """Marker base of the per-step payload the scheduler side sends to workers.

    Subclasses must be msgspec-encodable (dataclasses or msgspec Structs of plain fields):
    the payload may cross a process boundary and kvx never pickles.
    """


class KVConnectorWorkerMetadata(ABC):
    """Per-step payload from workers to the scheduler side, merged across workers first."""

    @abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge `other` (another worker's metadata for the same step) into this one."""


@dataclass
class KVTransferResults:
    """What a worker reports after a step.

    A request in `failed_recving` must also be in `finished_recving`, so the scheduler can take it
    out of `WAITING_FOR_REMOTE_KVS` (matches vLLM's `KVConnectorTransferResults`).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


KVConnectorTransferResults = KVTransferResults


@dataclass
class KVConnectorOutput:
    """One worker's connector results for one step (vLLM's `KVConnectorOutput`).

    `expected_finished_count` 0 means "no change" to the number of workers that must report a
    request finished.
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: KVConnectorStats | None = None
    kv_cache_events: KVConnectorKVEvents | None = None
    kv_connector_worker_meta: KVConnectorWorkerMetadata | None = None
    expected_finished_count: int = 0

    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
            or self.kv_connector_stats
            or self.kv_cache_events
            or self.kv_connector_worker_meta
        )


CopyBlocksOp = Callable[
    [
        "dict[str, torch.Tensor]",
        "dict[str, torch.Tensor]",
        list[int],
        list[int],
        Literal["h2d", "d2h"],
    ],
    None,
]
"""(src caches, dst caches, src block ids, dst block ids, direction) -> None."""


class SupportsHMA(ABC):
    """Mixin for connectors that handle several KV-cache groups (hybrid memory allocator)."""

    @abstractmethod
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Multi-group `request_finished`: same contract, one block list per group."""


def supports_hma(connector: Any) -> bool:
    """True if `connector` (a class or an instance) implements `SupportsHMA`."""
    cls = connector if isinstance(connector, type) else type(connector)
    return issubclass(cls, SupportsHMA)
