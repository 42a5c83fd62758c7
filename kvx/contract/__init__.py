"""The connector author's wing: the contract a connector implements and the types it speaks.

Modules:

- `base`: `KVConnectorBase_V1`, its role, metadata markers, results and outputs
- `types`: engine-neutral requests, blocks, scheduler output, `EngineContext`
- `rolesplit`: `RoleSplitConnector` over a scheduler half and a worker half
- `handshake`: what a worker publishes for its peers
- `planning`: scheduler halves that plan each step request by request
- `events`, `stats`: KV cache events and transfer statistics

Re-exports the public names (`kvx.__all__`) that live here.
"""

from __future__ import annotations

from kvx.contract.auxiliary import (
    ANY_GEOMETRY,
    CONTRACT_VERSION,
    Capability,
    CopyBlocksOp,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    KVTransferResults,
    SupportsHMA,
    supports_hma,
)
from kvx.contract.base import KVConnectorBase, KVConnectorBase_V1
from kvx.contract.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockStoreFailed,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from kvx.contract.handshake import (
    AgentPayload,
    KVConnectorHandshakeMetadata,
    WorkerAddress,
)
from kvx.contract.planning import (
    LoadsAndStores,
    PlanningScheduler,
    RequestTracker,
    ScheduledRequest,
    TrackedRequest,
)
from kvx.contract.rolesplit import (
    ConnectorScheduler,
    ConnectorWorker,
    RoleSplitConnector,
)
from kvx.contract.stats import (
    DIRECTIONS,
    FAILURE_KINDS,
    KVConnectorStats,
    TransferFigures,
)
from kvx.contract.types import (
    NULL_BLOCK,
    BlockIds,
    CachedRequestData,
    EngineContext,
    ForwardContext,
    KVCacheBlocks,
    KVCacheSpec,
    NewRequestData,
    ParallelInfo,
    PluginRegistry,
    Request,
    RequestStatus,
    SchedulerOutput,
    skipped_blocks,
    yield_req_data,
)

__all__ = [
    "ANY_GEOMETRY",
    "CONTRACT_VERSION",
    "DIRECTIONS",
    "FAILURE_KINDS",
    "NULL_BLOCK",
    "AgentPayload",
    "AllBlocksCleared",
    "BlockIds",
    "BlockRemoved",
    "BlockStoreFailed",
    "BlockStored",
    "CachedRequestData",
    "Capability",
    "ConnectorScheduler",
    "ConnectorWorker",
    "CopyBlocksOp",
    "EngineContext",
    "ForwardContext",
    "KVCacheBlocks",
    "KVCacheEvent",
    "KVCacheSpec",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorKVEvents",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "KVTransferResults",
    "LoadsAndStores",
    "NewRequestData",
    "ParallelInfo",
    "PlanningScheduler",
    "PluginRegistry",
    "Request",
    "RequestStatus",
    "RequestTracker",
    "RoleSplitConnector",
    "ScheduledRequest",
    "SchedulerOutput",
    "SupportsHMA",
    "TrackedRequest",
    "TransferFigures",
    "WorkerAddress",
    "skipped_blocks",
    "supports_hma",
    "yield_req_data",
]
