"""Stored-block keys: a chained hash of the token prefix under a namespace, plus head shards.

A stored block is `block_size` prompt tokens. Its key is
`blake2b(parent_key || token ids as little-endian int64)`, the parent of block 0 being a seed
derived from the namespace, the stored block size and the request's multimodal hashes; so two
prompts that share a prefix share the keys (and the stored values) of that prefix. One value is
stored per (block, PP stage, head shard) under
`<namespace>/b<block_size>/<hex[:2]>/<hex>.l<lo>-<hi>.<set>.h<first>-<end>`: every layer of the
stage (global layer indices `[lo, hi)`, `<set>` a hash of their names) for global KV heads
`[first, end)`. An engine of any TP size finds the head shards it needs and an engine of any
PP size the stage values that hold its layers (stages split layers as vLLM's `get_pp_indices`).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from urllib.parse import quote

import kvx
from kvx.topology import pp_layer_range

DIGEST_BYTES = 16
MAX_PROBED_PP = 8  # a reader looks for values of writers with up to this many PP stages
DEFAULT_BLOCK_SIZE = 16
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_namespace(ctx: kvx.EngineContext) -> str:
    """`<model>-<dtype>-k<kv heads>d<head size>[-mla]`: what makes KV of equal tokens equal."""
    spec = ctx.cache
    model = _UNSAFE.sub("_", ctx.model_name).strip("_") or "model"
    mla = "-mla" if spec.use_mla else ""
    return f"{model[:80]}-{spec.dtype}-k{kv_heads(spec)}d{spec.head_size}{mla}"


def kv_heads(spec: kvx.KVCacheSpec) -> int:
    """KV heads stored per token: the model's KV heads, or one latent "head" for MLA."""
    return 1 if spec.use_mla else spec.num_kv_heads


def chain_seed(namespace: str, block_size: int, mm_hashes: Sequence[str] = ()) -> bytes:
    """The parent key of a request's first block."""
    text = f"kvx-storage-v1\0{namespace}\0{block_size}\0" + "-".join(mm_hashes)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def block_keys(token_ids: Sequence[int], block_size: int, seed: bytes) -> list[str]:
    """Hex keys of every full block of `token_ids` (a partial last block has none)."""
    keys: list[str] = []
    parent = seed
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        chunk = token_ids[start : start + block_size]
        parent = hashlib.blake2b(
            parent + struct.pack(f"<{block_size}q", *chunk), digest_size=DIGEST_BYTES
        ).digest()
        keys.append(parent.hex())
    return keys


def shard_ranges(num_heads: int, num_shards: int) -> list[range]:
    """The head ranges of a partition of `num_heads` into `num_shards` equal shards."""
    if num_shards < 1 or num_heads % num_shards:
        raise ValueError(f"{num_heads} KV heads cannot be split into {num_shards} shards")
    per = num_heads // num_shards
    return [range(i * per, (i + 1) * per) for i in range(num_shards)]


def shard_counts(num_heads: int, preferred: int) -> list[int]:
    """Every partition a writer of some TP size may have used, `preferred` first."""
    counts = [n for n in range(1, num_heads + 1) if num_heads % n == 0]
    return sorted(counts, key=lambda n: (n != preferred, n))


def layer_set_hash(layer_names: Sequence[str]) -> bytes:
    """8 bytes naming a stage's layers (so models that differ only in layer names differ)."""
    return hashlib.blake2b("\0".join(layer_names).encode(), digest_size=8).digest()


@dataclass(frozen=True)
class Stage:
    """The layers one stored value holds: global indices `layers` and their names' hash."""

    layers: range
    layer_set: bytes

    @property
    def tag(self) -> str:
        return f"l{self.layers.start}-{self.layers.stop}.{self.layer_set.hex()}"


def value_key(namespace: str, block_size: int, block_key: str, stage: Stage, heads: range) -> str:
    """The storage key of one block's KV for every layer of one stage and one head shard."""
    return value_keys(namespace, block_size, [block_key], stage, heads)[0]


def value_keys(
    namespace: str, block_size: int, block_keys: list[str], stage: Stage, heads: range
) -> list[str]:
    """`value_key` of each of `block_keys` (the common parts formatted once)."""
    root = f"{namespace}/b{block_size}/"
    tail = f".{quote(stage.tag, safe='')}.h{heads.start}-{heads.stop}"
    return [f"{root}{key[:2]}/{key}{tail}" for key in block_keys]


@cache
def _stage(layer_names: tuple[str, ...], start: int, stop: int) -> Stage:
    """A stage of a model's layers (hashed once: every load plans stages per request)."""
    return Stage(range(start, stop), layer_set_hash(layer_names[start:stop]))


def block_key_of(value_name: str) -> str:
    """The block key a `value_key` names (the same for every stage and head shard)."""
    return value_name.rpartition("/")[2].partition(".")[0]


def medium_of(url: str) -> str:
    """The `medium` of KV events for a store at `url` (`DISK` for local files)."""
    scheme = url.partition("://")[0].lower() if "://" in url else "file"
    return "DISK" if scheme == "file" else scheme.upper()


@dataclass(frozen=True)
class Geometry:
    """The key space and block shape an engine reads and writes (same on both sides)."""

    namespace: str
    block_size: int  # tokens per stored block
    engine_block_size: int
    total_heads: int
    head_size: int
    dtype: str
    mla: bool
    layer_names: tuple[str, ...]  # every layer of the model, in order

    @classmethod
    def of(cls, ctx: kvx.EngineContext, namespace: str | None, block_size: int | None) -> Geometry:
        spec = ctx.cache
        engine = spec.block_size
        if block_size is None:
            block_size = DEFAULT_BLOCK_SIZE
            if max(block_size, engine) % min(block_size, engine):
                block_size = engine
        elif max(block_size, engine) % min(block_size, engine):
            problem = kvx.ConfigProblem(
                "kv_connector_extra_config.storage_block_size",
                f"{block_size} neither divides nor is a multiple of the engine's block size "
                f"{engine}",
            )
            raise kvx.ConfigError([problem])
        return cls(
            namespace=namespace or default_namespace(ctx),
            block_size=block_size,
            engine_block_size=engine,
            total_heads=kv_heads(spec),
            head_size=spec.head_size,
            dtype=spec.dtype,
            mla=spec.use_mla,
            layer_names=tuple(spec.layer_names),
        )

    @property
    def kv_parts(self) -> int:
        return 1 if self.mla else 2

    def seed(self, mm_hashes: Sequence[str] = ()) -> bytes:
        return chain_seed(self.namespace, self.block_size, mm_hashes)

    def stage(self, layers: range) -> Stage:
        return _stage(self.layer_names, layers.start, layers.stop)

    def stages(self, pp_size: int) -> list[Stage]:
        """The stages of a writer with `pp_size` stages (vLLM's default layer split)."""
        n = len(self.layer_names)
        return [self.stage(pp_layer_range(n, rank, pp_size)) for rank in range(pp_size)]

    def stage_of(self, layer_names: Sequence[str]) -> Stage:
        """The stage holding exactly `layer_names` (a run of consecutive model layers)."""
        index = {name: i for i, name in enumerate(self.layer_names)}
        missing = [name for name in layer_names if name not in index]
        if missing:
            raise ValueError(
                f"KV cache layers {missing} are not among the engine's layer names "
                f"{list(self.layer_names)}"
            )
        at = sorted(index[name] for name in layer_names)
        if not at or at != list(range(at[0], at[0] + len(at))):
            raise ValueError(
                f"SharedStorageConnector needs a worker's layers to be consecutive model "
                f"layers (one PP stage); got layers {at}"
            )
        return self.stage(range(at[0], at[-1] + 1))

    def pp_sizes(self, preferred: int) -> list[int]:
        """Writer PP sizes a reader looks for, `preferred` first."""
        sizes = range(1, min(MAX_PROBED_PP, len(self.layer_names)) + 1)
        return sorted({preferred, *sizes}, key=lambda n: (n != preferred, n))

    def value_key(self, block_key: str, stage: Stage, heads: range) -> str:
        return value_key(self.namespace, self.block_size, block_key, stage, heads)

    def value_keys(self, block_keys: list[str], stage: Stage, heads: range) -> list[str]:
        return value_keys(self.namespace, self.block_size, block_keys, stage, heads)
