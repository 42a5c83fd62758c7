"""A reference-engine worker: one (pp_rank, tp_rank) with real per-layer KV tensors.

Each step it writes the KV of the scheduled tokens (computed by `ToyModel` from token content)
into its paged cache, reads back the whole sequence of every request that reached its last known
token, and reduces what it read to a score; the engine sums the scores of all workers and samples.
The worker-side connector runs around the forward pass through `kvx.engine.hooks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvx.contract.auxiliary import KVConnectorOutput
from kvx.contract.base import KVConnectorBase_V1
from kvx.contract.types import (
    ForwardContext,
    KVCacheSpec,
    ParallelInfo,
    PluginRegistry,
    SchedulerOutput,
)
from kvx.engine.hooks import LayerHooks, run_connector_step
from kvx.engine.kv_cache import PagedKVCache
from kvx.engine.kv_groups import WINDOW_GROUP, WindowGroups
from kvx.engine.model import SCORE_PRIME, ToyModel, extend_prefix_hashes
from kvx.topology import pp_layer_range


@dataclass
class WorkerResult:
    """One worker's step: a partial score per request to sample, and the connector's output."""

    scores: dict[str, int] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class _ReqState:
    token_ids: list[int]
    tables: list[list[int]]  # block ids per KV-cache group
    hashes: list[int] = field(default_factory=list)


NULL_WRITTEN = "the null block (no request's; a write through a NULL_BLOCK table entry lands there)"


class Worker:
    """Owns this rank's KV shard and runs its forward pass."""

    def __init__(
        self,
        model: ToyModel,
        spec: KVCacheSpec,
        parallel: ParallelInfo,
        connector: KVConnectorBase_V1 | None = None,
        *,
        layouts: PluginRegistry,
        groups: WindowGroups | None = None,
        guard_salt: int = 0,
    ) -> None:
        """`layouts`: the registry the cache's layout is looked up in (the engine's);
        `groups`: the two KV-cache groups' block ids (`spec.layer_groups` says each layer's);
        `guard_salt` shifts the pattern of blocks nobody may write (engines differ, so bytes
        another engine copied from its own such blocks still show)."""
        self.model = model
        self.parallel = parallel
        self.connector = connector
        layers = pp_layer_range(len(spec.layer_names), parallel.pp_rank, parallel.pp_size)
        self.layers = {spec.layer_names[i]: i for i in layers}
        self.cache = PagedKVCache(spec, parallel, list(self.layers), layouts)
        groups_of = spec.layer_groups or (0,) * spec.num_layers
        self.group_of = {name: groups_of[i] for name, i in self.layers.items()}
        self.windows = {
            name: spec.sliding_window
            if groups is None
            else groups.window
            if self.group_of[name] == WINDOW_GROUP
            else None
            for name in self.layers
        }
        self.requests: dict[str, _ReqState] = {}
        # Blocks no request of a layer owns, filled with a pattern nobody may write: the null
        # block (the last) and, with two groups, the other group's blocks.
        self._guarded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._null_id = spec.num_blocks - 1
        for i, name in enumerate(self.layers):
            if groups is not None:
                guarded = groups.guarded_blocks(self.group_of[name])
            elif spec.sliding_window is not None:
                guarded = [spec.num_blocks - 1]
            else:
                continue
            index = torch.tensor(guarded, dtype=torch.long)
            view = self.cache.token_view(name)
            shape = view[index].shape
            pattern = (torch.arange(shape.numel(), dtype=torch.float64) + guard_salt) % 997
            pattern += 1000 * i
            view[index] = pattern.view(shape).to(view.dtype)
            self._guarded[name] = (index, view[index].clone())
        if connector is not None:
            connector.register_kv_caches(dict(self.cache.tensors))

    @property
    def heads(self) -> range:
        return self.cache.heads

    def guarded_blocks_written(self) -> list[tuple[str, str]]:
        """(layer, what) for each layer whose null block (the last, where a write through a
        `NULL_BLOCK` entry lands) or, with two groups, a block of the other group changed;
        always empty with one group and no sliding window."""
        found = []
        for name, (index, kept) in self._guarded.items():
            now = self.cache.token_view(name)[index]
            same = (now.reshape(len(index), -1) == kept.reshape(len(index), -1)).all(dim=1)
            if bool(same.all()):
                continue
            bad = [int(b) for b in index[~same]]
            if bad[-1] == self._null_id:
                found.append((name, f"{NULL_WRITTEN} was written"))
                bad = bad[:-1]
            if bad:
                found.append(
                    (
                        name,
                        f"block(s) {bad[:5]} of this layer's other KV-cache group were written "
                        f"(group {1 - self.group_of[name]}'s ids; a connector used one group's "
                        f"block ids for group {self.group_of[name]}'s layers)",
                    )
                )
        return found

    def execute(self, out: SchedulerOutput) -> WorkerResult:
        self._update_states(out)
        result = WorkerResult()
        if self.connector is None:
            if out.total_num_scheduled_tokens:
                self._forward(out, result, hooks=None)
            return result
        context = ForwardContext(kv_caches=self.cache.tensors)
        result.kv_connector_output = run_connector_step(
            self.connector, out, context, lambda hooks: self._forward(out, result, hooks)
        )
        return result

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = _ReqState(
                list(new.prompt_token_ids), [list(table) for table in new.block_ids]
            )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tokens = cached.all_token_ids[req_id]
            blocks = cached.new_block_ids[i]
            state = self.requests.get(req_id)
            if state is None or req_id in cached.resumed_req_ids:
                tables = [list(table) for table in blocks] if blocks else []
                self.requests[req_id] = _ReqState(list(tokens), tables)
                continue
            state.token_ids = list(tokens)
            for table, more in zip(state.tables, blocks or (), strict=False):
                table.extend(more)

    def _forward(
        self, out: SchedulerOutput, result: WorkerResult, hooks: LayerHooks | None
    ) -> None:
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        work = []
        for req_id, num in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            # Tokens only grow while a request's state lives (a resumed request gets a new one).
            extend_prefix_hashes(state.hashes, state.token_ids, self.model.seed)
            start = starts[req_id]
            work.append((req_id, state, start, start + num, start + num == len(state.token_ids)))
        dtype = self.cache.dtype
        for name, layer in self.layers.items():
            if hooks is not None:
                hooks.before_attention(name)
            group, window = self.group_of[name], self.windows[name]
            for _, state, start, end, _ in work:
                kv = self.model.token_kv(state.hashes[start:end], layer, self.heads, dtype)
                self.cache.write(name, state.tables[group], start, kv)
            for req_id, state, _, end, sample in work:
                if sample and self.cache.primary:
                    first = 0 if window is None else max(0, end - window)
                    read = self.cache.read(name, state.tables[group], end, first)
                    positions = torch.arange(first, end)
                    score = self.model.score(read, positions, layer, self.heads)
                    result.scores[req_id] = (result.scores.get(req_id, 0) + score) % SCORE_PRIME
            if hooks is not None:
                hooks.after_kv_write(name, self.cache.tensors[name])
