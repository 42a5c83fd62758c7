"""kvx: a pluggable KV-cache transfer SDK for LLM serving.

The public API is what this module exports in `__all__`; plugins (built-in ones included) use
nothing else.
"""

from __future__ import annotations

import pluggy

from kvx.contract import (
    CONTRACT_VERSION,
    CopyBlocksOp,
    KVConnectorBase,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    KVTransferResults,
    SupportsHMA,
    supports_hma,
)
from kvx.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from kvx.specs import ConnectorSpec, LayoutSpec, StorageBackendSpec, TransformSpec
from kvx.stats import KVConnectorStats
from kvx.types import (
    BlockIds,
    CachedRequestData,
    EngineContext,
    ForwardContext,
    KVCacheBlocks,
    KVCacheSpec,
    NewRequestData,
    ParallelInfo,
    Request,
    RequestStatus,
    SchedulerOutput,
    yield_req_data,
)

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("kvx")
"""Marks a plugin's implementation of a `kvx_*` hook (see `kvx.hookspecs`)."""

__all__ = [
    "CONTRACT_VERSION",
    "AllBlocksCleared",
    "BlockIds",
    "BlockRemoved",
    "BlockStored",
    "CachedRequestData",
    "ConnectorSpec",
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
    "LayoutSpec",
    "NewRequestData",
    "ParallelInfo",
    "Request",
    "RequestStatus",
    "SchedulerOutput",
    "StorageBackendSpec",
    "SupportsHMA",
    "TransformSpec",
    "__version__",
    "hookimpl",
    "supports_hma",
    "yield_req_data",
]
