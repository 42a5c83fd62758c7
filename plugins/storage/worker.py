"""Worker side: load stored blocks into the paged KV cache, and save computed ones.

Loads are synchronous (all in `start_load_kv`, one backend round trip per layer): the IO threads
read and check each layer's values a few layers ahead of the copies into the cache. Saves copy
the layer's blocks out in `save_kv_layer` (a gather into a CPU tensor) and the IO threads encode
and write them while the forward pass goes on; `wait_for_save` returns when the step's
writes are durable. Since nothing reads engine blocks after `save_kv_layer` returns, preempted
blocks are safe at once (`handle_preemptions` has nothing to wait for). Every conversion
between the engine's layout / block size / TP shard and the stored form goes through
`kvx.layouts.convert_blocks`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from kvx.layouts import MLA, Layout, convert_blocks, get_layout
from kvx.plugins.storage.backends.base import StorageBackend
from kvx.plugins.storage.blockformat import (
    HEADER,
    BlockFormatError,
    BlockShape,
    decode_block,
    encode_block,
)
from kvx.plugins.storage.keys import Geometry, shard_ranges
from kvx.plugins.storage.metadata import LoadSpec, StorageMetadata, StoreSpec

import kvx
from kvx.topology import is_primary_holder, physical_head_range

logger = logging.getLogger(__name__)

TOKEN_MAJOR = Layout(
    "KVX_STORAGE_TOKEN_MAJOR",
    shape=("blocks", "tokens", "kv", "heads", "head_size"),
    memory=("blocks", "tokens", "kv", "heads", "head_size"),
    summary="the stored block payload: [tokens, K|V, heads, head_size] per block",
)


class _Budget:
    """Bytes the writer may hold at once; a save waits for room (one oversized job may run
    alone)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


@dataclass
class _Fetched:
    """One layer's values as read: a decoded block or the reason it is unusable, per value."""

    wanted: list[tuple[_Load, int, range, str]]
    blocks: list[torch.Tensor | BlockFormatError]
    error: Exception | None = None  # the read itself failed


@dataclass
class _Load:
    """One request's load on this rank: its staging tokens and the first bad stored block."""

    spec: LoadSpec
    parts: list[list[range]]  # per stored block: the shards holding heads of this rank
    staging: torch.Tensor  # [len(block_ids) * engine block size, kv, heads, head_size]
    bad: int = field(init=False)

    def __post_init__(self) -> None:
        self.bad = len(self.spec.keys)


class StorageWorker:
    def __init__(
        self,
        geometry: Geometry,
        backend: StorageBackend,
        ctx: kvx.EngineContext,
        *,
        verify_checksums: bool,
        io_threads: int,
        max_inflight_bytes: int,
    ) -> None:
        self.geo = geometry
        self.backend = backend
        self.verify = verify_checksums
        self.layout = get_layout("MLA" if geometry.mla else ctx.cache.layout)
        if self.layout.is_cross_layer:
            raise ValueError(
                f"SharedStorageConnector takes per-layer KV tensors; layout {self.layout.name!r} "
                "is a cross-layer layout"
            )
        self.stored_layout = MLA if geometry.mla else TOKEN_MAJOR
        par = ctx.parallel
        self.heads = physical_head_range(geometry.total_heads, par.tp_size, par.tp_rank)
        self.writer = is_primary_holder(geometry.total_heads, par.tp_size, par.tp_rank)
        self.dtype = getattr(torch, geometry.dtype)
        self.caches: dict[str, torch.Tensor] = {}
        self._io_threads = io_threads
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvx-storage-io")
        self._budget = _Budget(max_inflight_bytes)
        self._pending: list[Future[None]] = []
        self._load_errors: set[int] = set()
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()

    # -- registration ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, tensor in kv_caches.items():
            sizes = self.layout.sizes_of(tensor)
            want = {"tokens": self.geo.engine_block_size, "head_size": self.geo.head_size}
            if not self.geo.mla:
                want["heads"] = len(self.heads)
            got = {dim: sizes[dim] for dim in want}
            if got != want or tensor.dtype != self.dtype:
                raise ValueError(
                    f"KV cache of layer {name!r} has {got} {tensor.dtype}; the engine context "
                    f"says {want} {self.dtype}"
                )
        self.caches = dict(kv_caches)

    # -- loads -----------------------------------------------------------------------------

    def start_load_kv(self, meta: StorageMetadata) -> None:
        loads = [self._plan_load(spec) for spec in meta.loads]
        if not loads:
            return
        if not self.caches:
            raise RuntimeError("start_load_kv with loads before register_kv_caches")
        self._load_layers(loads)
        for load in loads:
            spec = load.spec
            if load.bad < len(spec.keys):
                bad_token = max(spec.start, (spec.first_block + load.bad) * self.geo.block_size)
                first_bad = (bad_token - spec.start) // self.geo.engine_block_size
                self._load_errors.update(spec.block_ids[first_bad:])
                self._count(load_errors=len(spec.block_ids) - first_bad)
            self._count(loaded_tokens=self._valid_tokens(load))

    def _plan_load(self, spec: LoadSpec) -> _Load:
        parts = [
            [r for r in shard_ranges(self.geo.total_heads, n) if _overlap(r, self.heads)]
            for n in spec.shards
        ]
        tokens = len(spec.block_ids) * self.geo.engine_block_size
        shape = (tokens, self.geo.kv_parts, len(self.heads), self.geo.head_size)
        return _Load(spec, parts, torch.empty(shape, dtype=self.dtype))

    def _load_layers(self, loads: list[_Load]) -> None:
        """Layers are read and checked (`_fetch`) on the IO threads, a few ahead, while this
        thread copies the finished ones into the cache in layer order (`_apply`)."""
        layers = list(self.caches)
        window = self._io_threads + 1
        fetches: deque[Future[_Fetched]] = deque()
        try:
            for i, layer in enumerate(layers):
                while len(fetches) < window and i + len(fetches) < len(layers):
                    ahead = layers[i + len(fetches)]
                    fetches.append(
                        self._pool.submit(self._fetch, ahead, self._wanted(ahead, loads))
                    )
                self._apply(self.caches[layer], loads, fetches.popleft().result())
        finally:
            for future in fetches:  # after an unexpected error: no read outlives the call
                future.cancel()
                with contextlib.suppress(Exception):
                    future.result()

    def _wanted(self, layer: str, loads: list[_Load]) -> list[tuple[_Load, int, range, str]]:
        """(load, stored block, head shard, storage key) of every value `layer` needs."""
        return [
            (load, j, heads, self.geo.value_key(key, layer, heads))
            for load in loads
            for j, key in enumerate(load.spec.keys[: load.bad])
            for heads in load.parts[j]
        ]

    def _fetch(self, layer: str, wanted: list[tuple[_Load, int, range, str]]) -> _Fetched:
        """Read and decode the values (an IO thread); a failed read is returned, not raised."""
        if not wanted:
            return _Fetched(wanted, [])
        shapes = {heads: self._shape(heads) for _, _, heads, _ in wanted}
        limit = max(s.value_bytes for s in shapes.values())
        try:
            values = self.backend.get_many([name for *_, name in wanted], limit)
        except Exception as exc:  # an unreachable store fails these loads, not the engine step
            return _Fetched(wanted, [], exc)
        blocks: list[torch.Tensor | BlockFormatError] = []
        for (_, _, heads, name), data in zip(wanted, values, strict=True):
            try:
                blocks.append(decode_block(name, data, shapes[heads], verify=self.verify))
            except BlockFormatError as exc:
                blocks.append(exc)
        return _Fetched(wanted, blocks)

    def _apply(self, cache: torch.Tensor, loads: list[_Load], fetched: _Fetched) -> None:
        """Place one layer's good blocks up to each load's first bad one, then write them."""
        if fetched.error is not None:
            logger.warning(
                "kvx storage: reading KV blocks from %s failed: %s: %s",
                self.backend.url,
                type(fetched.error).__name__,
                fetched.error,
            )
            for load, *_ in fetched.wanted:
                load.bad = 0  # later layers skip it; every block is reported as a load error
            return
        for (load, j, heads, _), block in zip(fetched.wanted, fetched.blocks, strict=True):
            if j >= load.bad:
                continue
            if isinstance(block, BlockFormatError):
                logger.warning(
                    "kvx storage: load of request %s failed: %s", load.spec.req_id, block
                )
                load.bad = j
                continue
            self._place(load, j, heads, block)
            self._count(loaded_bytes=HEADER.size + block.numel() * block.element_size())
        for load in loads:
            valid = self._valid_tokens(load)
            if valid:
                self._write_cache(load, cache, valid)

    def _place(self, load: _Load, j: int, heads: range, block: torch.Tensor) -> None:
        """Copy the part of stored block `j` inside the load's tokens and this rank's heads."""
        spec, bs = load.spec, self.geo.block_size
        first = (spec.first_block + j) * bs
        lo, hi = max(first, spec.start), min(first + bs, spec.start + spec.num_tokens)
        h_lo, h_hi = max(heads.start, self.heads.start), min(heads.stop, self.heads.stop)
        load.staging[
            lo - spec.start : hi - spec.start, :, h_lo - self.heads.start : h_hi - self.heads.start
        ] = block[lo - first : hi - first, :, h_lo - heads.start : h_hi - heads.start]

    def _valid_tokens(self, load: _Load) -> int:
        spec = load.spec
        end = (spec.first_block + load.bad) * self.geo.block_size
        return max(0, min(spec.num_tokens, end - spec.start))

    def _write_cache(self, load: _Load, cache: torch.Tensor, valid: int) -> None:
        ebs = self.geo.engine_block_size
        blocks = -(-valid // ebs)
        src = self._blocked(load.staging)
        convert_blocks(
            src,
            cache,
            range(blocks),
            load.spec.block_ids[:blocks],
            src_layout=self.stored_layout,
            dst_layout=self.layout,
            num_tokens=valid,
        )

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -----------------------------------------------------------------------------

    def save_kv_layer(self, layer: str, kv_layer: torch.Tensor, meta: StorageMetadata) -> None:
        if not self.writer or not meta.stores:
            return
        gathered = [(spec, self._gather(kv_layer, spec)) for spec in meta.stores]
        size = sum(t.numel() * t.element_size() for _, t in gathered)
        self._budget.acquire(size)
        try:
            future = self._pool.submit(self._write, layer, gathered, size)
        except BaseException:
            self._budget.release(size)
            raise
        self._pending.append(future)

    def _gather(self, kv_layer: torch.Tensor, spec: StoreSpec) -> torch.Tensor:
        """The spec's engine blocks as token-major CPU tokens `[tokens, kv, heads, head_size]`."""
        n, ebs = len(spec.block_ids), self.geo.engine_block_size
        shape = (n * ebs, self.geo.kv_parts, len(self.heads), self.geo.head_size)
        tokens = torch.empty(shape, dtype=self.dtype)
        convert_blocks(
            kv_layer,
            self._blocked(tokens),
            spec.block_ids,
            range(n),
            src_layout=self.layout,
            dst_layout=self.stored_layout,
        )
        return tokens

    def _write(self, layer: str, gathered: list[tuple[StoreSpec, torch.Tensor]], size: int) -> None:
        try:
            bs, shape = self.geo.block_size, self._shape(self.heads)
            items = []
            for spec, tokens in gathered:
                for j, key in enumerate(spec.keys):
                    t = (spec.first_block + j) * bs - spec.block_ids_start
                    name = self.geo.value_key(key, layer, self.heads)
                    items.append((name, encode_block(name, shape, tokens[t : t + bs])))
            self.backend.put_many(items)
            self._count(saved_blocks=len(items), saved_bytes=len(items) * shape.value_bytes)
        finally:
            self._budget.release(size)

    def wait_for_save(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            try:
                future.result()
            except Exception as exc:
                self._count(save_errors=1)
                logger.warning(
                    "kvx storage: writing KV blocks to %s failed: %s: %s",
                    self.backend.url,
                    type(exc).__name__,
                    exc,
                )

    # -- misc ------------------------------------------------------------------------------

    def take_stats(self) -> kvx.KVConnectorStats | None:
        with self._stats_lock:
            data, self._stats = dict(self._stats), Counter()
        return kvx.KVConnectorStats(data) if data else None

    def shutdown(self) -> None:
        self.wait_for_save()
        self._pool.shutdown(wait=True)
        self.backend.close()

    def _count(self, **counts: int) -> None:
        with self._stats_lock:
            self._stats.update(counts)

    def _shape(self, heads: range) -> BlockShape:
        g = self.geo
        return BlockShape(
            g.dtype, g.block_size, g.kv_parts, g.total_heads, heads, g.head_size, mla=g.mla
        )

    def _blocked(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token-major staging as engine-sized blocks in the stored layout (a view)."""
        ebs = self.geo.engine_block_size
        if self.geo.mla:
            return tokens.view(-1, ebs, self.geo.head_size)
        return tokens.view(-1, ebs, *tokens.shape[1:])


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop
