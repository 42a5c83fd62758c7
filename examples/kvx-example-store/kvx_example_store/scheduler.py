"""The scheduler half: answers how much of a prompt the store holds, and plans each step's
loads (before the forward) and stores (of the full prompt blocks the forward computes)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import kvx
from kvx import PlanningScheduler, RequestTracker, ScheduledRequest
from kvx_example_store.config import ExampleStoreConfig
from kvx_example_store.db import open_store
from kvx_example_store.keys import block_keys, engine_prefix
from kvx_example_store.metadata import BlockRun, ExampleStoreMetadata

MAX_KEYS_PER_QUERY = 500  # below SQLite's limit of bound parameters


@dataclass
class _Prompt:
    prompt_len: int
    keys: list[str]  # of the prompt's full blocks


class ExampleStoreScheduler(PlanningScheduler[_Prompt, ExampleStoreMetadata]):
    """Loads are synchronous: the blocks are read in `start_load_kv` of the step that counts
    them computed. A producer (or kv_both) stores, a consumer (or kv_both) loads."""

    def __init__(
        self, options: ExampleStoreConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext
    ) -> None:
        self.block_size = ctx.cache.block_size
        self.prefix = engine_prefix(ctx)
        self.parts = ctx.parallel.tp_size * ctx.parallel.pp_size  # rows per stored block
        self.save = config.is_kv_producer
        self.load = config.is_kv_consumer
        self.requests = RequestTracker("ExampleStoreConnector", self._start)
        self._db = open_store(options.directory, options.busy_timeout_s)
        self._lock = threading.Lock()

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens of the stored whole blocks after the engine's own hit, never the last prompt
        token (the engine must compute one to sample from). Only reads the store."""
        bs = self.block_size
        last = (request.num_prompt_tokens - 1) // bs  # blocks before the last prompt token
        first = num_computed_tokens // bs
        if not self.load or last <= first:
            return 0, False
        keys = block_keys(self.prefix, request.prompt_token_ids, request.mm_hashes, bs)
        found = self._stored_run(keys[first:last])
        return max(0, (first + found) * bs - num_computed_tokens), False

    def _stored_run(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, every worker rank has stored."""
        run = 0
        for start in range(0, len(keys), MAX_KEYS_PER_QUERY):
            batch = keys[start : start + MAX_KEYS_PER_QUERY]
            marks = ",".join("?" * len(batch))
            query = (
                f"SELECT key FROM blocks WHERE key IN ({marks}) GROUP BY key HAVING COUNT(*) = ?"
            )
            with self._lock:
                complete = {row[0] for row in self._db.execute(query, [*batch, self.parts])}
            for key in batch:
                if key not in complete:
                    return run
                run += 1
        return run

    def _start(self, new: kvx.NewRequestData) -> _Prompt:
        prompt = list(new.prompt_token_ids)
        keys = block_keys(self.prefix, prompt, list(new.mm_hashes), self.block_size)
        return _Prompt(len(prompt), keys)

    def plan(self, meta: ExampleStoreMetadata, step: ScheduledRequest[_Prompt]) -> None:
        """The load `update_state_after_alloc` recorded (tokens counted computed already), and
        the prompt blocks this step's tokens complete. Table entries outside a sliding window
        (`kvx.NULL_BLOCK`) hold no KV: neither loaded nor stored."""
        bs, computed, keys = self.block_size, step.num_computed_tokens, step.state.keys
        if step.num_external_tokens:
            first = (computed - step.num_external_tokens) // bs
            meta.loads.append(self._run(step, first, computed // bs))
        done = min(computed + step.num_scheduled_tokens, step.state.prompt_len) // bs
        if self.save and done > computed // bs:
            meta.stores.append(self._run(step, computed // bs, min(done, len(keys))))

    @staticmethod
    def _run(step: ScheduledRequest[_Prompt], first: int, last: int) -> BlockRun:
        pairs = [
            (block, key)
            for block, key in zip(step.block_ids[first:last], step.state.keys[first:last])
            if block != kvx.NULL_BLOCK
        ]
        return BlockRun(step.req_id, [b for b, _ in pairs], [k for _, k in pairs])

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are committed by the step's `wait_for_save`: blocks are never held."""
        self.requests.forget(request.request_id)
        return False, None

    def shutdown(self) -> None:
        with self._lock:
            self._db.close()
