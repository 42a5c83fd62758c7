"""Scheduler side of the OffloadingConnector: which chunks to load and store, and when a
finished request's blocks may be freed."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from typing import Any, NoReturn

import kvx
from kvx import ConnectorScheduler, KVConnectorOutput, RequestTracker
from kvx.plugins.offload.config import OffloadingConfig
from kvx.plugins.offload.manager import OffloadingManager
from kvx.plugins.offload.metadata import LoadSpec, OffloadMetadata, OffloadWorkerMeta, StoreSpec

logger = logging.getLogger(__name__)


def chunk_geometry(options: OffloadingConfig, ctx: kvx.EngineContext) -> tuple[int, int, int]:
    """(engine blocks per chunk, chunks the CPU budget holds, chunks the disk budget holds);
    `ConfigError` when the config does not fit this engine or this machine."""
    spec = ctx.cache
    if options.block_size is not None:
        if options.block_size % spec.block_size:
            _refuse(
                "block_size",
                f"{options.block_size} is not a multiple of the engine block size "
                f"{spec.block_size}",
            )
        per_chunk = options.block_size // spec.block_size
    else:
        per_chunk = options.blocks_per_chunk or 1
    heads = 1 if spec.use_mla else max(spec.num_kv_heads, ctx.parallel.tp_size)
    parts = 1 if spec.use_mla else 2
    element = spec.torch_dtype.itemsize
    chunk_bytes = per_chunk * spec.block_size * spec.num_layers * parts * heads * spec.head_size
    chunk_bytes *= element
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if options.num_cpu_blocks is not None:  # vLLM's spelling: offloaded blocks, not bytes
        cpu_bytes = options.num_cpu_blocks * chunk_bytes
        if cpu_bytes > memory:
            _refuse(
                "num_cpu_blocks",
                f"{options.num_cpu_blocks} offloaded blocks of {chunk_bytes} bytes (this "
                f"engine's) are {cpu_bytes} bytes, more than this machine's memory ({memory} "
                "bytes); lower num_cpu_blocks or give cpu_bytes_to_use",
            )
        logger.info(
            "OffloadingConnector: num_cpu_blocks=%d is cpu_bytes_to_use=%d on this engine "
            "(%d bytes per offloaded block)",
            options.num_cpu_blocks,
            cpu_bytes,
            chunk_bytes,
        )
        return per_chunk, options.num_cpu_blocks, _disk_chunks(options, chunk_bytes)
    assert options.cpu_bytes_to_use is not None  # OffloadingConfig: one of the two is set
    if options.cpu_bytes_to_use > memory:
        _refuse(
            "cpu_bytes_to_use",
            f"{options.cpu_bytes_to_use} bytes is more than this machine's memory ({memory} bytes)",
        )
    slots = options.cpu_bytes_to_use // chunk_bytes
    if slots < 1:
        _refuse(
            "cpu_bytes_to_use",
            f"{options.cpu_bytes_to_use} bytes hold no chunk of {chunk_bytes} bytes; "
            "allowed: at least that much",
        )
    return per_chunk, slots, _disk_chunks(options, chunk_bytes)


def _disk_chunks(options: OffloadingConfig, chunk_bytes: int) -> int:
    disk = (options.disk_bytes_to_use or 0) // chunk_bytes
    if options.disk_url is not None and disk < 1:
        _refuse(
            "disk_bytes_to_use",
            f"{options.disk_bytes_to_use} bytes hold no chunk of {chunk_bytes} bytes",
        )
    return disk


def _refuse(key: str, message: str) -> NoReturn:
    raise kvx.ConfigError([kvx.ConfigProblem(f"kv_connector_extra_config.{key}", message)])


class OffloadScheduler(ConnectorScheduler):
    def __init__(
        self, options: OffloadingConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext
    ) -> None:
        self.block_size = ctx.cache.block_size
        self.per_chunk, slots, disk_chunks = chunk_geometry(options, ctx)
        self.tokens_per_chunk = self.per_chunk * self.block_size
        self.workers = ctx.parallel.world_size
        self.manager = OffloadingManager(
            slots,
            options.eviction_policy,
            options.store_threshold,
            options.max_tracker_size,
            self.tokens_per_chunk,
            disk_chunks,
        )
        # Requests followed from their allocation (their state: the request itself), by
        # their group 0 table; the tables of any further KV-cache group (vLLM's hybrid
        # allocator) in one tracker per group.
        self.requests = RequestTracker[kvx.Request]("kvx offload")
        self.groups = [
            RequestTracker[bool](f"kvx offload group {g}") for g in range(1, ctx.cache.num_groups)
        ]
        self.offered_chunks: dict[str, int] = {}
        self.inflight: dict[str, set[str]] = {}  # request -> chunk keys being stored
        self.loading: dict[str, list[str]] = {}
        self.local_tokens: dict[str, int] = {}  # request -> engine's own tokens, when it loads
        self.acks: dict[str, int] = {}
        self.failed_acks: set[str] = set()  # chunks some worker failed to store
        self._loads: list[LoadSpec] = []
        self._held: list[str] = []
        self._spills: list[tuple[str, int]] = []
        self._disk_drops: list[str] = []

    def chunk_keys(self, request: kvx.Request) -> list[str]:
        """One key per full chunk: the chained hash of the chunk's last block."""
        hashes = request.block_hashes
        return [
            hashes[(c + 1) * self.per_chunk - 1].hex() for c in range(len(hashes) // self.per_chunk)
        ]

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        keys = self.chunk_keys(request)
        first = num_computed_tokens // self.tokens_per_chunk
        hits = self.manager.lookup(keys[first:])
        count = max(0, (first + hits) * self.tokens_per_chunk - num_computed_tokens)
        if count:  # the tokens the engine has itself (with a sliding window its table cannot say)
            self.local_tokens[request.request_id] = num_computed_tokens
        return count, count > 0

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        table = self.requests.track(req_id, blocks.get_block_ids()[0], request).block_ids
        tables = [table] + [
            t.track(req_id, blocks.get_block_ids()[g], True).block_ids
            for g, t in enumerate(self.groups, 1)
        ]
        if num_external_tokens == 0:
            return
        hashed = (blocks.num_hashed_blocks or (0,))[0]
        local = self.local_tokens.pop(req_id, hashed * self.block_size)
        # Past the prefix hits and the null blocks outside a sliding window: never loaded into
        # (each group's own: a sliding group's table skips more than a full one's).
        firsts = [max(local // self.block_size, kvx.skipped_blocks(t)) for t in tables]
        first_block = min(firsts)
        last_block = math.ceil((local + num_external_tokens) / self.block_size)
        if first_block >= last_block:
            return
        keys = self.chunk_keys(request)
        chunks = sorted({b // self.per_chunk for b in range(first_block, last_block)})
        where = dict(zip(chunks, self.manager.prepare_load([keys[c] for c in chunks]), strict=True))
        self.loading[req_id] = [keys[c] for c in chunks]
        span = range(first_block, last_block)
        slots = [where[b // self.per_chunk] for b in span]
        targets = [[t[b] if b >= f else -1 for b in span] for t, f in zip(tables, firsts)]
        self._loads.append(
            LoadSpec(
                req_id,
                targets[0],
                [-1 if s is None else s for s in slots],
                [b % self.per_chunk for b in span],
                [keys[b // self.per_chunk] if s is None else "" for b, s in zip(span, slots)],
                targets[1:],
            )
        )
        # Chunks being loaded are already stored: never offer them again.
        self.offered_chunks[req_id] = max(self.offered_chunks.get(req_id, 0), chunks[-1] + 1)

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> OffloadMetadata:
        stores = []
        others = [
            {s.req_id: s.block_ids for s in t.scheduled(kvx.one_group_output(scheduler_output, g))}
            for g, t in enumerate(self.groups, 1)
        ]
        for step in self.requests.scheduled(scheduler_output):
            if step.resumed:
                self.offered_chunks[step.req_id] = 0
            done = step.num_computed_tokens + step.num_scheduled_tokens
            tables = [step.block_ids] + [group.get(step.req_id, []) for group in others]
            store = self._stores_for(step.state, tables, done)
            if store is not None:
                stores.append(store)
        meta = OffloadMetadata(self._loads, stores, self._held, self._spills, self._disk_drops)
        self._loads, self._held, self._spills, self._disk_drops = [], [], [], []
        return meta

    def _stores_for(
        self, request: kvx.Request, tables: list[list[int]], computed: int
    ) -> StoreSpec | None:
        """The chunks `computed` tokens complete, from every group's table (`tables`)."""
        req_id = request.request_id
        keys = self.chunk_keys(request)
        whole = min(len(t) for t in tables) // self.per_chunk
        complete = min(computed // self.tokens_per_chunk, len(keys), whole)
        # Chunks with a null block in any group (outside a sliding window) hold no KV there:
        # never stored.
        live = max(-(-kvx.skipped_blocks(t) // self.per_chunk) for t in tables)
        start = max(self.offered_chunks.get(req_id, 0), live)
        if complete <= start:
            return None
        self.offered_chunks[req_id] = complete
        plan = self.manager.prepare_store(keys[start:complete])
        if plan is None or not plan.keys:
            return None
        self._spills += plan.spills
        self._disk_drops += plan.disk_drops
        blocks: list[list[int]] = [[] for _ in tables]
        for key in plan.keys:
            c = keys.index(key, start)
            for table, out in zip(tables, blocks, strict=True):
                out += table[c * self.per_chunk : (c + 1) * self.per_chunk]
        self.inflight.setdefault(req_id, set()).update(plan.keys)
        return StoreSpec(req_id, plan.keys, plan.slots, blocks[0], blocks[1:])

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, OffloadWorkerMeta):
            for failed, counts in ((False, meta.stored), (True, meta.failed)):
                for key, count in counts.items():
                    self.acks[key] = self.acks.get(key, 0) + count
                    if failed:  # one worker's failure fails the chunk, whatever comes later
                        self.failed_acks.add(key)
                    if self.acks[key] >= self.workers:
                        del self.acks[key]
                        ok = key not in self.failed_acks
                        self.failed_acks.discard(key)
                        self.manager.complete_store([key], success=ok)
                        for keys in self.inflight.values():
                            keys.discard(key)
            for key, reason in meta.spill_failed.items():
                self.manager.spill_failed(key, reason)
        for req_id in output.finished_recving or ():
            self.manager.complete_load(self.loading.pop(req_id, []))

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self.requests.forget(req_id)
        for group in self.groups:
            group.forget(req_id)
        self.offered_chunks.pop(req_id, None)
        self.local_tokens.pop(req_id, None)
        if self.inflight.pop(req_id, set()):
            self._held.append(req_id)
            return True, None
        return False, None

    def request_finished_all_groups(
        self, request: kvx.Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Held or not as a whole: chunks hold every group's blocks."""
        return self.request_finished(request, block_ids[0])

    def take_events(self) -> Iterable[kvx.KVCacheEvent]:
        return self.manager.take_events()

    def reset_cache(self) -> bool:
        return self.manager.reset()
