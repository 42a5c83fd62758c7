"""Scheduler side of LMCacheConnectorV1: how much of a prompt LMCache holds (asked of the
workers), which tokens to load into which blocks, and which whole chunks to store.

Like vLLM's LMCache integration, loads never cover the last prompt token and stores cover
prompt tokens only, in whole chunks (and the prompt's last, partial chunk when
`save_unfull_chunk` is set). Loads are synchronous: they finish inside the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import kvx
from kvx import (
    BlockStored,
    KVCacheEvent,
    KVConnectorOutput,
    PlanningScheduler,
    RequestTracker,
    ScheduledRequest,
)
from kvx.plugins.lmcache.config import LMCacheConfig
from kvx.plugins.lmcache.lookup import LookupClient, socket_path
from kvx.plugins.lmcache.metadata import (
    LMCacheMetadata,
    LMCacheWorkerMeta,
    LoadSpec,
    StoredChunk,
    StoreSpec,
)


@dataclass
class _Request:
    prompt: list[int]
    stored: int  # prompt tokens known to be in LMCache (chunk-aligned, or the whole prompt)


class LMCacheScheduler(PlanningScheduler[_Request, LMCacheMetadata]):
    def __init__(
        self, options: LMCacheConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext
    ) -> None:
        parallel = ctx.parallel
        self.workers = parallel.tp_size * parallel.pp_size
        paths = [socket_path(ctx.engine_id, rank) for rank in range(self.workers)]
        self.client = LookupClient(paths, options.lookup_timeout_s)
        self.block_size = ctx.cache.block_size
        self.chunk = options.chunk_size
        self.save_unfull = options.save_unfull_chunk
        self.store = config.is_kv_producer
        self.load = config.is_kv_consumer  # a pure producer (kv_producer) never loads
        self.medium = options.medium()
        self.requests = RequestTracker(
            "kvx lmcache", lambda new: _Request(list(new.prompt_token_ids), 0)
        )
        self._hits: dict[str, int] = {}  # this step: request -> prompt tokens LMCache holds
        self._acks: dict[int, int] = {}  # chunk hash -> workers that stored it so far
        self._chunks: dict[int, StoredChunk] = {}
        self._events: list[KVCacheEvent] = []

    # -- contract --------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens LMCache holds beyond `num_computed_tokens`, engine-block aligned and never
        the last prompt token; loads are synchronous; nothing for a pure producer."""
        prompt = request.prompt_token_ids
        cap = (len(prompt) - 1) // self.block_size * self.block_size
        if not self.load or cap <= num_computed_tokens:
            return 0, False
        hit = self.client.lookup(list(prompt))
        self._hits[request.request_id] = hit
        end = min(hit, cap) // self.block_size * self.block_size
        return max(0, end - num_computed_tokens), False

    def step_planned(self) -> None:
        self._hits.clear()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """A chunk becomes a `BlockStored` event once every worker stored its share."""
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, LMCacheWorkerMeta):
            return
        for chunk_hash, count in meta.counts.items():
            self._chunks.setdefault(chunk_hash, meta.chunks[chunk_hash])
            acks = self._acks.get(chunk_hash, 0) + count
            if acks < self.workers:
                self._acks[chunk_hash] = acks
                continue
            self._acks.pop(chunk_hash, None)
            chunk = self._chunks.pop(chunk_hash)
            self._events.append(
                BlockStored(
                    block_hashes=(chunk_hash,),
                    parent_block_hash=chunk.parent,
                    token_ids=tuple(chunk.token_ids),
                    block_size=len(chunk.token_ids),
                    medium=self.medium,
                )
            )

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Stores finish inside the step that computed the tokens: blocks are never held."""
        self.requests.forget(request.request_id)
        self._hits.pop(request.request_id, None)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        self.client.close()

    # -- helpers ---------------------------------------------------------------------------

    def plan(self, meta: LMCacheMetadata, step: ScheduledRequest[_Request]) -> None:
        """Add the request's load (the tokens just counted as computed) and the chunks its
        scheduled prompt tokens complete this step; tokens in null blocks (outside a sliding
        window) are neither loaded nor stored."""
        state, computed = step.state, step.num_computed_tokens
        prompt = state.prompt
        hit = self._hits.get(step.req_id, 0)
        if hit:  # LMCache holds the prompt's chunks up to `hit`: never store them again
            held = hit if hit == len(prompt) else hit // self.chunk * self.chunk
            state.stored = max(state.stored, held)
        # Tokens before `live` sit in null blocks (outside a sliding window): no KV there.
        live = kvx.skipped_blocks(step.block_ids) * self.block_size
        n_ext = step.num_external_tokens
        if n_ext and live < computed:
            fetch = max(hit, computed)
            start = max(computed - n_ext, live)
            meta.loads.append(
                LoadSpec(step.req_id, prompt[:fetch], list(step.block_ids), start, computed)
            )
        state.stored = max(state.stored, -(-live // self.chunk) * self.chunk)
        if not self.store or not step.num_scheduled_tokens:
            return
        done = min(computed + step.num_scheduled_tokens, len(prompt))
        end = done if self.save_unfull and done == len(prompt) else done // self.chunk * self.chunk
        if end > state.stored:
            meta.stores.append(
                StoreSpec(step.req_id, prompt[:end], list(step.block_ids), state.stored)
            )
            state.stored = end
