"""P and D in separate OS processes over real NIXL: the heterogeneous TP matrix and both
block-size directions, every output token and KV byte checked against a single engine."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvx.engine.disagg import DisaggregatedPair, pd_configs
from kvx.engine.engine import EngineConfig

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=128)
EXTRA = {"kv_lease_duration": 10, "handshake_timeout_s": 5, "transfer_timeout_s": 10}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("tp", "heads", "block_sizes", "layout"),
    [
        ((1, 2), 4, None, "HND"),
        ((2, 1), 4, None, None),  # engines keep NHD: staged reads of head slices
        ((2, 4), 4, None, "HND"),
        ((4, 2), 4, None, "HND"),
        ((4, 4), 2, None, "HND"),  # 2 KV heads over 4 ranks: replicated on both sides
        ((1, 1), 4, (16, 32), "HND"),
        ((1, 1), 4, (32, 16), "HND"),
    ],
)
def test_pair_in_processes(
    tp: tuple[int, int], heads: int, block_sizes: tuple[int, int] | None, layout: str | None
) -> None:
    kv = {
        "kv_connector": "NixlConnector",
        "kv_connector_extra_config": {**EXTRA, "required_layout": layout},
    }
    p, d = pd_configs(replace(BASE, num_kv_heads=heads), kv, tp, block_sizes)
    rng = random.Random(sum(tp) + heads)
    prompts = {f"r{n}": [rng.randrange(BASE.vocab_size) for _ in range(n)] for n in (5, 37, 96)}
    with DisaggregatedPair(p, d, processes=True, timeout_s=60) as pair:
        report = pair.run(prompts, 4, timeout_s=90)
        assert not report.kv_mismatches
        for result in report.results.values():
            assert result.status == "finished_length_capped", result
            assert result.tokens == result.baseline, result
        for handle, config in ((pair.prefill, p), (pair.decode, d)):
            assert handle.last_stats["held_blocks"] == 0
            assert handle.last_stats["free_blocks"] == config.num_blocks
