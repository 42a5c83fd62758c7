"""OffloadingConnector's typed extra config (no heavy imports)."""

from typing import Annotated, Literal

import msgspec

from kvx import url_problem

MAX_CPU_BYTES = 1 << 50
"""1 PiB: more than any machine's memory (construction also checks this machine's)."""


class OffloadingConfig(msgspec.Struct, forbid_unknown_fields=True):
    """CPU tier size and granularity, eviction, and when to store.

    Give the offloaded granularity either as `blocks_per_chunk` (engine blocks per offloaded
    chunk) or as `block_size` (tokens, a multiple of the engine's block size), not both. A disk
    tier needs both `disk_url` (an fsspec URL) and `disk_bytes_to_use`.
    """

    cpu_bytes_to_use: Annotated[int, msgspec.Meta(gt=0, le=MAX_CPU_BYTES)]
    blocks_per_chunk: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] | None = None
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    eviction_policy: Literal["lru", "arc"] = "lru"
    store_threshold: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    max_tracker_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] = 64_000
    disk_url: str | None = None  # fsspec URL of a second tier for chunks evicted from CPU
    disk_bytes_to_use: Annotated[int, msgspec.Meta(gt=0, le=1 << 60)] | None = None

    def __post_init__(self) -> None:
        if self.blocks_per_chunk is not None and self.block_size is not None:
            raise ValueError(
                f"block_size: give blocks_per_chunk ({self.blocks_per_chunk}) or block_size "
                f"({self.block_size}), not both"
            )
        if (self.disk_url is None) != (self.disk_bytes_to_use is None):
            missing = "disk_bytes_to_use" if self.disk_bytes_to_use is None else "disk_url"
            raise ValueError(
                f"{missing}: required with "
                f"{'disk_url' if missing == 'disk_bytes_to_use' else 'disk_bytes_to_use'} "
                "(give both for a disk tier, or neither)"
            )
        if self.disk_url is not None:
            if "://" not in self.disk_url:
                raise ValueError(
                    f"disk_url: {self.disk_url[:200]!r} is not a URL; e.g. 'file:///var/kv-disk'"
                )
            problem = url_problem(self.disk_url)
            if problem is not None:
                raise ValueError(f"disk_url: {self.disk_url[:200]!r} {problem}")
