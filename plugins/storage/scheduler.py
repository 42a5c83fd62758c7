"""Scheduler side: find the longest stored prefix, and say which blocks to load and store.

Matches vLLM's ExampleConnector (synchronous loads, never the last prompt token, stores of full
blocks only), but per stored block instead of per prompt: a prefix shared by two prompts is
stored once, and a partial prefix hit loads what exists.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import kvx
from kvx import PlanningScheduler, RequestTracker, ScheduledRequest, StorageBackend
from kvx.plugins.storage.keys import Geometry, Stage, block_keys, shard_counts, shard_ranges
from kvx.plugins.storage.metadata import LoadSpec, StorageMetadata, StorageWorkerMeta, StoreSpec

logger = logging.getLogger(__name__)

PROBE_BATCH = 32  # stored blocks checked per round trip
_Partition = tuple[int, int]  # a writer's (PP size, head shard count)


@dataclass
class _Request:
    prompt_len: int
    keys: list[str]


class StorageScheduler(PlanningScheduler[_Request, StorageMetadata]):
    """Existence checks are fresh on every call; what is learned is kept only until the step's
    `build_connector_meta`, since other engines add blocks (and TTLs drop them) at any time."""

    def __init__(
        self,
        geometry: Geometry,
        backend: StorageBackend,
        preferred_shards: int,
        preferred_pp: int,
        store: bool,
        load: bool = True,
    ) -> None:
        self.geo = geometry
        self.backend = backend
        self.store = store  # kv_producer or kv_both
        self.load = load  # kv_consumer or kv_both
        self._partitions = [  # (writer PP size, head shards), own first
            (pp, shards)
            for pp in geometry.pp_sizes(preferred_pp)
            for shards in shard_counts(geometry.total_heads, preferred_shards)
        ]
        self._stages: dict[int, list[Stage]] = {}  # writer PP size -> its stages
        self._keys: dict[str, list[str]] = {}  # request id -> keys of its prompt's full blocks
        self.requests = RequestTracker("kvx storage", self._start)  # scheduled requests
        self._found: dict[str, dict[int, _Partition]] = {}  # this step: block -> partition
        self._events: list[kvx.KVCacheEvent] = []  # failed saves the workers reported

    # -- contract --------------------------------------------------------------------------

    def on_new_request(self, request: kvx.Request) -> None:
        self._request_keys(request)

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens of full stored blocks beyond `num_computed_tokens`, engine-block aligned and
        never the last prompt token (vLLM: `align_to_block_size(len - 1)`); loads are sync."""
        # TODO: asynchronous loads (answer True, WAITING_FOR_REMOTE_KVS) so a long prefix no
        # longer delays the step that loads it (docs/connectors/shared-storage.md, Limits)
        bs, ebs = self.geo.block_size, self.geo.engine_block_size
        cap = (len(request.prompt_token_ids) - 1) // ebs * ebs
        if not self.load or cap <= num_computed_tokens:
            return 0, False
        keys = self._request_keys(request)
        first = num_computed_tokens // bs
        found = self._probe(keys, first, min(len(keys), -(-cap // bs)))
        self._found[request.request_id] = found
        end = min((first + len(found)) * bs, cap) // ebs * ebs
        return max(0, end - num_computed_tokens), False

    def step_planned(self) -> None:
        self._found.clear()

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are durable by the step's `wait_for_save`: blocks are never held."""
        self.requests.forget(request.request_id)
        for table in (self._keys, self._found):
            table.pop(request.request_id, None)
        return False, None

    def update_connector_output(self, connector_output: kvx.KVConnectorOutput) -> None:
        """Workers' failed saves become `BlockStoreFailed` events (once per distinct one)."""
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, StorageWorkerMeta):
            failures = (
                kvx.BlockStoreFailed(tuple(keys), medium, reason)
                for keys, medium, reason in meta.failed_saves
            )
            self._events += dict.fromkeys(failures)

    def take_events(self) -> list[kvx.KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        self.backend.close()

    # -- helpers ---------------------------------------------------------------------------

    def _start(self, new: kvx.NewRequestData) -> _Request:
        # on_new_request / get_num_new_matched_tokens may not have been called
        keys = self._keys_of(new.req_id, new.prompt_token_ids, new.mm_hashes)
        return _Request(len(new.prompt_token_ids), keys)

    def _request_keys(self, request: kvx.Request) -> list[str]:
        return self._keys_of(request.request_id, request.prompt_token_ids, request.mm_hashes)

    def _keys_of(self, req_id: str, prompt: list[int], mm_hashes: list[str]) -> list[str]:
        """The request's stored-block keys, seeded once (with its multimodal hashes: equal
        placeholder tokens of different images must not share keys) and kept."""
        keys = self._keys.get(req_id)
        if keys is None:
            keys = block_keys(prompt, self.geo.block_size, self.geo.seed(mm_hashes))
            self._keys[req_id] = keys
        return keys

    def plan(self, meta: StorageMetadata, step: ScheduledRequest[_Request]) -> None:
        """Add the request's load (tokens just counted as computed) and the stored blocks its
        scheduled tokens complete this step (prompt tokens only); tokens in null blocks
        (outside a sliding window) are neither loaded nor stored."""
        bs, ebs = self.geo.block_size, self.geo.engine_block_size
        req_id, state, computed = step.req_id, step.state, step.num_computed_tokens
        n_ext = step.num_external_tokens
        # Positions before `live` sit in null blocks (outside a sliding window): no KV there.
        live = kvx.skipped_blocks(step.block_ids) * ebs
        if live >= computed:
            n_ext = 0  # the whole load is outside the window: nothing to read
        if n_ext:
            start = max(computed - n_ext, live)
            n_ext = computed - start
            first, last = start // bs, -(-computed // bs)
            found = self._found.get(req_id, {})
            if any(b not in found for b in range(first, last)):
                found = self._probe(state.keys, first, last)
            parts = [found.get(b, self._partitions[0]) for b in range(first, last)]
            meta.loads.append(
                LoadSpec(
                    req_id=req_id,
                    block_ids=step.block_ids[start // ebs : -(-computed // ebs)],
                    start=start,
                    num_tokens=n_ext,
                    first_block=first,
                    keys=state.keys[first:last],
                    stages=[pp for pp, _ in parts],
                    shards=[shards for _, shards in parts],
                )
            )
        scheduled = step.num_scheduled_tokens
        if not self.store or not scheduled:
            return
        first = max(computed, live + bs - 1) // bs  # whole stored blocks of real ones only
        last = min(min(computed + scheduled, state.prompt_len) // bs, len(state.keys))
        if last > first:
            eb0 = first * bs // ebs
            meta.stores.append(
                StoreSpec(
                    req_id=req_id,
                    block_ids=step.block_ids[eb0 : -(-last * bs // ebs)],
                    block_ids_start=eb0 * ebs,
                    first_block=first,
                    keys=state.keys[first:last],
                )
            )

    def _probe(self, keys: list[str], first: int, last: int) -> dict[int, _Partition]:
        """The run of stored blocks from `first` (before `last`) whose every stage and head
        shard value exists, each with the partition (writer PP size, head shard count) it was
        found under.

        A block's partition is looked for among all candidates (`_partition_of`); the blocks
        after it are then checked under the same partition in batches. If the store cannot be
        reached the run found so far is the answer (a miss: the engine computes the rest)."""
        found: dict[int, _Partition] = {}
        try:
            self._probe_into(found, keys, first, last)
        except Exception as exc:
            logger.warning(
                "kvx storage: looking up KV blocks in %s failed: %s: %s",
                self.backend.url,
                type(exc).__name__,
                exc,
            )
        return found

    def _probe_into(
        self, found: dict[int, _Partition], keys: list[str], first: int, last: int
    ) -> None:
        block = first
        while block < last:
            part = self._partition_of(keys[block])
            if part is None:
                return
            found[block] = part
            block += 1
            while block < last:
                batch = range(block, min(last, block + PROBE_BATCH))
                names = [self._names(keys[b], part) for b in batch]
                exists = self.backend.exists_many([n for group in names for n in group])
                per = len(names[0])
                run = 0
                while run < len(batch) and all(exists[run * per : (run + 1) * per]):
                    found[block + run] = part
                    run += 1
                block += run
                if run < len(batch):
                    break  # look for this block under every partition

    def _partition_of(self, key: str) -> _Partition | None:
        """The first partition (own PP and TP first) under which every value of a block
        exists. One round trip asks for the own partition's values and the first value of
        each other partition (not all of them: most lookups are hits under the own partition
        or misses, and each name is a stat on local files); only partitions whose first value
        was there are then asked for the rest."""
        own, *others = self._partitions
        mine = self._names(key, own)
        exists = self.backend.exists_many(mine + [self._names(key, p, 1)[0] for p in others])
        if all(exists[: len(mine)]):
            return own
        candidates = [p for p, hit in zip(others, exists[len(mine) :], strict=True) if hit]
        if not candidates:
            return None
        rest = [self._names(key, part)[1:] for part in candidates]
        exists = self.backend.exists_many([n for group in rest for n in group])
        at = 0
        for part, group in zip(candidates, rest, strict=True):
            if all(exists[at : at + len(group)]):
                return part
            at += len(group)
        return None

    def _names(self, key: str, part: _Partition, count: int | None = None) -> list[str]:
        """Every stage x head shard value of one stored block under one partition (the first
        `count` of them, when given)."""
        pp, shards = part
        heads = shard_ranges(self.geo.total_heads, shards)
        stages = self._stages.get(pp)
        if stages is None:
            stages = self._stages[pp] = self.geo.stages(pp)
        pairs = itertools.islice(itertools.product(stages, heads), count)
        return [self.geo.value_key(key, st, h) for st, h in pairs]
