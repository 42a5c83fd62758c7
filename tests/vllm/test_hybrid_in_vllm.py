"""vLLM's hybrid KV cache allocator (HMA) with kvx connectors, in real vLLM-CPU engines.

The adapter class of a kvx connector implementing `kvx.SupportsHMA` is vLLM's `SupportsHMA`, so
vLLM keeps its allocator on: a Gemma-3 model then has two KV cache groups (sliding window and
full attention layers), the kvx connector's context says which layer is in which group, and
`request_finished_all_groups` gets one kvx table per group (vLLM's null block as NULL_BLOCK in
the sliding group's). A connector without HMA support keeps vLLM's allocator off (the tokens of
Gemma with a kvx storage connector are covered by docs/vllm.md's shape table)."""

from __future__ import annotations

import importlib
import random
from pathlib import Path
from typing import Any

import pytest
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
    # kvx's MultiConnector implements kvx.SupportsHMA, but whether it can depends on its
    # children's config: its class leaves vLLM's allocator off, as before
    for name in (
        "SharedStorageConnector",
        "OffloadingConnector",
        "NixlConnector",
        "MultiConnector",
    ):
        assert not supports_hma(connector_class(name)), name


def test_gemma3_keeps_two_groups_and_each_finished_request_gets_a_table_per_group(
    harness: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"), seed=0)
    rng = random.Random(28)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (300, 200, 90)]
    gemma = type(harness)(model, prompts)
    with gemma.engine(**HMA_ON) as llm:
        plain = gemma.tokens(gemma.generate(llm))
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
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
