"""Layer-wise loads really pipeline (layer i is in the paged cache when wait_for_layer_load(i)
returns, later layers not yet), and stores become KV events only once every worker stored."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvx import BlockStored, KVConnectorOutput, KVTransferConfig
from kvx.engine.engine import Engine, EngineConfig
from kvx.plugins.lmcache.metadata import LMCacheMetadata, LMCacheWorkerMeta, StoredChunk

pytestmark = pytest.mark.timeout(120)

EXTRA = {"chunk_size": 16, "save_unfull_chunk": True, "max_local_cpu_size": 0.05}


def _config(tp: int = 1, **extra: Any) -> EngineConfig:
    ktc = KVTransferConfig.from_dict(
        {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {**EXTRA, **extra},
        }
    )
    return EngineConfig(
        num_layers=4, num_kv_heads=4, num_blocks=64, tp_size=tp, kv_transfer_config=ktc
    )


def _run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int = 2) -> None:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, max_tokens)
    while engine.has_pending_work():
        engine.step()
    assert not engine.check_kv()


def test_layerwise_load_pipelines_per_layer() -> None:
    rng = random.Random(3)
    prompts = {"a": [rng.randrange(1024) for _ in range(70)]}
    first = Engine(_config(use_layerwise=True))
    try:
        _run(first, prompts)
    finally:
        first.shutdown()
    second = Engine(_config(use_layerwise=True))
    seen: list[list[bool]] = []
    try:
        worker = second.workers[0]
        connector = worker.connector
        assert connector is not None
        names = list(worker.cache.tensors)
        original = connector.wait_for_layer_load
        before: dict[str, torch.Tensor] = {}

        def watched(layer_name: str) -> None:
            meta = connector._get_connector_metadata()
            assert isinstance(meta, LMCacheMetadata)
            bs = second.config.block_size
            blocks = [b for load in meta.loads for b in load.block_ids[: load.end // bs]]
            if not blocks:
                return original(layer_name)
            index = torch.tensor(blocks)
            if layer_name == names[0]:
                before.update({n: worker.cache.tensors[n][:, index].clone() for n in names})
            original(layer_name)
            seen.append(
                [not torch.equal(worker.cache.tensors[n][:, index], before[n]) for n in names]
            )

        connector.wait_for_layer_load = watched  # type: ignore[method-assign]
        _run(second, prompts)
        assert second.stats()["external_tokens"] == 64
    finally:
        second.shutdown()
    layers = len(names)
    assert seen == [[j <= i for j in range(layers)] for i in range(layers)]


def test_events_only_when_every_worker_stored() -> None:
    engine = Engine(_config(tp=2))
    try:
        scheduler = engine.scheduler_connector
        assert scheduler is not None
        chunk = StoredChunk(None, list(range(16)))
        one = LMCacheWorkerMeta({7: chunk}, {7: 1})
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=one))
        assert list(scheduler.take_events()) == []  # one of two workers
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=one))
        events = list(scheduler.take_events())
        assert events == [BlockStored((7,), None, tuple(range(16)), 16, "CPU")]
        # a real run: each full chunk of the prompt is one event, after both TP workers stored
        prompt = list(range(100, 140))
        _run(engine, {"p": prompt}, max_tokens=1)
        stored = [e for e in scheduler.take_events() if isinstance(e, BlockStored)]
        assert [e.token_ids for e in stored] == [
            tuple(prompt[0:16]),
            tuple(prompt[16:32]),
            tuple(prompt[32:40]),
        ]
        assert stored[0].parent_block_hash is None
        assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    finally:
        engine.shutdown()


def test_worker_meta_aggregates() -> None:
    a = LMCacheWorkerMeta({1: StoredChunk(None, [1])}, {1: 1})
    b = LMCacheWorkerMeta({1: StoredChunk(None, [1]), 2: StoredChunk(1, [2])}, {1: 1, 2: 1})
    merged = a.aggregate(b)
    assert isinstance(merged, LMCacheWorkerMeta)
    assert merged.counts == {1: 2, 2: 1}
