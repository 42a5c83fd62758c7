"""An MLA model's latent is the same on every TP rank, so SharedStorageConnector stores it once:
at TP 2 the store holds one rank's latent (one value per block, written by rank 0), not two, and
an engine of either TP size loads it byte-exact (the reference engine checks every KV element
after every step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvx import KVTransferConfig
from kvx.conformance.harness import run_engine
from kvx.engine import Engine, EngineConfig

pytestmark = pytest.mark.timeout(120)

PROMPTS = {"a": list(range(3, 40)), "b": list(range(100, 164)), "c": list(range(500, 505))}
BLOCK, LAYERS, LATENT = 16, 2, 32


def engine(root: Path, tp: int) -> Engine:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"storage_url": f"file://{root}"},
        }
    )
    config = EngineConfig(
        num_layers=LAYERS,
        num_kv_heads=4,
        head_size=LATENT,
        block_size=BLOCK,
        use_mla=True,
        tp_size=tp,
        kv_transfer_config=kv,
    )
    return Engine(config)


def run(root: Path, tp: int) -> tuple[dict[str, list[int]], dict[str, float]]:
    """Outputs and the summed storage stats of one engine over PROMPTS."""
    e = engine(root, tp)
    try:
        outputs = run_engine(e, PROMPTS, 4)
        stats: dict[str, float] = {}
        for step in e.kv_stats:
            for key, value in step.data.items():
                if isinstance(value, int | float):
                    stats[key] = stats.get(key, 0) + value
        return outputs, {**stats, **e.stats()}
    finally:
        e.shutdown()


def stored_values(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_store_holds_one_ranks_latent_at_any_tp(tmp_path: Path, tp: int) -> None:
    _, stats = run(tmp_path, tp)
    blocks = sum(len(p) // BLOCK for p in PROMPTS.values())
    one_rank = blocks * LAYERS * BLOCK * LATENT * 4  # float32 latent of every stored token
    assert stats["saved_blocks"] == blocks
    assert stats["saved_bytes"] == one_rank  # KV bytes: the values' headers are not counted
    assert len(stored_values(tmp_path)) == blocks  # one value per block, not one per rank


@pytest.mark.parametrize(("store_tp", "load_tp"), [(2, 1), (1, 2), (2, 2)])
def test_mla_stored_at_one_tp_loads_at_another(tmp_path: Path, store_tp: int, load_tp: int) -> None:
    first, _ = run(tmp_path, store_tp)
    second, stats = run(tmp_path, load_tp)  # run_engine checked every KV element each step
    assert second == first
    loadable = sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS.values())
    assert stats["external_tokens"] == loadable > 0
    assert stats["loaded_tokens"] == loadable * load_tp  # each rank loads the one copy
