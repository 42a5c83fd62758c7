"""The reference engine's scheduler: a small, faithful model of vLLM's V1 scheduler.

It drives the scheduler-side connector exactly where vLLM does: `get_num_new_matched_tokens`
for every waiting request it considers, `update_state_after_alloc` after allocation (also with
0 external tokens), `build_connector_meta` once per step, `request_finished` once per finished
request, `update_connector_output` with the aggregated worker results. It implements prefix
caching by block hash, chunked prefill under a token budget, preemption when blocks run out,
`WAITING_FOR_REMOTE_KVS` with promotion after the load (recomputing the last prompt token),
delay-free blocks held until `finished_sending`, and `kv_load_failure_policy`.

It also records contract violations instead of hiding them (`take_violations`, the rules of
docs/contract.md): a request named in `finished_sending` / `finished_recving` that the engine
does not hold for that transfer (unknown, or reported twice), a connector acting against its
`kv_role` (a pure producer offering tokens to load, a pure consumer holding blocks to send or
offering KV to others), a matched-token count outside the prompt or an asynchronous load of
nothing, and a synchronous load offering every token of a request (vLLM asserts on these; the
engine records each, then carries on with the nearest valid answer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvx.contract.base import KVConnectorBase_V1
from kvx.contract.types import (
    NULL_BLOCK,
    CachedRequestData,
    KVCacheBlocks,
    NewRequestData,
    Request,
    RequestStatus,
    SchedulerOutput,
    skipped_blocks,
)
from kvx.engine.block_pool import BlockPool, block_hashes
from kvx.engine.kv_groups import WindowGroups
from kvx.engine.match_rules import checked_match
from kvx.engine.request_state import RequestState
from kvx.engine.step_results import RequestOutput, StepResults


@dataclass(frozen=True)
class SchedulerConfig:
    """Capacity and policies of one engine's scheduler."""

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    kv_load_failure_policy: str = "fail"
    kv_role: str | None = None  # the connector's role; None: no role checks
    free_list_seed: int | None = None  # start with a shuffled (fragmented) free list
    sliding_window: int | None = None  # tokens attention reads; None: every token
    groups: WindowGroups | None = None  # two KV-cache groups (then sliding_window is None)


class Scheduler(StepResults):
    """Decides each step what to compute, what to load and what to free (what it does with the
    step's results is `StepResults`')."""

    config: SchedulerConfig

    def __init__(self, config: SchedulerConfig, connector: KVConnectorBase_V1 | None = None):
        if config.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(
                "kv_load_failure_policy must be 'fail' or 'recompute', "
                f"got {config.kv_load_failure_policy!r}"
            )
        self.config = config
        self.connector = connector
        # With a sliding window the cache's last block is the null block no request owns (a
        # write through a NULL_BLOCK table entry, tensor index -1, lands there: the engine
        # checks it stays untouched).
        pool_blocks = config.num_blocks - (config.sliding_window is not None)
        self.groups = config.groups
        if self.groups is not None:  # one logical block is a block in each group
            pool_blocks = self.groups.logical_blocks
        self.pool = BlockPool(pool_blocks, config.enable_prefix_caching, config.free_list_seed)
        self.steps = 0
        self.violations: list[str] = []  # contract violations not yet taken
        self.states: dict[str, RequestState] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self._finished_since_last_step: set[str] = set()
        self._recved: set[str] = set()  # finished_recving reported, not yet promoted
        self.recv_steps: dict[str, int] = {}  # request -> step its finished_recving came
        self._failed_recv: set[str] = set()
        self._held_for_send: dict[str, list[int]] = {}
        self._held_for_recv: dict[str, list[int]] = {}
        self._aborted: list[RequestOutput] = []  # reported with the next step's outputs
        self.stats = {
            "preemptions": 0,
            "prefix_hit_tokens": 0,
            "external_tokens": 0,
            "external_blocks": 0,
            "load_errors": 0,
            "min_free_blocks": config.num_blocks,
        }

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.states:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be >= 1")
        need = math.ceil((request.num_prompt_tokens + request.max_tokens) / self.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs up to {need} blocks but the engine has "
                f"{self.pool.num_blocks}; shorten it or give the engine more blocks"
            )
        request.status = RequestStatus.WAITING
        request.block_hashes = block_hashes(request.all_token_ids, self.block_size)
        self.states[request.request_id] = RequestState(request)
        self.waiting.append(request.request_id)
        if self.connector is not None:
            self.connector.on_new_request(request)

    def abort_request(self, request_id: str) -> None:
        state = self.states.get(request_id)
        if state is not None and not state.request.is_finished():
            self._finish(state, RequestStatus.FINISHED_ABORTED)
            self._aborted.append(self._output(state, [], finished=True))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_work(self) -> bool:
        """Unfinished requests, or blocks still held for a connector."""
        return self.has_unfinished_requests() or bool(
            self._held_for_send or self._held_for_recv or self._finished_since_last_step
        )

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self.states[request_id].blocks)

    # -- scheduling ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        for state in self.states.values():
            state.sync_loaded_tokens = 0

        # Running requests first; preempt from the back when blocks run out.
        index = 0
        while index < len(self.running) and budget > 0:
            state = self.states[self.running[index]]
            req = state.request
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            self._skip_outside_window(state, req.num_computed_tokens)
            added = self._grow(state, req.num_computed_tokens + num_new)
            while added is None:
                victim = self.states[self.running[-1]]
                self._preempt(victim)
                preempted.add(victim.request.request_id)
                if victim is state:
                    break
                added = self._grow(state, req.num_computed_tokens + num_new)
            if added is None:
                break
            scheduled[req.request_id] = num_new
            budget -= num_new
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(self.block_tables(added))
            cached.new_token_ids.append(req.output_token_ids[-1:])
            cached.all_token_ids[req.request_id] = req.all_token_ids
            cached.num_computed_tokens.append(req.num_computed_tokens)
            index += 1

        if not preempted:
            self._schedule_waiting(budget, scheduled, new_reqs, cached)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            finished_req_ids=set(self._finished_since_last_step),
            preempted_req_ids=preempted,
        )
        self._finished_since_last_step.clear()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._advance(scheduled)
        self.steps += 1
        self.stats["min_free_blocks"] = min(
            self.stats["min_free_blocks"], self.pool.num_free_blocks
        )
        return out

    def _schedule_waiting(
        self,
        budget: int,
        scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached: CachedRequestData,
    ) -> None:
        for req_id in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            state = self.states[req_id]
            req = state.request
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not self._promote(state):
                continue
            # A promoted request keeps its loaded blocks until it is scheduled, even when it
            # has to wait for more blocks first.
            promoted = state.loaded
            hits: list[int] = []
            n_ext, load_async = 0, False
            if promoted:
                n_local = req.num_computed_tokens
            else:
                max_hit_blocks = (req.num_tokens - 1) // self.block_size
                hits = self.pool.cached_prefix(req.block_hashes[:max_hit_blocks])
                n_local = len(hits) * self.block_size
                if self.connector is not None:
                    n_ext_or_none, load_async = self.connector.get_num_new_matched_tokens(
                        req, n_local
                    )
                    state.asked_later = n_ext_or_none is None
                    if n_ext_or_none is None:
                        continue
                    n_ext, load_async, problems = checked_match(
                        self.config.kv_role, req, n_local, n_ext_or_none, load_async
                    )
                    for problem in problems:
                        self._violate(problem)
            if load_async and n_ext > 0:
                if not self._allocate(state, hits, n_local + n_ext):
                    return
                self._skip_outside_window(state, n_local + n_ext)
                self._after_alloc(state, len(hits), n_ext)
                req.num_computed_tokens = n_local + n_ext
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.stats["prefix_hit_tokens"] += n_local
                self._count_external(n_local, n_ext)
                continue
            num_computed = n_local + n_ext
            num_new = min(req.num_tokens - num_computed, budget)
            if promoted:
                added = self._grow(state, num_computed + num_new)
                if added is None:
                    return
            elif not self._allocate(state, hits, num_computed + num_new):
                return
            self._skip_outside_window(state, num_computed)
            self._after_alloc(state, len(hits), n_ext)
            req.num_computed_tokens = num_computed
            state.sync_loaded_tokens = n_ext
            state.loaded = False
            self.stats["prefix_hit_tokens"] += n_local if not promoted else 0
            self._count_external(n_local, n_ext)
            resumed = state.ever_scheduled
            req.status = RequestStatus.RUNNING
            state.ever_scheduled = True
            self.waiting.remove(req_id)
            self.running.append(req_id)
            scheduled[req_id] = num_new
            budget -= num_new
            if resumed:
                cached.req_ids.append(req_id)
                cached.resumed_req_ids.add(req_id)
                cached.new_block_ids.append(self.block_tables(state.blocks, state.window_skipped))
                cached.new_token_ids.append(list(req.output_token_ids))
                cached.all_token_ids[req_id] = req.all_token_ids
                cached.num_computed_tokens.append(num_computed)
            else:
                new_reqs.append(
                    NewRequestData(
                        req_id,
                        list(req.prompt_token_ids),
                        self.block_tables(state.blocks, state.window_skipped),
                        num_computed,
                        req.kv_transfer_params,
                        list(req.mm_hashes),
                    )
                )

    def _count_external(self, n_local: int, n_ext: int) -> None:
        if n_ext:
            self.stats["external_tokens"] += n_ext
            self.stats["external_blocks"] += (
                math.ceil((n_local + n_ext) / self.block_size) - n_local // self.block_size
            )

    def _skip_outside_window(self, state: RequestState, num_computed: int) -> None:
        """Free the leading blocks no position from `num_computed` on attends to, leaving
        `NULL_BLOCK` in their place (vLLM's `remove_skipped_blocks`: skipped tokens are
        `num_computed - window + 1`). The connector is not told of a running request's.
        With two groups only the window group's entries turn null (its blocks stay reserved)."""
        if self.groups is not None:
            skipped = self.groups.skipped(num_computed, len(state.blocks))
            state.window_skipped = max(state.window_skipped, skipped)
            return
        window = self.config.sliding_window
        if window is None:
            return
        skipped = min(max(0, num_computed - window + 1) // self.block_size, len(state.blocks))
        self.pool.free(state.blocks[:skipped])
        state.blocks[:skipped] = [NULL_BLOCK] * skipped

    def _after_alloc(self, state: RequestState, num_hits: int, n_ext: int) -> None:
        if self.connector is not None:
            tables = self.block_tables(state.blocks, state.window_skipped)
            # null entries need no KV either
            hashed = tuple(max(num_hits, skipped_blocks(table)) for table in tables)
            blocks = KVCacheBlocks(tables, hashed)
            self.connector.update_state_after_alloc(state.request, blocks, n_ext)

    def _allocate(self, state: RequestState, hits: list[int], num_tokens: int) -> bool:
        """Reference `hits` and allocate fresh blocks up to `num_tokens`; False if too few."""
        need = math.ceil(num_tokens / self.block_size) - len(hits)
        if need > self.pool.num_free_blocks - sum(self.pool.ref_cnt[b] == 0 for b in hits):
            return False
        self.pool.touch(hits)
        state.blocks = list(hits) + self.pool.allocate(max(0, need))
        state.window_skipped = 0
        return True

    def _grow(self, state: RequestState, num_tokens: int) -> list[int] | None:
        """Allocate the blocks `num_tokens` need beyond what the request has; None if short."""
        need = math.ceil(num_tokens / self.block_size) - len(state.blocks)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            return None
        added = self.pool.allocate(need)
        state.blocks.extend(added)
        return added

    def _advance(self, scheduled: dict[str, int]) -> None:
        """Count scheduled tokens as computed and cache the blocks they complete."""
        for req_id, num in scheduled.items():
            req = self.states[req_id].request
            req.num_computed_tokens += num
            self._cache_full_blocks(self.states[req_id], req.num_computed_tokens)

    def _cache_full_blocks(self, state: RequestState, num_tokens: int) -> None:
        hashes = state.request.block_hashes
        for j in range(min(num_tokens // self.block_size, len(hashes), len(state.blocks))):
            self.pool.cache(state.blocks[j], hashes[j])

    def _preempt(self, state: RequestState) -> None:
        req = state.request
        self.running.remove(req.request_id)
        self.pool.free(state.blocks)
        state.blocks = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.insert(0, req.request_id)
        self.stats["preemptions"] += 1

    def _promote(self, state: RequestState) -> bool:
        """Move a request whose remote KV arrived back to normal scheduling."""
        req = state.request
        if req.request_id not in self._recved:
            return False
        self._recved.discard(req.request_id)
        self._cache_full_blocks(state, req.num_computed_tokens)
        # The last prompt token is recomputed to produce the first output's logits.
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        if req.num_computed_tokens == 0:  # nothing valid was loaded: start over
            self.pool.free(state.blocks)
            state.blocks = []
        state.loaded = req.num_computed_tokens > 0
        req.status = RequestStatus.PREEMPTED if state.ever_scheduled else RequestStatus.WAITING
        return True
