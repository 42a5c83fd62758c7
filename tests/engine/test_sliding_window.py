"""The reference engine's sliding window: a request's blocks the window left are freed and its
table says `kvx.NULL_BLOCK` there (vLLM's null block), attention reads only the window (the KV
checks pass with those blocks gone), and a write through a null entry is caught."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvx
from kvx.engine import Engine, EngineConfig

BASE = EngineConfig(block_size=16, num_blocks=32, sliding_window=32, max_num_batched_tokens=40)
PROMPT = [(11 * i + 3) % 1000 for i in range(100)]


def run(config: EngineConfig, prompt: list[int] = PROMPT) -> tuple[Engine, list[int], list[int]]:
    """The engine (not shut down), the tokens, and the request's table as it finished."""
    engine = Engine(config)
    engine.add_request("r", prompt, 6)
    tokens: list[int] = []
    table: list[int] = []
    while engine.has_pending_work():
        if engine.scheduler.states.get("r") and engine.scheduler.states["r"].blocks:
            table = engine.scheduler.blocks_of("r")
        for out in engine.step():
            tokens = out.output_token_ids
        assert engine.check_kv() == []
    return engine, tokens, table


def test_blocks_outside_the_window_are_freed_and_null_in_the_table() -> None:
    engine, _, table = run(BASE)
    try:
        skipped = kvx.skipped_blocks(table)
        # 100 prompt tokens + 5 decoded, window 32: every block before token 105 - 32 + 1 is out
        assert skipped == (105 - 1 - 32 + 1) // 16 and kvx.NULL_BLOCK not in table[skipped:]
        assert engine.stats()["free_blocks"] == BASE.num_blocks  # the null block counts as free
    finally:
        engine.shutdown()


def test_a_write_through_a_null_entry_is_caught() -> None:
    engine, _, _ = run(BASE)
    try:
        worker = engine.workers[0]
        layer = next(iter(worker.layers))
        view = worker.cache.token_view(layer)
        view[torch.tensor([kvx.NULL_BLOCK])] = 0.0  # advanced indexing: -1 is the last block
        (problem,) = engine.check_kv()
        assert f"{layer}: the null block" in problem
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("field", "value"), [("sliding_window", 0), ("sliding_window", "32")])
def test_a_bad_window_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        replace(BASE, **{field: value})


def test_skipped_blocks_refuses_a_null_entry_after_a_real_block() -> None:
    assert kvx.skipped_blocks([kvx.NULL_BLOCK, kvx.NULL_BLOCK, 4, 5]) == 2
    assert kvx.skipped_blocks([]) == 0
    with pytest.raises(ValueError, match=r"NULL_BLOCK .* after a real block"):
        kvx.skipped_blocks([3, kvx.NULL_BLOCK])
