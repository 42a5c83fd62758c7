"""OffloadingConnector's typed extra config (no heavy imports)."""

from typing import Annotated, Literal

import msgspec

from kvx import ConfigProblem, url_problem

CPU_SPEC = "CPUOffloadingSpec"
INLINE_COPY_BYTES = 16 << 20
"""Default `inline_copy_bytes`: below this, handing a copy to the copy thread costs more CPU
than the copy (docs/performance.md, "Storage and offloading")."""
MAX_CPU_BYTES = 1 << 50
"""1 PiB: more than any machine's memory (construction also checks this machine's)."""


class OffloadingConfig(msgspec.Struct, forbid_unknown_fields=True):
    """CPU tier size and granularity, eviction, and when to store.

    Give the offloaded granularity either as `blocks_per_chunk` (engine blocks per offloaded
    chunk) or as `block_size` (tokens, a multiple of the engine's block size), not both. A disk
    tier needs both `disk_url` (an fsspec URL) and `disk_bytes_to_use`.

    vLLM's older spellings are accepted: `num_cpu_blocks` (offloaded blocks the CPU tier holds)
    instead of `cpu_bytes_to_use`, mapped to bytes when the connector is built on an engine
    (an offloaded block's bytes depend on the engine's KV geometry), and `spec_name:
    "CPUOffloadingSpec"`, the one spec kvx implements.
    """

    cpu_bytes_to_use: Annotated[int, msgspec.Meta(gt=0, le=MAX_CPU_BYTES)] | None = None
    num_cpu_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_CPU_BYTES)] | None = None
    spec_name: str | None = None
    spec_module_path: str | None = None
    blocks_per_chunk: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] | None = None
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    eviction_policy: Literal["lru", "arc"] = "lru"
    store_threshold: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    max_tracker_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] = 64_000
    disk_url: str | None = None  # fsspec URL of a second tier for chunks evicted from CPU
    disk_bytes_to_use: Annotated[int, msgspec.Meta(gt=0, le=1 << 60)] | None = None
    # With host (CPU) caches, copies of at most this many bytes run on the engine's thread when
    # the copy thread is idle (no hand-off to another core); 0: every copy on the copy thread.
    inline_copy_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = INLINE_COPY_BYTES

    def __post_init__(self) -> None:
        if self.spec_name is not None and self.spec_name != CPU_SPEC:
            raise ValueError(
                f"spec_name: {self.spec_name[:100]!r} is not allowed; allowed: {CPU_SPEC!r} "
                "(kvx's OffloadingConnector is vLLM's CPU spec, with disk_url for a disk tier; "
                "leave spec_name out, or write a kvx connector for another tier: "
                "docs/writing-a-connector.md)"
            )
        if self.spec_module_path is not None:
            raise ValueError(
                f"spec_module_path: {self.spec_module_path[:100]!r} names a vLLM Python class, "
                "which kvx cannot load; leave it out (kvx offloads to CPU and disk_url), or "
                "write a kvx connector for another tier: docs/writing-a-connector.md"
            )
        if self.cpu_bytes_to_use is None and self.num_cpu_blocks is None:
            raise ValueError(
                "cpu_bytes_to_use: required key is missing; expected an integer > 0 (bytes of "
                "the CPU tier), or vLLM's num_cpu_blocks (offloaded blocks it holds)"
            )
        if self.cpu_bytes_to_use is not None and self.num_cpu_blocks is not None:
            raise ValueError(
                f"num_cpu_blocks: give cpu_bytes_to_use ({self.cpu_bytes_to_use}) or vLLM's "
                f"num_cpu_blocks ({self.num_cpu_blocks}), not both"
            )
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

    def config_checks(self) -> list[ConfigProblem]:
        """`kvx validate --check`: the disk tier opens (its directory made) as a worker opens it."""
        if self.disk_url is None:
            return []
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(self.disk_url)
            fs.makedirs(root, exist_ok=True)
        except Exception as exc:  # fsspec raises what its filesystem's constructor raises
            why = f"{type(exc).__name__}: {exc}"
            return [ConfigProblem("disk_url", f"cannot open {self.disk_url[:200]!r}: {why}")]
        return []

    def config_notes(self) -> list[ConfigProblem]:
        """What `kvx validate` tells the operator about vLLM spellings this config uses."""
        notes = []
        if self.num_cpu_blocks is not None:
            notes.append(
                ConfigProblem(
                    "num_cpu_blocks",
                    f"{self.num_cpu_blocks} (vLLM's name) is mapped to cpu_bytes_to_use = "
                    "num_cpu_blocks x the bytes of one offloaded block (its tokens x layers x 2 "
                    "x KV heads x head size x dtype bytes), computed "
                    "when the connector is built on the engine; set cpu_bytes_to_use to give bytes",
                )
            )
        if self.spec_name is not None:
            notes.append(
                ConfigProblem(
                    "spec_name",
                    f"{CPU_SPEC!r} (vLLM's name) is kvx's OffloadingConnector itself; the key "
                    "can be left out",
                )
            )
        return notes
