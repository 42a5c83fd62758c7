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
    block_ids: list[int]
    hashes: list[int] = field(default_factory=list)


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
    ) -> None:
        """`layouts`: the registry the cache's layout is looked up in (the engine's)."""
        self.model = model
        self.parallel = parallel
        self.connector = connector
        layers = pp_layer_range(len(spec.layer_names), parallel.pp_rank, parallel.pp_size)
        self.layers = {spec.layer_names[i]: i for i in layers}
        self.cache = PagedKVCache(spec, parallel, list(self.layers), layouts)
        self.window = spec.sliding_window
        self.requests: dict[str, _ReqState] = {}
        self._null_block: dict[str, torch.Tensor] = {}
        if self.window is not None:  # the last block: no request's, a pattern nobody may write
            for i, name in enumerate(self.layers):
                view = self.cache.token_view(name)
                shape = view[-1].shape
                pattern = torch.arange(shape.numel(), dtype=torch.float64) % 997 + 1000 * i
                view[-1] = pattern.view(shape).to(view.dtype)
                self._null_block[name] = view[-1].clone()
        if connector is not None:
            connector.register_kv_caches(dict(self.cache.tensors))

    @property
    def heads(self) -> range:
        return self.cache.heads

    def null_block_written(self) -> list[str]:
        """Layers whose null block (the last, owned by no request: where a write through a
        `NULL_BLOCK` entry lands) changed; always empty without a sliding window."""
        return [
            name
            for name, kept in self._null_block.items()
            if not torch.equal(self.cache.token_view(name)[-1], kept)
        ]

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
                list(new.prompt_token_ids), list(new.block_ids[0])
            )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tokens = cached.all_token_ids[req_id]
            blocks = cached.new_block_ids[i]
            state = self.requests.get(req_id)
            if state is None or req_id in cached.resumed_req_ids:
                self.requests[req_id] = _ReqState(list(tokens), list(blocks[0]) if blocks else [])
                continue
            state.token_ids = list(tokens)
            if blocks:
                state.block_ids.extend(blocks[0])

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
            for _, state, start, end, _ in work:
                kv = self.model.token_kv(state.hashes[start:end], layer, self.heads, dtype)
                self.cache.write(name, state.block_ids, start, kv)
            for req_id, state, _, end, sample in work:
                if sample and self.cache.primary:
                    first = 0 if self.window is None else max(0, end - self.window)
                    read = self.cache.read(name, state.block_ids, end, first)
                    positions = torch.arange(first, end)
                    score = self.model.score(read, positions, layer, self.heads)
                    result.scores[req_id] = (result.scores.get(req_id, 0) + score) % SCORE_PRIME
            if hooks is not None:
                hooks.after_kv_write(name, self.cache.tensors[name])
