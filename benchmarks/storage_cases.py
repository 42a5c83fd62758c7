"""kvx's own cases in bench_storage.py and the benchmarks built on it: SharedStorageConnector
(`StorageCase`: a scheduler side that plans, a producer and a consumer worker on one URL) and
OffloadingConnector's CPU tier (`OffloadCase`), each saving and loading the same `KV` bytes as
the raw baselines of storage_baselines.py."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from storage_baselines import KV, Runner, make_fan_out

import kvx
from kvx import (
    ForwardContext,
    KVCacheBlocks,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
    NewRequestData,
    Request,
    SchedulerOutput,
)
from kvx.plugins.offload.metadata import LoadSpec, OffloadMetadata, StoreSpec

# -- SharedStorageConnector ---------------------------------------------------------------------


def forward_step(
    worker: KVConnectorBase_V1,
    meta: KVConnectorMetadata,
    caches: dict[str, torch.Tensor],
    layers: Sequence[str] = (),
    *,
    save: bool = False,
) -> None:
    """One engine step of `worker` as vLLM's forward drives it: bind `meta`, start loads, wait
    for each of `layers` (and save it, when `save`), wait for the saves, clear."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(ForwardContext(kv_caches=caches))
    for name in layers:
        worker.wait_for_layer_load(name)
        if save:
            worker.save_kv_layer(name, caches[name], None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def plan_step(
    scheduler: kvx.KVConnectorBase_V1,
    prompts: dict[str, list[int]],
    blocks: dict[str, list[int]],
) -> Any:
    """The scheduler side's metadata for one step that schedules every prompt from scratch:
    stores all its full blocks, or (when they are stored) loads them."""
    out = SchedulerOutput()
    for req_id, prompt in prompts.items():
        request = Request(req_id, prompt)
        scheduler.on_new_request(request)
        n_ext, _ = scheduler.get_num_new_matched_tokens(request, 0)
        assert n_ext is not None
        extra = blocks[req_id] + [blocks[req_id][-1]]  # the last token's block: never used
        scheduler.update_state_after_alloc(request, KVCacheBlocks((extra,), (0,)), n_ext)
        out.scheduled_new_reqs.append(NewRequestData(req_id, prompt, (extra,), n_ext))
        out.num_scheduled_tokens[req_id] = len(prompt) - n_ext
    meta = scheduler.build_connector_meta(out)
    for req_id, prompt in prompts.items():
        scheduler.request_finished(Request(req_id, prompt), blocks[req_id])
    return meta


class StorageCase:
    """A producer and a consumer worker-side connector on one storage URL; `drop` deletes
    everything stored so far (between rounds, untimed)."""

    def __init__(self, kv: KV, url: str, drop: Runner, **extra: str) -> None:
        config = KVTransferConfig.from_dict(
            {
                "kv_connector": "SharedStorageConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"storage_url": url, "namespace": "bench", **extra},
            }
        )
        ctx = kv.context()
        self.kv = kv
        self.scheduler = kvx.create_connector(config, KVConnectorRole.SCHEDULER, ctx)
        self.producer = kvx.create_connector(config, KVConnectorRole.WORKER, ctx)
        self.consumer = kvx.create_connector(config, KVConnectorRole.WORKER, ctx)
        self.producer.register_kv_caches(kv.src)
        if url.startswith("file://"):  # stored blocks may be smaller than the engine's
            stored = self.producer.worker.geo.block_size  # type: ignore[attr-defined]
            make_fan_out(Path(url.removeprefix("file://")), "bench", stored)
        self.consumer.register_kv_caches(kv.dst)
        self.drop, self.round = drop, 0

    def fresh(self) -> None:
        self.drop()
        self.round += 1
        self.prompts = self.kv.prompts(self.round)
        self.save_meta = plan_step(self.scheduler, self.prompts, self.kv.src_blocks)
        assert self.save_meta.stores and not self.save_meta.loads

    def plan_load(self) -> None:
        self.load_meta = plan_step(self.scheduler, self.prompts, self.kv.dst_blocks)
        assert self.load_meta.loads and not self.load_meta.stores

    def save(self) -> None:
        forward_step(self.producer, self.save_meta, self.kv.src, self.kv.layers, save=True)
        stats = self.producer.get_kv_connector_stats()
        if stats is not None and stats.data.get("save_errors"):
            raise SystemExit(f"saving through {self.producer} failed: {stats.data}")

    def load(self) -> None:
        forward_step(self.consumer, self.load_meta, self.kv.dst, self.kv.layers)
        if self.consumer.get_block_ids_with_load_errors():
            raise SystemExit("the storage connector reported load errors")

    def close(self) -> None:
        for connector in (self.producer, self.consumer, self.scheduler):
            connector.shutdown()


# -- OffloadingConnector's CPU tier ----------------------------------------------------------


class OffloadCase:
    """Store every source block into CPU slots, load them back into the destination blocks
    (of the same registered caches: the worker side owns one set)."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv
        n = len(kv.all_src)
        config = KVTransferConfig.from_dict(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "cpu_bytes_to_use": n * kv.block_bytes * len(kv.layers)
                },
            }
        )
        ctx = kv.context()
        self.caches = {name: kv.src[name] for name in kv.layers}
        self.worker = kvx.create_connector(config, KVConnectorRole.WORKER, ctx)
        self.worker.register_kv_caches(self.caches)
        keys = [f"{i:08x}" for i in range(n)]
        self.store_meta = OffloadMetadata(
            stores=[StoreSpec("store", keys, list(range(n)), kv.all_src)]
        )
        self.load_meta = OffloadMetadata(
            loads=[LoadSpec("load", kv.all_dst, list(range(n)), [0] * n)]
        )

    def save(self) -> None:
        worker = self.worker
        forward_step(worker, self.store_meta, self.caches)
        worker.handle_preemptions(set())  # returns when every submitted store is done
        worker.get_finished(set())

    def load(self) -> None:
        worker = self.worker
        forward_step(worker, self.load_meta, self.caches)
        while True:
            _, recving = worker.get_finished(set())
            if recving:
                break
            time.sleep(0.0002)
        if worker.get_block_ids_with_load_errors():
            raise SystemExit("the offloading connector reported load errors")

    def check(self) -> None:
        for name in self.kv.layers:
            self.caches[name].index_fill_(1, torch.tensor(self.kv.all_dst), 0)
        self.load()
        self.kv.check(self.caches, self.kv.all_dst, "offload")

    def close(self) -> None:
        self.worker.shutdown()
