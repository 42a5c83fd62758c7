"""kvx: a pluggable KV-cache transfer SDK for LLM serving.

The public API is what this module exports in `__all__`, plus the modules `kvx.topology`,
`kvx.wire`, `kvx.discovery` and `kvx.engine` (each by its own `__all__`); plugins (built-in
ones included) use nothing else (docs/architecture.md, enforced by tests/core/test_import_rule.py).
"""

from __future__ import annotations

from kvx._version import __version__
from kvx.config.schema import path_problem, url_problem
from kvx.config.secrets import Secret, SecretSource, redact_url, resolve_secret
from kvx.config.transfer import ConfigResolver, KVTransferConfig, load_cli_arg
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
from kvx.contract.groups import (
    GroupScheduler,
    GroupWorker,
    one_group_output,
    split_by_group,
)
from kvx.contract.handshake import AgentPayload, KVConnectorHandshakeMetadata, WorkerAddress
from kvx.contract.integrity import (
    IntegrityError,
    block_digests,
    cache_block_digests,
    check_block_digests,
    merge_digests,
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
    GroupsMetadata,
    RoleSplitConnector,
)
from kvx.contract.stats import DIRECTIONS, FAILURE_KINDS, KVConnectorStats, TransferFigures
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
from kvx.errors import ConfigError, ConfigProblem, MissingDependencyError, RegistryError
from kvx.hooks.hookimpls import hookimpl, provides, provides_connector
from kvx.hooks.specs import (
    CommandSpec,
    ConnectorSpec,
    KVLayout,
    LayoutSpec,
    StorageBackendSpec,
    TransformSpec,
)
from kvx.registry.core import (
    Registry,
    create_connector,
    get_layout,
    get_registry,
    open_storage_backend,
)
from kvx.registry.loading import install_hint
from kvx.storage.backend import (
    StorageBackend,
    StorageBackendOptions,
    StorageRegionTable,
    SupportsHashedIO,
    copy_into,
    supports_hashed_io,
)
from kvx.storage.listing import StoredEntry, SupportsListing, supports_listing
from kvx.storage.userdirs import make_private_dirs, user_cache_dir

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
    "CommandSpec",
    "ConfigError",
    "ConfigProblem",
    "ConfigResolver",
    "ConnectorScheduler",
    "ConnectorSpec",
    "ConnectorWorker",
    "CopyBlocksOp",
    "EngineContext",
    "ForwardContext",
    "GroupScheduler",
    "GroupWorker",
    "GroupsMetadata",
    "IntegrityError",
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
    "KVLayout",
    "KVTransferConfig",
    "KVTransferResults",
    "LayoutSpec",
    "LoadsAndStores",
    "MissingDependencyError",
    "NewRequestData",
    "ParallelInfo",
    "PlanningScheduler",
    "PluginRegistry",
    "Registry",
    "RegistryError",
    "Request",
    "RequestStatus",
    "RequestTracker",
    "RoleSplitConnector",
    "ScheduledRequest",
    "SchedulerOutput",
    "Secret",
    "SecretSource",
    "StorageBackend",
    "StorageBackendOptions",
    "StorageBackendSpec",
    "StorageRegionTable",
    "StoredEntry",
    "SupportsHMA",
    "SupportsHashedIO",
    "SupportsListing",
    "TrackedRequest",
    "TransferFigures",
    "TransformSpec",
    "WorkerAddress",
    "__version__",
    "block_digests",
    "cache_block_digests",
    "check_block_digests",
    "copy_into",
    "create_connector",
    "get_layout",
    "get_registry",
    "hookimpl",
    "install_hint",
    "load_cli_arg",
    "make_private_dirs",
    "merge_digests",
    "one_group_output",
    "open_storage_backend",
    "path_problem",
    "provides",
    "provides_connector",
    "redact_url",
    "resolve_secret",
    "skipped_blocks",
    "split_by_group",
    "supports_hashed_io",
    "supports_hma",
    "supports_listing",
    "url_problem",
    "user_cache_dir",
    "yield_req_data",
]
