"""The reference engine: a scheduler, TP x PP workers and a connector, in one process.

It is a real engine without model weights: blocks are allocated, prefix-cached, preempted and
freed; every worker holds real per-layer KV tensors in the configured layout; a connector is
driven through the full contract. `kvx.engine.server` runs one in its own OS process.
"""

from __future__ import annotations

import itertools
import os
import uuid
import zlib
from dataclasses import dataclass, field, replace

import torch

from kvx.config.transfer import KVTransferConfig
from kvx.contract.auxiliary import KVConnectorRole
from kvx.contract.base import KVConnectorBase_V1
from kvx.contract.events import KVConnectorKVEvents
from kvx.contract.stats import KVConnectorStats
from kvx.contract.types import (
    EngineContext,
    KVCacheSpec,
    ParallelInfo,
    Request,
    RequestStatus,
    SchedulerOutput,
    skipped_blocks,
)
from kvx.engine.aggregator import KVOutputAggregator
from kvx.engine.diagnosis import diagnose
from kvx.engine.kv_groups import WindowGroups
from kvx.engine.metadata_wire import decode_metadata, encode_metadata
from kvx.engine.mismatch import likely_cause
from kvx.engine.model import SCORE_PRIME, ToyModel, extend_prefix_hashes
from kvx.engine.scheduler import RequestOutput, Scheduler, SchedulerConfig
from kvx.engine.worker import Worker
from kvx.registry.core import Registry, create_connector, get_registry

_ENGINES = itertools.count()  # engines created in this process


@dataclass(frozen=True)
class EngineConfig:
    """Everything that defines one reference engine."""

    num_layers: int = 2
    num_kv_heads: int = 4
    head_size: int = 16
    vocab_size: int = 1024
    block_size: int = 16
    num_blocks: int = 256
    dtype: str = "float32"
    layout: str = "NHD"
    use_mla: bool = False
    tp_size: int = 1
    pp_size: int = 1
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    model_name: str = "kvx-toy"
    seed: int = 0
    free_list_seed: int | None = None  # start with a shuffled (fragmented) block free list
    sliding_window: int | None = None  # tokens attention reads (the last ones); None: all
    # 2: even layers full attention, odd layers `sliding_window`, one table each (Gemma-3)
    kv_groups: int = 1
    engine_id: str = field(default_factory=lambda: f"engine-{uuid.uuid4().hex[:8]}")
    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_kv_heads",
            "head_size",
            "block_size",
            "num_blocks",
            "tp_size",
            "pp_size",
            "max_num_batched_tokens",
            "max_num_seqs",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
            raise ValueError(f"EngineConfig.sliding_window must be an int or None, got {window!r}")
        if window is not None and (window < 1 or self.num_blocks < 2):
            raise ValueError(
                f"EngineConfig.sliding_window {window} needs a window >= 1 token and "
                f"num_blocks >= 2 (the last block is the null block), got {self.num_blocks}"
            )
        if self.kv_groups not in (1, 2):
            raise ValueError(f"EngineConfig.kv_groups must be 1 or 2, got {self.kv_groups!r}")
        if self.kv_groups == 2 and (window is None or self.num_layers < 2 or self.num_blocks < 3):
            raise ValueError(
                "EngineConfig.kv_groups 2 (full-attention and sliding-window layers) needs "
                f"sliding_window set, num_layers >= 2 and num_blocks >= 3, got sliding_window "
                f"{window}, num_layers {self.num_layers}, num_blocks {self.num_blocks}"
            )
        if self.pp_size > self.num_layers:
            raise ValueError(
                f"EngineConfig.pp_size {self.pp_size} exceeds num_layers "
                f"{self.num_layers}: every pipeline stage needs a layer"
            )

    @property
    def model(self) -> ToyModel:
        return ToyModel(
            self.num_layers,
            self.num_kv_heads,
            self.head_size,
            self.vocab_size,
            self.seed,
            self.use_mla,
        )

    @property
    def groups(self) -> WindowGroups | None:
        """The two groups' block ids (`kv_groups=2`); None with one group."""
        if self.kv_groups == 1 or self.sliding_window is None:
            return None
        return WindowGroups(self.num_blocks, self.sliding_window, self.block_size)

    def cache_spec(self) -> KVCacheSpec:
        groups = self.groups
        return KVCacheSpec(
            layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(self.num_layers)),
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            dtype=self.dtype,
            layout=self.layout,
            use_mla=self.use_mla,
            num_blocks=self.num_blocks,
            # with two groups the window is group 1's: the tables carry its NULL_BLOCKs
            sliding_window=None if groups else self.sliding_window,
            layer_groups=groups.layer_groups(self.num_layers) if groups else (),
        )

    def context(self, parallel: ParallelInfo, registry: Registry | None = None) -> EngineContext:
        return EngineContext(
            engine_id=self.engine_id,
            model_name=self.model_name,
            cache=self.cache_spec(),
            parallel=parallel,
            enable_hma=self.kv_groups > 1,
            registry=registry,
        )


@dataclass
class _ExpectedKV:
    """One request's model KV for its first `len(tokens)` positions, per (worker, layer)."""

    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    kv: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)


class Engine:
    """Add requests, step, read outputs; `shutdown()` when done."""

    def __init__(self, config: EngineConfig, registry: Registry | None = None) -> None:
        """`registry`: where the connector, its children, backends and layouts are found
        (default: the process-wide one; the engine is an entry point)."""
        ktc = config.kv_transfer_config
        registry = registry or get_registry()
        self.registry = registry
        if ktc is not None and ktc.kv_connector is not None and not config.use_mla:
            # Like vLLM, the connector's layout requirement decides the cache layout.
            required = registry.resolve_connector_class(ktc).get_required_kvcache_layout(
                ktc, config.context(ParallelInfo(), registry)
            )
            if required is not None and required != config.layout:
                config = replace(config, layout=required)
        self.config = config
        self.model = config.model
        self.scheduler_connector: KVConnectorBase_V1 | None = None
        if ktc is not None and ktc.kv_connector is not None:
            self.scheduler_connector = create_connector(
                ktc,
                KVConnectorRole.SCHEDULER,
                config.context(
                    ParallelInfo(tp_size=config.tp_size, pp_size=config.pp_size), registry
                ),
                registry=registry,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                enable_prefix_caching=config.enable_prefix_caching,
                kv_load_failure_policy=ktc.kv_load_failure_policy if ktc else "fail",
                kv_role=ktc.kv_role if ktc else None,
                free_list_seed=config.free_list_seed,
                sliding_window=None if config.groups else config.sliding_window,
                groups=config.groups,
            ),
            self.scheduler_connector,
        )
        self.workers: list[Worker] = []
        # differs between engines (also two of one config): see Worker's guard_salt
        guard_salt = zlib.crc32(config.engine_id.encode()) + os.getpid() + next(_ENGINES)
        spec = config.cache_spec()
        for pp_rank in range(config.pp_size):
            for tp_rank in range(config.tp_size):
                parallel = ParallelInfo(
                    tp_size=config.tp_size, tp_rank=tp_rank, pp_size=config.pp_size, pp_rank=pp_rank
                )
                connector = None
                if self.scheduler_connector is not None:
                    assert ktc is not None
                    connector = create_connector(
                        ktc,
                        KVConnectorRole.WORKER,
                        config.context(parallel, registry),
                        registry=registry,
                    )
                self.workers.append(
                    Worker(
                        self.model,
                        spec,
                        parallel,
                        connector,
                        layouts=registry,
                        groups=config.groups,
                        guard_salt=guard_salt,
                    )
                )
        self.aggregator: KVOutputAggregator | None = None
        if self.scheduler_connector is not None:
            self.aggregator = KVOutputAggregator.from_connector(
                self.scheduler_connector, len(self.workers)
            )
            handshakes = {}
            for worker in self.workers:
                assert worker.connector is not None
                meta = worker.connector.get_handshake_metadata()
                if meta is not None:
                    handshakes[(worker.parallel.pp_rank, worker.parallel.tp_rank)] = meta
            if handshakes:
                self.scheduler_connector.set_xfer_handshake_metadata_pp_aware(handshakes)
        self.steps = 0
        self.kv_stats: list[KVConnectorStats] = []  # aggregated per step, for inspection
        self.kv_events: list[KVConnectorKVEvents] = []
        self._expected: dict[str, _ExpectedKV] = {}  # check_kv's model KV, per request

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int = 16,
        kv_transfer_params: dict | None = None,
    ) -> None:
        self.scheduler.add_request(
            Request(
                request_id,
                list(prompt_token_ids),
                max_tokens=max_tokens,
                kv_transfer_params=kv_transfer_params,
            )
        )

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def has_pending_work(self) -> bool:
        return self.scheduler.has_pending_work()

    def step(self) -> list[RequestOutput]:
        """One scheduler step over all workers."""
        out = self.scheduler.schedule()
        results = [worker.execute(view) for worker, view in zip(self.workers, self._views(out))]
        totals: dict[str, int] = {}
        for result in results:
            for req_id, score in result.scores.items():
                totals[req_id] = (totals.get(req_id, 0) + score) % SCORE_PRIME
        sampled = {req_id: self.model.sample(total) for req_id, total in totals.items()}
        kv_output = None
        if self.aggregator is not None:
            kv_output = self.aggregator.aggregate([r.kv_connector_output for r in results])
            groups = self.config.groups
            if groups is not None and kv_output is not None and kv_output.invalid_block_ids:
                # either group's id names the scheduler's logical block
                kv_output.invalid_block_ids = {
                    groups.logical(b) for b in kv_output.invalid_block_ids
                }
            if kv_output is not None and kv_output.kv_connector_stats is not None:
                self.kv_stats.append(kv_output.kv_connector_stats)
            if kv_output is not None and kv_output.kv_cache_events is not None:
                self.kv_events.append(kv_output.kv_cache_events)
        self.steps += 1
        return self.scheduler.update_from_output(out, sampled, kv_output)

    def _views(self, out: SchedulerOutput) -> list[SchedulerOutput]:
        """Each worker's view of the step: its own copy of the connector metadata, rebuilt
        from msgpack bytes as if sent to a worker process (`kvx.engine.metadata_wire`). The
        rest of the output is shared: the reference workers only read it."""
        meta = out.kv_connector_metadata
        if meta is None:
            return [out] * len(self.workers)
        raw = encode_metadata(meta)
        return [
            replace(out, kv_connector_metadata=decode_metadata(raw, meta)) for _ in self.workers
        ]

    def take_violations(self) -> list[str]:
        """Contract violations the scheduler and the output aggregator recorded since the
        last call (empty for a conforming connector)."""
        found = self.scheduler.take_violations()
        if self.aggregator is not None:
            found += self.aggregator.violations
            self.aggregator.violations = []
        return [f"{self.config.engine_id}: {v}" for v in found]

    def diagnose(self) -> list[str]:
        """What keeps this engine busy: each request's blocks and the report it waits for."""
        pending = self.aggregator.pending() if self.aggregator is not None else None
        return diagnose(self.scheduler, pending)

    def stats(self) -> dict[str, int]:
        """Step count, scheduler counters, block usage and the connector's failed saves."""
        held = sum(len(b) for b in self.scheduler.held_blocks().values())
        pool = self.scheduler.pool
        save_errors = sum(int(s.data.get("save_errors", 0)) for s in self.kv_stats)
        return {
            "steps": self.steps,
            **self.scheduler.stats,
            "held_blocks": held,
            # blocks no request holds (the null block, the other group's half, too)
            "free_blocks": self.config.num_blocks
            - self.config.kv_groups * (pool.num_blocks - pool.num_free_blocks),
            "kv_save_errors": save_errors,
        }

    def check_kv(self) -> list[str]:
        """Compare every computed KV element of every live or held request, and of every
        request that finished normally in the last step (its freed blocks stay untouched until
        the next step allocates: a prompt prefilled and finished in one step on a store
        connector's P is checked too), on every worker and layer, with what the model wrote
        (with a sliding window: from the first block not `NULL_BLOCK`); return one line per
        mismatching (worker, layer, request), naming the first bad position, and one per layer
        whose null block was written."""
        targets = []
        for state in self.scheduler.states.values():
            req = state.request
            if state.freed_blocks and state.finished_step == self.scheduler.steps:
                size = len(state.freed_blocks) * self.config.block_size
                tables = self.scheduler.block_tables(state.freed_blocks, state.window_skipped)
                targets.append((req, tables, min(req.num_computed_tokens, size)))
            loading = req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
            # A load reported received (finished_recving) must have landed already.
            if req.is_finished() or (loading and req.request_id not in self.scheduler.received):
                continue
            if req.num_computed_tokens:
                tables = self.scheduler.block_tables(state.blocks, state.window_skipped)
                targets.append((req, tables, req.num_computed_tokens))
        for req_id, blocks in self.scheduler.held_blocks().items():
            state = self.scheduler.states[req_id]
            req = state.request
            computed = min(req.num_computed_tokens, len(blocks) * self.config.block_size)
            if computed and req.status is not RequestStatus.FINISHED_ABORTED:
                tables = self.scheduler.block_tables(blocks, state.window_skipped)
                targets.append((req, tables, computed))
        problems = [
            f"{self.config.engine_id} worker pp{worker.parallel.pp_rank}/"
            f"tp{worker.parallel.tp_rank} {name}: {what}"
            for worker in self.workers
            for name, what in worker.guarded_blocks_written()
        ]
        expected = {}
        for req, tables, n in targets:
            entry = self._expected_kv(req.request_id, req.all_token_ids, n)
            expected[req.request_id] = entry
            for w, worker in enumerate(self.workers):
                for name in worker.layers:
                    blocks = tables[worker.group_of[name]]
                    start = skipped_blocks(blocks) * self.config.block_size
                    if start >= n:
                        continue
                    want = entry.kv[(w, name)][start:n].contiguous().view(torch.uint8)
                    got = worker.cache.read(name, blocks, n, start).contiguous().view(torch.uint8)
                    got, want = got.view(n - start, -1), want.view(n - start, -1)
                    same = (got == want).all(dim=1)
                    if not bool(same.all()):
                        first = start + int((~same).nonzero()[0])
                        cause = likely_cause(
                            got,
                            want,
                            first - start,
                            self.config.block_size,
                            self.scheduler.recv_steps.get(req.request_id),
                            offset=start,
                        )
                        problems.append(
                            f"{self.config.engine_id} worker pp{worker.parallel.pp_rank}/"
                            f"tp{worker.parallel.tp_rank} {name}: request {req.request_id} "
                            f"position {first} (of {n}) differs from what the model wrote"
                            f"{cause}"
                        )
        self._expected = expected  # forget requests no longer checked
        return problems

    def _expected_kv(self, req_id: str, tokens: list[int], n: int) -> _ExpectedKV:
        """What the model wrote for `tokens[:n]` on every worker and layer, computed once per
        position: a cached entry is reused while its tokens are still a prefix of `tokens`."""
        entry = self._expected.get(req_id)
        if entry is None or tokens[: len(entry.tokens)] != entry.tokens:
            entry = _ExpectedKV()
        have = len(entry.tokens)
        if n <= have:
            return entry
        entry.tokens.extend(tokens[have:n])
        new = extend_prefix_hashes(entry.hashes, entry.tokens, self.config.seed)[have:]
        for w, worker in enumerate(self.workers):
            for name, layer in worker.layers.items():
                kv = self.model.token_kv(new, layer, worker.heads, worker.cache.dtype)
                old = entry.kv.get((w, name))
                entry.kv[(w, name)] = kv if old is None else torch.cat([old, kv])
        return entry

    def shutdown(self) -> None:
        """Shut every connector down (workers first), even if one of them fails."""
        errors = []
        connectors = [w.connector for w in self.workers] + [self.scheduler_connector]
        for connector in connectors:
            if connector is None:
                continue
            try:
                connector.shutdown()
            except Exception as exc:  # keep shutting the others down
                errors.append(exc)
        if errors:
            raise errors[-1]
