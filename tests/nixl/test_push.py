"""NIXL push mode with real agents and real processes: P WRITEs (D reads nothing), every KV
element checked; a dead P or a dead D ends the hand-off within 2 s, not at the lease or the
transfer timeout; configuration errors name the field."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvx import Capability, ConfigError, KVTransferConfig
from kvx.engine.disagg import DisaggregatedPair, baseline_tokens, pd_configs
from kvx.engine.engine import EngineConfig
from kvx.engine.server import LocalEngine
from kvx.plugins.nixl.connector import NixlConnector, NixlPushConnector

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=128)
SLOW = {"kv_lease_duration": 30, "handshake_timeout_s": 5, "transfer_timeout_s": 30}
"""Long lease and timeouts: a fault noticed within 2 s was not noticed by waiting them out."""
PROMPT_S = 2.0


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(BASE.vocab_size) for _ in range(n)]


@contextmanager
def pair(
    processes: bool, policy: str = "recompute", tp: tuple[int, int] = (1, 1), **extra: Any
) -> Iterator[DisaggregatedPair]:
    config = {
        "kv_connector": "NixlPushConnector",
        "kv_connector_extra_config": {**SLOW, **extra},
        "kv_load_failure_policy": policy,
    }
    p, d = pd_configs(BASE, config, tp=tp)
    handle = DisaggregatedPair(p, d, processes=processes, timeout_s=30)
    try:
        yield handle
    finally:
        handle.close()


def step_until(pd: DisaggregatedPair, what: str, done: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        if not pd.step():
            time.sleep(0.001)


def stat(engine: Any, key: str) -> int:
    """A connector counter of an in-process engine, summed over its workers (a list-valued
    one, such as `transfer_duration`, counts its entries)."""
    assert isinstance(engine, LocalEngine)
    values = [s.to_dict().get(key, 0) for s in engine.engine.kv_stats]
    return sum(len(v) if isinstance(v, list) else v for v in values)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [(1, 2), (2, 1)])
def test_p_writes_and_d_reads_nothing(tp: tuple[int, int]) -> None:
    """Every KV element D holds after the hand-off is P's (the pair checks all of them after
    every step), and it was P that moved them: P recorded the transfers, D none."""
    with pair(processes=False, tp=tp) as pd:
        report = pd.run({f"r{i}": prompt(n, i) for i, n in enumerate((5, 37, 64, 100))}, 4)
        assert report.all_identical, report
        assert not pd.kv_mismatches
        assert stat(pd.prefill, "transfer_duration") >= 4
        assert stat(pd.decode, "transfer_duration") == 0


def hand_off(pd: DisaggregatedPair, victim: list[int], expected: list[int]) -> None:
    """Submit `victim` and step until P handed it to D; in that same round D registered its
    blocks with P, which has not stepped since (so it has not written them)."""
    pd.submit("victim", victim, 5, expected)
    step_until(pd, "P returned params", lambda: pd.results["victim"].status == "decoding")


@pytest.mark.timeout(180)
def test_prefill_killed_before_writing_fails_within_2s() -> None:
    """P dies holding D's registration: D notices at its next heartbeat (NIXL refuses a
    notification to a dead peer) and recomputes, well before the 30 s transfer timeout."""
    warm, victim = prompt(40, 1), prompt(70, 2)
    expected = baseline_tokens(BASE, {"v": victim}, 5)["v"]
    with pair(processes=True) as pd:
        assert pd.run({"warm": warm}, 3).all_identical
        hand_off(pd, victim, expected)
        pd.kill("prefill")
        killed = time.monotonic()
        step_until(pd, "D ended the request", lambda: pd.results["victim"].status != "decoding")
        took = time.monotonic() - killed
        step_until(pd, "D finished", pd.finished)
        result = pd.results["victim"]
        assert took < PROMPT_S, f"D noticed the dead P after {took:.1f}s"
        assert result.status == "finished_length_capped"
        assert result.tokens == expected
        assert not pd.kv_mismatches


@pytest.mark.timeout(180)
def test_decode_killed_before_write_frees_p_within_2s() -> None:
    """D dies after registering: P's WRITE cannot be posted to it, and P frees the blocks at
    once instead of holding them for the 30 s lease."""
    warm, victim = prompt(40, 1), prompt(70, 2)
    with pair(processes=True) as pd:
        assert pd.run({"warm": warm}, 3).all_identical
        hand_off(pd, victim, [])
        assert pd.prefill.last_stats["held_blocks"] > 0
        pd.kill("decode")
        killed = time.monotonic()
        while pd.prefill.step()[1] or pd.prefill.last_stats["held_blocks"]:
            assert time.monotonic() - killed < PROMPT_S, "P still holds the dead D's blocks"
            time.sleep(0.005)
        assert pd.prefill.last_stats["free_blocks"] == BASE.num_blocks


@pytest.mark.timeout(120)
def test_block_size_mismatch_fails_at_once_and_recomputes() -> None:
    """Push writes blocks as they are: P and D with other block sizes end the request at
    once with a load error (recomputed, output exact), not at a timeout."""
    config = {
        "kv_connector": "NixlPushConnector",
        "kv_connector_extra_config": SLOW,
        "kv_load_failure_policy": "recompute",
    }
    p, d = pd_configs(BASE, config, block_sizes=(16, 32))
    started = time.monotonic()
    with DisaggregatedPair(p, d, processes=False, timeout_s=30) as pd:
        report = pd.run({"a": prompt(70, 5)}, 3, timeout_s=20)
        assert report.all_identical, report
        assert stat(pd.decode, "num_failed_transfers") == 1
    assert time.monotonic() - started < 20


def test_config_names_and_errors() -> None:
    both = {"kv_role": "kv_both"}
    push = KVTransferConfig.from_dict({"kv_connector": "NixlPushConnector", **both})
    assert push.extra_config_as(NixlPushConnector.extra_config_schema).transfer_mode == "push"
    by_key = KVTransferConfig.from_dict(
        {
            "kv_connector": "NixlConnector",
            "kv_connector_extra_config": {"transfer_mode": "push"},
            **both,
        }
    )
    claims = NixlConnector.claims_for(by_key)
    assert claims == NixlPushConnector.claims_for(push)
    assert Capability.HETERO_TP in claims and Capability.BLOCK_SIZE_MISMATCH not in claims
    assert Capability.BLOCK_SIZE_MISMATCH in NixlConnector.claims_for(
        KVTransferConfig.from_dict({"kv_connector": "NixlPullConnector", **both})
    )
    with pytest.raises(ConfigError) as err:
        KVTransferConfig.from_dict(
            {
                "kv_connector": "NixlConnector",
                "kv_connector_extra_config": {"transfer_mode": "write"},
                **both,
            }
        )
    text = str(err.value)
    assert "transfer_mode" in text and '"write"' in text and "push" in text and "pull" in text
