"""Prefill/decode over NIXL between two real vLLM-CPU engines: kvx's NixlConnector hosted by the
adapter on both sides, the producer in a child process (`nixl_producer.py`), the consumer here.
The consumer READs the producer's blocks (UCX over DRAM), its tokens equal one engine's, the KV
it read is byte-for-byte the producer's, and the producer frees the blocks on the consumer's
notifications (it exits only once its scheduler is empty)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

PRODUCER = Path(__file__).with_name("nixl_producer.py")


def wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the producer exited early with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s}s")
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_nixl_prefill_decode_between_two_vllm_engines(
    harness: Any, baseline: list[list[int]], tmp_path: Path
) -> None:
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"NIXL is not installed in this venv ({exc}): make venv-vllm installs it")

    (tmp_path / "prompts.json").write_text(json.dumps(harness.prompts))
    log = (tmp_path / "producer.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(PRODUCER), str(harness.model), str(tmp_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(tmp_path / "params.json", proc, timeout_s=120)
        handed = json.loads((tmp_path / "params.json").read_text())
        assert [h["first_token"] for h in handed] == [t[:1] for t in baseline]
        kv = {
            "kv_connector": "NixlConnector",
            "kv_connector_module_path": "kvx.adapters.vllm",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"required_layout": None},
        }
        with harness.engine(kv) as llm:
            rec = harness.record(llm)
            outputs = harness.generate(llm, params=[dict(h["params"]) for h in handed])
            caches = {name: t.clone() for name, t in harness.kv_caches(llm).items()}
        assert harness.tokens(outputs) == baseline
        reads = [r for meta in rec.metadata for r in meta.reqs_to_recv]
        assert len(reads) == 3
        for read in reads:
            i = next(
                j
                for j, h in enumerate(handed)
                if h["params"]["remote_request_id"] == read.remote_request_id
            )
            loaded = read.remote_num_tokens - 1  # D recomputes the last prompt token
            for name, cache in caches.items():
                raw = (tmp_path / f"p{i}.{name}.f32").read_bytes()
                sent = torch.frombuffer(bytearray(raw), dtype=torch.float32)
                sent = sent.view(-1, *cache.shape[1:])[-len(read.local_block_ids) :]
                got = harness.split_kv(cache[read.local_block_ids])
                want = harness.split_kv(sent)
                for b in range(len(read.local_block_ids)):
                    n = min(harness.block, loaded - b * harness.block)
                    for part, mine, theirs in zip("KV", got, want, strict=True):
                        ok = torch.equal(mine[b, :, :n], theirs[b, :, :n])
                        assert ok, f"prompt {i}, {name}: {part} of block {b} differs"
        code = proc.wait(timeout=60)
        tail = (tmp_path / "producer.log").read_text(errors="replace")[-3000:]
        assert code == 0, f"the producer did not free its blocks (exit {code}):\n{tail}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
