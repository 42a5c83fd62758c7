"""The reference engine's two KV-cache groups (`EngineConfig.kv_groups=2`, Gemma-3's shape): each
request has a full-attention table and a sliding-window table whose ids never coincide, the
window group's leading entries turn `kvx.NULL_BLOCK`, every KV element of both groups is checked,
and a write into another group's blocks or the null block is caught."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvx
from kvx.engine import Engine, EngineConfig

BASE = EngineConfig(num_layers=2, block_size=16, num_blocks=33, sliding_window=32, kv_groups=2)
PROMPT = [(11 * i + 3) % 1000 for i in range(100)]


def run(config: EngineConfig = BASE) -> tuple[Engine, tuple[list[int], ...], list[int]]:
    """The engine (not shut down), the request's tables as it finished, and its tokens."""
    engine = Engine(config)
    engine.add_request("r", PROMPT, 6)
    tables: tuple[list[int], ...] = ()
    tokens: list[int] = []
    while engine.has_pending_work():
        state = engine.scheduler.states.get("r")
        if state is not None and state.blocks:
            tables = engine.scheduler.block_tables(state.blocks, state.window_skipped)
        for out in engine.step():
            tokens = out.output_token_ids
        assert engine.check_kv() == []
    return engine, tables, tokens


def test_each_group_has_its_own_table_and_only_the_window_group_drops_blocks() -> None:
    engine, (full, window), tokens = run()
    try:
        assert engine.workers[0].group_of == {
            "model.layers.0.self_attn": 0,
            "model.layers.1.self_attn": 1,
        }
        assert kvx.NULL_BLOCK not in full and len(full) == len(window) == 7
        skipped = kvx.skipped_blocks(window)
        # 100 prompt tokens + 5 decoded, window 32: the blocks before token 105 - 32 + 1 are out
        assert skipped == (105 - 1 - 32 + 1) // 16
        assert not set(full) & set(window[skipped:])  # the groups never share a block id
        assert engine.stats()["free_blocks"] == BASE.num_blocks
        assert engine.config.context(kvx.ParallelInfo()).enable_hma
        one_group, _, single_tokens = run(replace(BASE, kv_groups=1))
        one_group.shutdown()
        assert tokens != single_tokens  # layer 0 attends to every token, not the window
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("block", "caught"),
    [(0, "of this layer's other KV-cache group were written"), (-1, "the null block")],
)
def test_a_write_into_another_groups_block_or_the_null_block_is_caught(
    block: int, caught: str
) -> None:
    engine, _, _ = run()
    try:
        worker = engine.workers[0]
        window_layer = "model.layers.1.self_attn"  # block 0 is group 0's: never this layer's
        worker.cache.token_view(window_layer)[torch.tensor([block])] = 0.0
        (problem,) = engine.check_kv()
        assert f"{window_layer}: " in problem and caught in problem
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_groups": 3}, "EngineConfig.kv_groups must be 1 or 2, got 3"),
        ({"sliding_window": None}, "kv_groups 2 .* needs sliding_window set"),
        ({"num_layers": 1}, "num_layers >= 2"),
    ],
)
def test_a_bad_group_config_is_refused_naming_it(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(BASE, **fields)


def test_a_connector_without_hma_is_refused() -> None:
    ktc = kvx.KVTransferConfig.from_dict(
        {
            "kv_connector": "ExamplePDConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"directory": "/nonexistent-kvx-groups"},
        }
    )
    with pytest.raises(kvx.RegistryError, match="does not support HMA"):
        Engine(replace(BASE, kv_transfer_config=ktc))
