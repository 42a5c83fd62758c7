"""Engine-neutral types the connector contract speaks.

These replace vLLM's `Request`, `KVCacheBlocks`, `SchedulerOutput`, `ForwardContext`,
`vllm_config` and `kv_cache_config` with small, explicit dataclasses that any engine can fill in.
None of them imports torch at module import time, so `import kvx` stays cheap.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvx.hooks.specs import KVLayout

if TYPE_CHECKING:
    import torch

BlockIds = tuple[list[int], ...]
"""One list of block ids per KV-cache group (exactly one group when HMA is off)."""

NULL_BLOCK = -1
"""A block table entry with no block behind it: a block a sliding window no longer needs (vLLM's
shared null block). Connectors never read or write it; only the leading entries of a table are
null (`skipped_blocks`), and no tensor index is ever -1 on purpose."""


def skipped_blocks(block_ids: Sequence[int]) -> int:
    """How many leading entries of a block table are `NULL_BLOCK` (blocks outside a sliding
    window); the tokens of a table's first `skipped_blocks * block_size` positions have no KV.

    Raises `ValueError` if a null entry follows a real block (no engine makes such a table)."""
    skipped = 0
    for block in block_ids:
        if block != NULL_BLOCK:
            break
        skipped += 1
    if NULL_BLOCK in block_ids[skipped:]:
        raise ValueError(
            f"block_ids: NULL_BLOCK ({NULL_BLOCK}) after a real block in {list(block_ids)}; "
            "only a leading run of entries (outside a sliding window) may be null"
        )
    return skipped


class RequestStatus(enum.Enum):
    """Scheduler states of a request (matches vLLM's `RequestStatus` members kvx needs)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class Request:
    """One generation request as a connector sees it.

    `kv_transfer_params` is the per-request dict a proxy forwards between engines
    (vLLM's `request.kv_transfer_params`); connectors read it and may mutate it.
    `block_hashes` are the chained prefix hashes of the request's full blocks, when the engine
    computes them (used by store/offload connectors as keys).
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    max_tokens: int = 16
    kv_transfer_params: dict[str, Any] | None = None
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)
    mm_hashes: list[str] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def is_finished(self) -> bool:
        return self.status.is_finished


@dataclass
class KVCacheBlocks:
    """The blocks allocated to one request, per KV-cache group.

    `num_hashed_blocks[g]` counts the leading blocks of group `g` that need no KV: prefix-cache
    hits and `NULL_BLOCK` entries (outside a sliding window); the rest are "unhashed" (freshly
    allocated, safe to load into). With a sliding window that count is not the engine's own
    token count: a hit block may have become null.
    """

    block_ids: BlockIds
    num_hashed_blocks: tuple[int, ...] | None = None

    def get_block_ids(self) -> BlockIds:
        return self.block_ids

    def get_unhashed_block_ids(self) -> list[int]:
        """Blocks of the single group that were not prefix-cache hits (matches vLLM's helper)."""
        if len(self.block_ids) != 1:
            raise ValueError(
                "get_unhashed_block_ids needs exactly one KV-cache group, "
                f"got {len(self.block_ids)}"
            )
        hashed = self.num_hashed_blocks[0] if self.num_hashed_blocks else 0
        return list(self.block_ids[0][hashed:])

    @classmethod
    def empty(cls, num_groups: int = 1) -> KVCacheBlocks:
        return cls(tuple([] for _ in range(num_groups)), tuple(0 for _ in range(num_groups)))


@dataclass
class NewRequestData:
    """A request scheduled for the first time in this step."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: BlockIds
    num_computed_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    mm_hashes: list[str] = field(default_factory=list)
    """The request's multimodal inputs' hashes (vLLM's `mm_features` identifiers), as
    `Request.mm_hashes`."""


@dataclass
class CachedRequestData:
    """Requests scheduled before; parallel lists indexed like `req_ids`.

    `new_block_ids[i]` holds only this step's new blocks for a running request, or the full block
    table when the request resumes from preemption (`req_id in resumed_req_ids`).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """What one scheduler step decided; the connector's metadata rides along to the workers."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def yield_req_data(
    scheduler_output: SchedulerOutput,
) -> Iterator[tuple[str, BlockIds | None, bool]]:
    """Yield `(req_id, block_ids, is_full_table)` for every scheduled request.

    Matches vLLM 0.33's `yield_req_data`: new requests and requests resumed from preemption
    carry their whole block table (`True`); running requests carry only this step's new blocks.
    """
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, new.block_ids, True
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        yield req_id, cached.new_block_ids[i], req_id in cached.resumed_req_ids


@dataclass
class ForwardContext:
    """What a worker-side connector sees of one forward pass.

    `kv_caches` maps layer name to the layer's paged KV tensor (in `KVCacheSpec.layout`);
    `attn_metadata` is the engine's per-step attention metadata (opaque to kvx).
    """

    kv_caches: Mapping[str, torch.Tensor] = field(default_factory=dict)
    attn_metadata: Any = None
    virtual_engine: int = 0


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of this engine's KV cache: model dims as a whole, not per rank.

    `num_kv_heads` is the model's total KV head count; a rank stores its TP shard of them.
    `dtype` is a torch dtype name (`"float32"`, `"bfloat16"`, ...); `layout` names a registered
    layout (see `kvx list`). `sliding_window` (tokens; None: full attention) says attention
    reads only the last `sliding_window` positions, so leading block table entries become
    `NULL_BLOCK` as a request grows. `layer_groups` (engines with several KV-cache groups,
    vLLM's hybrid allocator) gives each layer's group, the index of its table in `BlockIds`;
    empty: every layer is in group 0.
    """

    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str = "float32"
    layout: str = "NHD"
    use_mla: bool = False
    num_blocks: int = 0
    sliding_window: int | None = None
    layer_groups: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def num_groups(self) -> int:
        """KV-cache groups (tables per request in `BlockIds`)."""
        return max(self.layer_groups, default=0) + 1

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"KVCacheSpec.dtype: {self.dtype!r} is not a torch dtype name")
        return dtype


@dataclass(frozen=True)
class ParallelInfo:
    """This process's place in the parallel grid (tensor, pipeline, data, context parallel)."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    pcp_size: int = 1
    dcp_size: int = 1

    @property
    def world_size(self) -> int:
        """Workers of one engine that each run a worker-side connector (TP x PP x PCP)."""
        return self.tp_size * self.pp_size * self.pcp_size


class PluginRegistry(Protocol):
    """What a connector looks up in the registry it was built from (`kvx.Registry` is one).
    Connector classes and backends are typed loosely here (`types` sits below the contract);
    `kvx.Registry` gives the precise types."""

    def get_layout(self, name: str) -> KVLayout: ...

    def resolve_connector_class(self, config: Any) -> Any: ...

    def load_connector_class(self, name: str) -> Any: ...

    def storage_backend_for_url(self, url: str) -> Any: ...

    def load_storage_backend(self, name: str) -> Any: ...

    def extra_config_target(
        self, connector: str, module_path: str | None, config_path: str = ""
    ) -> Any: ...


@dataclass(frozen=True)
class EngineContext:
    """Everything a connector is constructed with besides its config and role.

    It carries what vLLM spreads over `vllm_config` and `kv_cache_config`.
    """

    engine_id: str
    model_name: str
    cache: KVCacheSpec
    parallel: ParallelInfo = field(default_factory=ParallelInfo)
    device: str = "cpu"
    enable_hma: bool = False
    enable_kv_cache_events: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
    registry: PluginRegistry | None = field(default=None, repr=False, compare=False)
    """The registry the connector was built from (`create_connector` sets it): a composite
    builds its children, a storage connector opens its backend and a worker finds plugin
    layouts in it, never in the process-wide one."""
