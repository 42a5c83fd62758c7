"""NIXL prefill/decode failures inside real vLLM-CPU engines: an idle producer, a producer that
dies, and `kv_load_failure_policy` (the root causes of D engines dying in online serving).

The producer (`nixl_idle_producer.py`, a child process) prefills three prompts, takes the step
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

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

PRODUCER = Path(__file__).with_name("nixl_idle_producer.py")
pytestmark = pytest.mark.timeout(240)


@dataclass
class Producer:
    work: Path
    proc: subprocess.Popen[bytes]
    params: list[dict[str, Any]]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def producer(harness: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Producer]:
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"NIXL is not installed in this venv ({exc}): make venv-vllm installs it")
    work = tmp_path_factory.mktemp("nixl-idle")
    (work / "prompts.json").write_text(json.dumps(harness.prompts))
    with (work / "producer.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(PRODUCER), str(harness.model), str(work)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    handle = Producer(work, proc, [])
    try:
        deadline = time.monotonic() + 150
        while not (work / "params.json").exists():
            if proc.poll() is not None:
                tail = (work / "producer.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"the producer exited with {proc.returncode}:\n{tail}")
            assert time.monotonic() < deadline, "the producer did not prefill within 150s"
            time.sleep(0.1)
        handle.params = [h["params"] for h in json.loads((work / "params.json").read_text())]
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


def check_loaded_bytes(harness: Any, producer: Producer, caches: dict, reads: list) -> None:
    """Every token D did not recompute (all but the last prompt token) holds exactly the
    producer's K and V, in every layer and head."""
    for read in reads:
        i = next(
            j
            for j, p in enumerate(producer.params)
            if p["remote_request_id"] == read.remote_request_id
        )
        loaded = read.remote_num_tokens - 1
        for name, cache in caches.items():
            raw = (producer.work / f"p{i}.{name}.f32").read_bytes()
            sent = torch.frombuffer(bytearray(raw), dtype=torch.float32)
            sent = sent.view(-1, *cache.shape[1:])[-len(read.local_block_ids) :]
            got = harness.split_kv(cache[read.local_block_ids])
            want = harness.split_kv(sent)
            for b in range(len(read.local_block_ids)):
                n = min(harness.block, loaded - b * harness.block)
                for part, mine, theirs in zip("KV", got, want, strict=True):
                    ok = torch.equal(mine[b, :, :n], theirs[b, :, :n])
                    assert ok, f"prompt {i}, {name}: {part} of block {b} differs"


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
