"""P and D in separate OS processes on the CPU plane, for every send type, with heterogeneous
TP: every output token and KV byte checked against a single engine, nothing left held."""

from __future__ import annotations

import random

import pytest

from kvx.engine.disagg import DisaggregatedPair, pd_configs
from kvx.engine.engine import EngineConfig

from ._ports import free_port_range, p2p_config

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=128)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("send_type", "tp", "block_sizes", "layouts"),
    [
        ("PUT", (1, 2), None, ("NHD", "HND")),
        ("PUT_ASYNC", (2, 1), (16, 32), None),
        ("GET", (2, 4), (32, 16), ("HND", "NHD")),
    ],
)
def test_pair_in_processes(
    send_type: str,
    tp: tuple[int, int],
    block_sizes: tuple[int, int] | None,
    layouts: tuple[str, str] | None,
) -> None:
    kv = p2p_config(send_type, free_port_range(8))
    p, d = pd_configs(BASE, kv, tp, block_sizes, layouts)
    rng = random.Random(sum(tp))
    prompts = {f"r{n}": [rng.randrange(BASE.vocab_size) for _ in range(n)] for n in (5, 37, 96)}
    with DisaggregatedPair(p, d, processes=True, timeout_s=60) as pair:
        report = pair.run(prompts, 4, timeout_s=90)
        assert not report.kv_mismatches
        assert report.decode_stats["external_tokens"] >= 5 + 37 + 96 - 3  # KV moved
        for result in report.results.values():
            assert result.status == "finished_length_capped", result
            assert result.tokens == result.baseline, result
        for handle, config in ((pair.prefill, p), (pair.decode, d)):
            assert handle.last_stats["held_blocks"] == 0
            assert handle.last_stats["free_blocks"] == config.num_blocks
