"""Worker side of LMCacheConnectorV1: LMCache stores and retrieves through this worker's engine.

Whole-chunk mode loads in `start_load_kv` and stores in `wait_for_save`, synchronously, so a
finished prompt's chunks are in LMCache when its step ends (a prefill engine hands off by
storing). Layer-wise mode drives LMCache's per-layer generators from the layer hooks: layer `i`
is written into the paged cache in `wait_for_layer_load(i)` while layer `i + 1` is fetched,
and copied out in `save_kv_layer(i)` while layer `i - 1` is put.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from typing import Any

import numpy as np
import torch

import kvx
from kvx import ConnectorWorker
from kvx.layouts import get_layout
from kvx.plugins.lmcache.config import LMCacheConfig
from kvx.plugins.lmcache.engine import acquire_engine, global_rank, release_engine
from kvx.plugins.lmcache.lookup import LookupServer, socket_path
from kvx.plugins.lmcache.metadata import (
    LMCacheMetadata,
    LMCacheWorkerMeta,
    LoadSpec,
    StoredChunk,
    StoreSpec,
)
from kvx.plugins.lmcache.stats import LMCacheStats

logger = logging.getLogger(__name__)


def slot_mapping(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Paged slot of each of `num_tokens` tokens (-1 past the blocks given and in a
    `kvx.NULL_BLOCK`, outside a sliding window). Built in numpy: a handful of torch calls on
    small tensors cost more than the copy of a short request."""
    starts = np.array(block_ids, dtype=np.int64)
    starts *= block_size
    slots = np.add.outer(starts, np.arange(block_size, dtype=np.int64))
    slots[starts < 0] = -1
    slots = slots.ravel()
    if len(slots) >= num_tokens:
        return torch.from_numpy(slots[:num_tokens])
    return torch.from_numpy(np.concatenate([slots, np.full(num_tokens - len(slots), -1)]))


def prefix_mask(num_tokens: int, skip: int) -> torch.Tensor:
    """LMCache's token mask: False for the first `skip` tokens (chunk-aligned), True after."""
    mask = torch.ones(num_tokens, dtype=torch.bool)
    if skip:
        mask[:skip] = False
    return mask


def token_list(token_ids: list[int]) -> list[int]:
    """Token ids as LMCache takes them cheapest: a list (it hashes and reports chunks of a
    tensor by converting the whole tensor to a list, per chunk)."""
    return token_ids if isinstance(token_ids, list) else list(token_ids)


class _LayerwiseLoad:
    def __init__(self, load: LoadSpec, steps: Generator[Any, None, None]) -> None:
        self.load = load
        self.steps = steps
        self.failed = False


class LMCacheWorker(ConnectorWorker[LMCacheMetadata]):
    def __init__(
        self, options: LMCacheConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext
    ) -> None:
        if ctx.cache.use_mla:
            raise ValueError("LMCacheConnectorV1 on kvx copies K/V layouts; MLA is not supported")
        self.options = options
        self.ctx = ctx
        self.layout = get_layout(ctx.cache.layout, ctx.registry)
        self.block_size = ctx.cache.block_size
        self.chunk = options.chunk_size
        self.stats = LMCacheStats()
        self.pool_key: str | None = None
        self.engine: Any = None
        self.tensors: list[torch.Tensor] = []
        self.token_bytes = 0
        self.layer_index: dict[str, int] = {}
        self.server: LookupServer | None = None
        self._load_errors: set[int] = set()
        self._stored = LMCacheWorkerMeta()
        self._loads: list[_LayerwiseLoad] = []
        self._stores: list[tuple[StoreSpec, Generator[None, None, None]]] = []
        self._stores_started = False

    # -- set-up ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.tensors = list(kv_caches.values())
        slots = self.ctx.cache.num_blocks * self.block_size
        total = sum(t.numel() * t.element_size() for t in self.tensors)
        self.token_bytes = total // slots if slots else 0  # this rank's KV bytes per token
        self.pool_key, self.engine = acquire_engine(
            self.options, self.ctx, self.layout, self.tensors
        )
        path = socket_path(self.ctx.engine_id, global_rank(self.ctx.parallel))
        self.server = LookupServer(path, self._lookup)

    def _lookup(self, tokens: list[int]) -> int:
        """Runs on the lookup thread (LMCache's lookup is safe beside a store)."""
        return int(self.engine.lookup(torch.tensor(tokens, dtype=torch.long)))

    def _kwargs(self, token_count: int, block_ids: list[int]) -> dict[str, Any]:
        return {
            "kvcaches": self.tensors,
            "slot_mapping": slot_mapping(block_ids, self.block_size, token_count),
        }

    # -- loads -----------------------------------------------------------------------------

    def start_load_kv(self, meta: LMCacheMetadata) -> None:
        for load in meta.loads:
            tokens = token_list(load.token_ids)
            kwargs = self._kwargs(len(tokens), load.block_ids)
            slots = kwargs["slot_mapping"]
            if load.start:
                slots[: load.start] = -1  # computed already (prefix cache): not ours to write
            if load.end < len(tokens):
                slots[load.end :] = -1
            mask = prefix_mask(len(tokens), load.start // self.chunk * self.chunk)
            if self.options.use_layerwise:
                steps = self.engine.retrieve_layer(tokens, mask, **kwargs)
                pending = _LayerwiseLoad(load, steps)
                try:
                    found = next(steps)  # fetches layer 0
                    if found is None or int(found) < load.end - load.start:
                        raise LookupError(f"{int(found or 0)} tokens found")
                except Exception as exc:
                    self._fail(load, f"layer-wise retrieve: {type(exc).__name__}: {exc}")
                    pending.failed = True
                    steps.close()
                self._loads.append(pending)
                continue
            with self.stats.timed("load", load.end - load.start, self.token_bytes):
                try:
                    got = self.engine.retrieve(tokens, mask, **kwargs)
                except Exception as exc:
                    self._fail(load, f"retrieve: {type(exc).__name__}: {exc}")
                    continue
            self._check(load, got)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: write this layer of every load of the step (the next one is fetched)."""
        if not self._loads:
            return
        for pending in self._loads:
            if pending.failed:
                continue
            try:
                next(pending.steps)
            except Exception as exc:
                pending.failed = True
                self._fail(pending.load, f"layer {layer_name}: {type(exc).__name__}: {exc}")
        if self.layer_index[layer_name] == len(self.tensors) - 1:
            self._finish_loads()

    def _finish_loads(self) -> None:
        """Layer-wise: run every load of the step to its end and check what came back."""
        for pending in self._loads:
            if pending.failed:
                continue
            got = None
            try:
                for step in pending.steps:  # remaining layers, then the retrieved-token mask
                    got = step
            except Exception as exc:
                self._fail(pending.load, f"layer-wise retrieve: {type(exc).__name__}: {exc}")
                continue
            self._check(pending.load, got)
            self.stats.moved("load", pending.load.end - pending.load.start, self.token_bytes)
        self._loads = []

    def _check(self, load: LoadSpec, got: Any) -> None:
        """Every token in `[start, end)` must have come back; else its blocks are load errors."""
        if got is None:
            self._fail(load, "LMCache returned no token mask")
            return
        got = torch.as_tensor(got, dtype=torch.bool)
        if load.start == 0 and load.end == len(got) and bool(got.all()):
            return  # the common case, without slicing (a slice costs more than `all`)
        span = got[load.start : load.end]
        if len(span) == load.end - load.start and bool(span.all()):
            return
        missing = load.start + (int((~span).nonzero()[0]) if len(span) else 0)
        self._fail(load, f"tokens from {missing} of [{load.start}, {load.end}) missing", missing)

    def _fail(self, load: LoadSpec, why: str, first_missing: int | None = None) -> None:
        start = load.start if first_missing is None else first_missing
        blocks = load.block_ids[start // self.block_size : -(-load.end // self.block_size)]
        logger.warning(
            "kvx lmcache: load of request %s failed (%s); blocks %s reported as load errors",
            load.req_id,
            why,
            blocks,
        )
        self._load_errors.update(blocks)
        self.stats.count("load_errors")

    # -- stores ----------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: LMCacheMetadata) -> None:
        """Layer-wise: copy this layer of every store of the step out (the previous one is
        put into LMCache's backends meanwhile)."""
        if not self.options.use_layerwise or not meta.stores:
            return
        if not self._stores_started:
            self._stores_started = True
            for store in meta.stores:
                tokens = token_list(store.token_ids)
                kwargs = self._kwargs(len(tokens), store.block_ids)
                mask = prefix_mask(len(tokens), store.start)
                steps = self.engine.store_layer(tokens, mask, **kwargs)
                next(steps)  # allocates every layer's chunks
                self._stores.append((store, steps))
        for _, steps in self._stores:
            next(steps, None)

    def wait_for_save(self, meta: LMCacheMetadata) -> None:
        """The step's stores, once its forward pass is over (whole-chunk stores are planned in
        this step's metadata)."""
        if self.options.use_layerwise:
            self._finish_loads()  # loads of a step whose layer hooks did not all run
            for store, steps in self._stores:
                for _ in steps:  # layers the hooks did not reach, and the final put
                    pass
                self.stats.moved("store", len(store.token_ids) - store.start, self.token_bytes)
            self._record_events([store for store, _ in self._stores])
            for store, _ in self._stores:
                self._wait_remote(store)
            self._stores, self._stores_started = [], False
            return
        for store in meta.stores:
            tokens = token_list(store.token_ids)
            kwargs = self._kwargs(len(tokens), store.block_ids)
            with self.stats.timed("store", len(tokens) - store.start, self.token_bytes):
                self.engine.store(tokens, mask=prefix_mask(len(tokens), store.start), **kwargs)
                self._wait_remote(store)
        self._record_events(meta.stores)

    def _wait_remote(self, store: StoreSpec) -> None:
        """LMCache puts to a remote tier asynchronously; wait (at most `blocking_timeout_secs`)
        until the remote tier holds the stored tokens, so a decode engine elsewhere finds them
        once this step is over."""
        if self.options.remote_url is None:
            return
        tokens = torch.tensor(store.token_ids, dtype=torch.long)
        deadline = time.monotonic() + self.options.blocking_timeout_secs
        while self.engine.lookup(tokens, search_range=["RemoteBackend"]) < len(tokens):
            if time.monotonic() > deadline:
                logger.warning(
                    "kvx lmcache: %s does not hold request %s's tokens [%d, %d) after %ds",
                    self.options.remote_url,
                    store.req_id,
                    store.start,
                    len(tokens),
                    self.options.blocking_timeout_secs,
                )
                return
            time.sleep(0.001)

    def _record_events(self, stores: list[StoreSpec]) -> None:
        """LMCache's store events (one per chunk, in store order) as this worker's acks."""
        events = list(self.engine.get_kv_events())
        spans = iter(
            (s.token_ids, pos)
            for s in stores
            for pos in range(s.start, len(s.token_ids), self.chunk)
        )
        for event, (token_ids, pos) in zip(events, spans):
            chunk_hash = int(event.block_hashes[0])
            parent = None if pos == 0 else event.parent_block_hash
            self._stored.chunks[chunk_hash] = StoredChunk(
                parent, list(token_ids[pos : pos + event.block_size])
            )
            self._stored.counts[chunk_hash] = self._stored.counts.get(chunk_hash, 0) + 1

    # -- reporting and shutdown --------------------------------------------------------------

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_meta(self) -> LMCacheWorkerMeta | None:
        if not self._stored.counts:
            return None
        meta, self._stored = self._stored, LMCacheWorkerMeta()
        return meta

    def take_stats(self) -> LMCacheStats | None:
        if self.stats.is_empty():
            return None
        stats = LMCacheStats(dict(self.stats.data))
        self.stats.reset()
        return stats

    def shutdown(self) -> None:
        """Always returns: the lookup thread stops and the engine is released (destroyed, if at
        all, with a bound on LMCache's own teardown)."""
        for pending in self._loads:
            pending.steps.close()
        for _, steps in self._stores:
            steps.close()
        self._loads, self._stores = [], []
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.pool_key is not None:
            release_engine(self.pool_key)
            self.pool_key, self.engine = None, None
