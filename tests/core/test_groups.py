"""kvx.contract.groups: one connector half per KV-cache group (how storage handles vLLM's hybrid
allocator). Each half sees only its own group's tables, layers and metadata; halves that would
need their completions counted together (asynchronous loads, held blocks) are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvx
from kvx.contract.groups import group_contexts


class Half(kvx.ConnectorScheduler):
    """A scheduler half that records what it is given and answers `hit` tokens."""

    def __init__(self, hit: int, is_async: bool = False, hold: bool = False) -> None:
        self.hit, self.is_async, self.hold = hit, is_async, hold
        self.blocks: list[kvx.KVCacheBlocks] = []
        self.outputs: list[kvx.SchedulerOutput] = []
        self.finished: list[list[int]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return self.hit, self.is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        self.blocks.append(blocks)

    def build_connector_meta(self, scheduler_output: Any) -> kvx.KVConnectorMetadata:
        self.outputs.append(scheduler_output)
        return kvx.KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        self.finished.append(block_ids)
        return self.hold, {"seen": len(self.finished)}


class WorkerHalf(kvx.ConnectorWorker[kvx.KVConnectorMetadata]):
    def __init__(self) -> None:
        self.caches: dict[str, torch.Tensor] = {}
        self.saved: list[tuple[str, Any]] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.caches = kv_caches

    def start_load_kv(self, metadata: Any) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: Any) -> None:
        self.saved.append((layer_name, metadata))


def context() -> kvx.EngineContext:
    spec = kvx.KVCacheSpec(("l0", "l1", "l2", "l3"), 2, 8, 4, layer_groups=(0, 1, 0, 1))
    return kvx.EngineContext("e", "m", spec, enable_hma=True)


def request() -> kvx.Request:
    return kvx.Request("r", list(range(20)))


def test_each_half_sees_only_its_groups_tables() -> None:
    halves = [Half(16), Half(12)]
    sched = kvx.GroupScheduler(halves)
    # an external hit is the shortest of the groups'
    assert sched.get_num_new_matched_tokens(request(), 0) == (12, False)
    sched.update_state_after_alloc(
        request(), kvx.KVCacheBlocks(([1, 2, 3], [kvx.NULL_BLOCK, 5, 6]), (1, 0)), 12
    )
    assert [h.blocks[0].block_ids for h in halves] == [([1, 2, 3],), ([kvx.NULL_BLOCK, 5, 6],)]
    assert [h.blocks[0].num_hashed_blocks for h in halves] == [(1,), (0,)]
    out = kvx.SchedulerOutput(
        scheduled_new_reqs=[kvx.NewRequestData("r", list(range(20)), ([1, 2], [3, 4]), 0)],
        scheduled_cached_reqs=kvx.CachedRequestData(
            req_ids=["q"], new_block_ids=[([7], [8])], num_computed_tokens=[4]
        ),
        num_scheduled_tokens={"r": 8, "q": 1},
    )
    meta = sched.build_connector_meta(out)
    assert isinstance(meta, kvx.GroupsMetadata) and len(meta.groups) == 2
    for g, half in enumerate(halves):
        seen = half.outputs[0]
        assert seen.scheduled_new_reqs[0].block_ids == (([1, 2], [3, 4])[g],)
        assert seen.scheduled_cached_reqs.new_block_ids == [(([7], [8])[g],)]
        assert seen.num_scheduled_tokens == out.num_scheduled_tokens
    assert sched.request_finished_all_groups(request(), ([1, 2], [3, 4])) == (False, {"seen": 1})
    assert [h.finished for h in halves] == [[[1, 2]], [[3, 4]]]
    with pytest.raises(ValueError, match="this engine has 2 KV-cache groups"):
        sched.request_finished(request(), [1, 2])


def test_halves_that_need_counting_together_are_refused() -> None:
    with pytest.raises(RuntimeError, match="asynchronous load"):
        kvx.GroupScheduler([Half(16, is_async=True), Half(16)]).get_num_new_matched_tokens(
            request(), 0
        )
    with pytest.raises(RuntimeError, match="holds blocks"):
        kvx.GroupScheduler([Half(0, hold=True), Half(0)]).request_finished_all_groups(
            request(), ([1], [2])
        )


def test_each_worker_half_gets_its_groups_layers_and_metadata() -> None:
    ctx = context()
    contexts = group_contexts(ctx)
    assert [c.cache.layer_names for c in contexts] == [("l0", "l2"), ("l1", "l3")]
    assert all(c.cache.num_groups == 1 and not c.enable_hma for c in contexts)
    halves = [WorkerHalf(), WorkerHalf()]
    worker = kvx.GroupWorker(halves, contexts)
    caches = {name: torch.zeros(2) for name in ctx.cache.layer_names}
    worker.register_kv_caches(caches)
    assert [sorted(h.caches) for h in halves] == [["l0", "l2"], ["l1", "l3"]]
    metas = (kvx.KVConnectorMetadata(), kvx.KVConnectorMetadata())
    worker.save_kv_layer("l3", caches["l3"], kvx.GroupsMetadata(metas))
    assert halves[1].saved == [("l3", metas[1])] and halves[0].saved == []
    with pytest.raises(ValueError, match="in no KV-cache group"):
        worker.register_kv_caches({"l9": torch.zeros(1)})


def test_one_group_builds_the_plain_half() -> None:
    spec = kvx.KVCacheSpec(("l0",), 2, 8, 4)
    ctx = kvx.EngineContext("e", "m", spec)
    plain = kvx.split_by_group(ctx, lambda c: c.cache.layer_names, lambda h, _: pytest.fail())
    assert plain == ("l0",)
    built = kvx.split_by_group(context(), lambda c: c.cache.layer_names, lambda h, _: h)
    assert built == [("l0", "l2"), ("l1", "l3")]
