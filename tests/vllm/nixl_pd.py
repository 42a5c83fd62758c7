"""What the NIXL prefill/decode tests in vLLM share: the producer engine in a child process
(`nixl_producer.py`) and the check that D's loaded KV is byte-for-byte P's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

PRODUCER = Path(__file__).with_name("nixl_producer.py")


@dataclass
class Producer:
    """A running `nixl_producer.py` and what it handed off: per prompt, its first token and
    the kv_transfer_params D needs (`params`)."""

    work: Path
    proc: subprocess.Popen[bytes]
    handed: list[dict[str, Any]]

    @property
    def params(self) -> list[dict[str, Any]]:
        return [h["params"] for h in self.handed]

    def log_tail(self) -> str:
        return (self.work / "producer.log").read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def start_producer(harness: Any, work: Path, *, idle: bool, timeout_s: float) -> Producer:
    """Start the producer on `harness.prompts` and wait until it handed them off (it is killed
    if that fails)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"NIXL is not installed in this venv ({exc}): make venv-vllm installs it")
    (work / "prompts.json").write_text(json.dumps(harness.prompts))
    argv = [sys.executable, str(PRODUCER), str(harness.model), str(work)]
    with (work / "producer.log").open("wb") as log:
        proc = subprocess.Popen(argv + ["--idle"] * idle, stdout=log, stderr=subprocess.STDOUT)
    producer = Producer(work, proc, [])
    try:
        deadline = time.monotonic() + timeout_s
        while not (work / "params.json").exists():
            if proc.poll() is not None:
                raise AssertionError(
                    f"the producer exited with {proc.returncode}:\n{producer.log_tail()}"
                )
            assert time.monotonic() < deadline, f"the producer did not prefill within {timeout_s}s"
            time.sleep(0.1)
        producer.handed = json.loads((work / "params.json").read_text())
    except BaseException:
        producer.kill()
        raise
    return producer


def check_loaded_bytes(
    harness: Any, producer: Producer, caches: dict[str, torch.Tensor], reads: list[Any]
) -> None:
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
