"""vLLM's own MultiConnector with two kvx children, a file store and NIXL, on a prefill engine in
this process, in both orders. Every prompt is handed off (`do_remote_decode`): the store saves
its blocks, NIXL keeps them for a D (none reads here) until its 1 s lease ends and then reports
them sent, and the engine must free them. vLLM hands every child the same merged report; each
kvx adapter used to filter it alone, so the store's guard dropped NIXL's report as one vLLM was
not waiting on and the engine held the requests forever."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

STORED_BLOCK = 16  # SharedStorageConnector's default: one file per 16 prompt tokens
ORDERS = [("store", "nixl"), ("nixl", "store")]


def child(name: str, store: Path) -> dict[str, Any]:
    if name == "store":  # through kvx's vLLM plugin name
        return {
            "kv_connector": "kvx.SharedStorageConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"storage_url": f"file://{store}"},
        }
    return {  # through the adapter module
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "kvx.adapters.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"required_layout": None, "kv_lease_duration": 1},
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
def test_producer_frees_handed_off_blocks_with_either_child_first(
    harness: Any, baseline: list[list[int]], tmp_path: Path, order: tuple[str, str]
) -> None:
    kv = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [child(n, tmp_path / "kv") for n in order]},
    }
    handoff = [{"do_remote_decode": True}] * len(harness.prompts)
    with harness.engine(kv) as llm:
        outputs = harness.generate(llm, params=handoff, max_tokens=1)
        assert harness.tokens(outputs) == [t[:1] for t in baseline]
        for out, prompt in zip(outputs, harness.prompts, strict=True):
            params = out.kv_transfer_params or {}
            assert params.get("do_remote_prefill"), params
            assert len(params["remote_block_ids"]) == -(-len(prompt) // harness.block), params
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.has_requests(), "NIXL should hold the handed-off blocks for D"
        # the lease ends, NIXL reports the requests sent, the engine frees them
        harness.drain(llm, timeout_s=30)
        assert scheduler.kv_cache_manager.usage == 0
    files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
    assert len(files) == sum(len(p) // STORED_BLOCK for p in harness.prompts), "store child"
