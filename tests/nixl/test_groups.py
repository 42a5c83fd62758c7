"""NixlConnector's scheduler half with two KV-cache groups (vLLM's hybrid allocator), without
NIXL: what D queues from P's per-group params (a real P/D run is `groups_pd` in
test_conformance.py and the Gemma-3 case in tests/vllm/test_hybrid_in_vllm.py)."""

from __future__ import annotations

from typing import Any

import pytest

import kvx
from kvx.plugins.nixl.config import NixlConfig
from kvx.plugins.nixl.metadata import RemoteRead
from kvx.plugins.nixl.scheduler import NixlScheduler, malformed_params

SPEC = kvx.KVCacheSpec(("l0", "l1"), 2, 8, 4, layer_groups=(0, 1))
CONSUMER = kvx.KVTransferConfig.from_dict(
    {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
)


def scheduler() -> NixlScheduler:
    return NixlScheduler(NixlConfig(), CONSUMER, kvx.EngineContext("d", "m", SPEC, enable_hma=True))


def params(tables: Any) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_request_id": "r",
        "remote_block_ids": tables,
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
    }


def queued(s: NixlScheduler) -> list[RemoteRead]:
    return s.build_connector_meta(kvx.SchedulerOutput()).reqs_to_recv


def test_d_reads_each_group_from_ps_table_of_that_group() -> None:
    s = scheduler()
    request = kvx.Request("r", list(range(10)), kv_transfer_params=params([[7, 8, 9], [-1, 4, 5]]))
    assert s.get_num_new_matched_tokens(request, 0) == (10, True)
    # group 1 (a window) holds only its last two blocks: its leading entry is null, not D's
    blocks = kvx.KVCacheBlocks(([1, 2, 3], [kvx.NULL_BLOCK, 5, 6]), (0, 1))
    s.update_state_after_alloc(request, blocks, 10)
    (read,) = queued(s)
    assert read.tables() == [([1, 2, 3], [7, 8, 9]), ([5, 6], [-1, 4, 5])]
    assert read.local_block_ids == [1, 2, 3, 5, 6] and read.remote_block_ids == [7, 8, 9]


def test_d_aborted_before_its_blocks_only_tells_p_to_free() -> None:
    s = scheduler()
    request = kvx.Request("r", list(range(10)), kv_transfer_params=params([[7, 8, 9], [4, 5]]))
    s.on_new_request(request)
    assert s.request_finished_all_groups(request, ([], [])) == (False, None)
    (read,) = queued(s)
    assert read.frees_only and read.tables() == [([], [7, 8, 9])]


@pytest.mark.parametrize(
    ("tables", "why"),
    [
        ([7, 8, 9], "must be 2 lists of block ids (one per KV-cache group), got 3 entries"),
        ([[7, 8, 9]], "must be 2 lists of block ids (one per KV-cache group), got 1 entries"),
        ([[7, 8], [9, "x"]], "remote_block_ids must be a list of ints per group"),
        ([[7], [0] * 5], "remote_block_ids: 5 blocks, at most 4"),
    ],
)
def test_per_group_params_from_an_untrusted_p_are_bounded(
    monkeypatch: pytest.MonkeyPatch, tables: Any, why: str
) -> None:
    """A D with two groups takes exactly two lists of ints, each of at most MAX_REMOTE_BLOCKS
    (4 here) ids; otherwise it computes the prompt itself."""
    monkeypatch.setattr("kvx.plugins.nixl.scheduler.MAX_REMOTE_BLOCKS", 4)
    s = scheduler()
    request = kvx.Request("r", list(range(10)), kv_transfer_params=params(tables))
    assert why in (malformed_params(params(tables), 2) or "")
    assert s.get_num_new_matched_tokens(request, 0) == (0, False)
    s.update_state_after_alloc(request, kvx.KVCacheBlocks(([1], [2]), (0, 0)), 0)
    assert queued(s) == []
