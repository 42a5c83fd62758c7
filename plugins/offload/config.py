"""OffloadingConnector's typed extra config (no heavy imports)."""

from typing import Annotated, Literal

import msgspec


class OffloadingConfig(msgspec.Struct, forbid_unknown_fields=True):
    """CPU tier size and granularity, eviction, and when to store.

    Give the offloaded granularity either as `blocks_per_chunk` (engine blocks per offloaded
    chunk) or as `block_size` (tokens, a multiple of the engine's block size), not both.
    """

    cpu_bytes_to_use: Annotated[int, msgspec.Meta(gt=0)]
    blocks_per_chunk: Annotated[int, msgspec.Meta(ge=1)] | None = None
    block_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    eviction_policy: Literal["lru", "arc"] = "lru"
    store_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_tracker_size: Annotated[int, msgspec.Meta(ge=1)] = 64_000
    disk_url: str | None = None  # fsspec URL of a second tier for chunks evicted from CPU
    disk_bytes_to_use: Annotated[int, msgspec.Meta(gt=0)] | None = None
