"""The NIXL benchmarks' shared sides (bench_nixl.py, bench_nixl_push.py): the engine context
and KV caches of a shape at a TP rank, D's timed round through its connector, and what D's
process checks and closes after each round."""

from __future__ import annotations

import time
from typing import Any

import torch
from transfer_bench import Shape

from kvx import (
    EngineContext,
    ForwardContext,
    KVCacheBlocks,
    KVCacheSpec,
    KVConnectorRole,
    ParallelInfo,
    Request,
    SchedulerOutput,
)
from kvx.layouts import get_layout
from kvx.topology import KVGeometry


def context(engine_id: str, shape: Shape, tp: int, rank: int) -> EngineContext:
    cache = KVCacheSpec(
        layer_names=tuple(f"layer.{i}" for i in range(shape.layers)),
        num_kv_heads=shape.heads,
        head_size=shape.head_size,
        block_size=shape.block_size,
        dtype="bfloat16",
        layout="HND",
        num_blocks=shape.num_blocks,
    )
    return EngineContext(engine_id, "bench", cache, ParallelInfo(tp_size=tp, tp_rank=rank))


def caches(shape: Shape, tp: int, rank: int, seed: int | None) -> dict[str, torch.Tensor]:
    heads = KVGeometry(tp, shape.heads, shape.block_size).heads_of(rank)
    out = {}
    for i in range(shape.layers):
        t = get_layout("HND").allocate(
            shape.num_blocks, shape.block_size, len(heads), shape.head_size, dtype=torch.bfloat16
        )
        if seed is None:
            t.zero_()
        else:  # every head's values depend on (layer, global head) only, whatever the TP
            g = torch.Generator().manual_seed(seed + i)
            full = torch.randn(
                2, shape.num_blocks, shape.heads, shape.block_size, shape.head_size, generator=g
            )
            t.copy_(full[:, :, heads.start : heads.stop].to(torch.bfloat16).transpose(2, 3))
        out[f"layer.{i}"] = t
    return out


def timed_loads(
    sched: Any, workers: list[Any], shape: Shape, params: dict[str, dict]
) -> tuple[float, float]:
    """One round through D's connector: its scheduler admits each request (P's params) into
    consecutive blocks, every worker starts the step's loads; the wall and CPU seconds until
    all workers report every request received (a load error fails the round)."""
    bpr = shape.blocks_per_request
    for i, (rid, p) in enumerate(params.items()):
        req = Request(rid, [0] * shape.tokens, kv_transfer_params=dict(p))
        count, _ = sched.get_num_new_matched_tokens(req, 0)
        blocks = KVCacheBlocks((list(range(i * bpr, (i + 1) * bpr)),), (0,))
        sched.update_state_after_alloc(req, blocks, count)
    meta = sched.build_connector_meta(SchedulerOutput())
    start, cpu = time.perf_counter(), time.process_time()
    for w in workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv(ForwardContext())
        w.clear_connector_metadata()
    pending = [set(params) for _ in workers]
    while any(pending):
        for w, left in zip(workers, pending, strict=True):
            left -= w.get_finished(set())[1] or set()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    errors = set().union(*(w.get_block_ids_with_load_errors() for w in workers))
    assert not errors, f"load errors on blocks {sorted(errors)[:8]}"
    return elapsed, cpu


class DecodeSide:
    """What every benchmark's decode process ends a round and the run with: `shape`, `d_tp`,
    its ranks' caches `kv`, `workers`, `sched` and its raw agents `raw` (set by a subclass)."""

    shape: Shape
    d_tp: int
    kv: list[dict[str, torch.Tensor]]
    workers: list[Any]
    sched: Any
    raw: list[Any]

    def start_connectors(self, make: Any, engine: str) -> None:
        """D's caches, one worker per rank with its caches registered, and the scheduler, each
        from `make(role, kv_role, engine, context)` (the run's connector factory)."""
        torch.set_num_threads(1)
        shape, d_tp = self.shape, self.d_tp
        self.kv = [caches(shape, d_tp, r, seed=None) for r in range(d_tp)]
        self.workers = []
        for rank in range(d_tp):
            w = make(
                KVConnectorRole.WORKER, "kv_consumer", engine, context(engine, shape, d_tp, rank)
            )
            w.register_kv_caches(self.kv[rank])
            self.workers.append(w)
        self.sched = make(
            KVConnectorRole.SCHEDULER, "kv_consumer", engine, context(engine, shape, d_tp, 0)
        )

    def check_and_clear(self) -> None:
        used = self.shape.requests * self.shape.blocks_per_request
        for rank, kv in enumerate(self.kv):
            want = caches(self.shape, self.d_tp, rank, seed=7)
            for name, t in kv.items():
                assert torch.equal(t[:, :used], want[name][:, :used]), f"{name} differs"
                assert not t[:, used:].any(), f"{name}: blocks past the batch were written"
                t.zero_()

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.sched.shutdown()
        self.raw.clear()
