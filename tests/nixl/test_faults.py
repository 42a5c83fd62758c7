"""Faults with real processes and real NIXL: P dies after D is connected (the READ itself
fails), and a read finishing after P's lease expired is counted, not a crash."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest

from kvx.engine.disagg import DisaggregatedPair, RequestResult, baseline_tokens, pd_configs
from kvx.engine.engine import EngineConfig
from kvx.engine.server import LocalEngine

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=128)


def kv(**extra: Any) -> dict[str, Any]:
    options = {"kv_lease_duration": 5, "handshake_timeout_s": 2, "transfer_timeout_s": 3}
    return {"kv_connector": "NixlConnector", "kv_connector_extra_config": {**options, **extra}}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(BASE.vocab_size) for _ in range(n)]


@contextmanager
def pair(processes: bool, policy: str = "recompute", **extra: Any) -> Iterator[DisaggregatedPair]:
    config = {**kv(**extra), "kv_load_failure_policy": policy}
    p, d = pd_configs(BASE, config)
    handle = DisaggregatedPair(p, d, processes=processes, timeout_s=30)
    try:
        yield handle
    finally:
        handle.close()


def step_until(pair: DisaggregatedPair, what: str, done: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        if not pair.step():
            time.sleep(0.001)


def kill_prefill_after_handoff(
    pd: DisaggregatedPair, victim: list[int], expected: list[int] | None = None
) -> RequestResult:
    """Submit `victim` (5 tokens), kill P once it handed the request to D, and step until D
    ends the request; its result."""
    pd.submit("victim", victim, 5, expected)
    step_until(pd, "P returned params", lambda: pd.results["victim"].status == "decoding")
    pd.kill("prefill")
    step_until(
        pd, "D ended the request", lambda: pd.results["victim"].status != "decoding", timeout_s=60
    )
    return pd.results["victim"]


@pytest.mark.timeout(180)
def test_prefill_killed_after_decode_connected_recomputes_exactly() -> None:
    """D has already shaken hands with P's agents; P dies before D's READ: the transfer
    fails (not the handshake), D reports load errors and recomputes; output exact."""
    warm, victim = prompt(40, 1), prompt(70, 2)
    expected = baseline_tokens(BASE, {"v": victim}, 5)["v"]
    with pair(processes=True) as pd:
        report = pd.run({"warm": warm}, 3)
        assert report.all_identical, report
        result = kill_prefill_after_handoff(pd, victim, expected)
        assert result.status == "finished_length_capped"
        assert result.tokens == expected
        assert not pd.kv_mismatches
        assert pd.decode.last_stats["held_blocks"] == 0


@pytest.mark.timeout(120)
def test_prefill_killed_with_policy_fail_ends_in_error() -> None:
    warm, victim = prompt(40, 1), prompt(70, 2)
    with pair(processes=True, policy="fail") as pd:
        pd.run({"warm": warm}, 3)
        assert kill_prefill_after_handoff(pd, victim).status == "finished_error"


@pytest.mark.timeout(120)
def test_decode_killed_prefill_frees_at_lease_expiry() -> None:
    """D dies after P returned params and before reading: P frees the blocks once the (short,
    configured) lease expires, not before, and keeps serving."""
    lease = 3.0
    with pair(processes=True, kv_lease_duration=lease) as pd:
        pd.submit("orphan", prompt(70, 4), 5)
        step_until(pd, "P returned params", lambda: pd.results["orphan"].status == "decoding")
        pd.kill("decode")
        killed = time.monotonic()
        held = True
        while held:
            assert time.monotonic() - killed < lease + 20, "P never freed the blocks"
            _, held = pd.prefill.step()
            held = held or pd.prefill.last_stats["held_blocks"] > 0
            time.sleep(0.02)
        assert time.monotonic() - killed > lease / 2, "P freed before the lease could expire"
        assert pd.prefill.last_stats["free_blocks"] == BASE.num_blocks


def connector_stats(engine: LocalEngine) -> dict[str, Any]:
    totals: dict[str, Any] = {}
    for stats in engine.engine.kv_stats:
        for key, value in stats.to_dict().items():
            totals[key] = totals.get(key, 0) + (len(value) if isinstance(value, list) else value)
    return totals


@pytest.mark.timeout(120)
def test_late_notification_after_lease_expiry_is_counted() -> None:
    """P frees at lease expiry (D has not read yet); D reads later and notifies: P counts a
    notification after expiry and keeps working; nothing leaks after shutdown."""
    threads = {t.ident for t in threading.enumerate()}
    text = prompt(50, 3)
    with pair(processes=False, kv_lease_duration=0.3) as pd:
        assert isinstance(pd.prefill, LocalEngine) and isinstance(pd.decode, LocalEngine)
        pd.prefill.add_request("late", text, 1, {"do_remote_decode": True})
        outputs = []
        while not outputs:
            outputs = [o for o in pd.prefill.step()[0] if o.finished]
        params = outputs[0].kv_transfer_params
        assert params and params["do_remote_prefill"]
        deadline = time.monotonic() + 10
        while pd.prefill.step()[1]:  # P still holds the blocks
            assert time.monotonic() < deadline, "P never freed the blocks at lease expiry"
            time.sleep(0.01)
        assert connector_stats(pd.prefill)["num_kv_expired_reqs"] == 1
        pd.decode.add_request("late", text, 2, params)
        deadline = time.monotonic() + 10
        while pd.decode.step()[1] or not connector_stats(pd.prefill).get(
            "num_notifications_after_expiry"
        ):
            pd.prefill.step()
            assert time.monotonic() < deadline, "P never saw D's late notification"
        assert connector_stats(pd.prefill)["num_notifications_after_expiry"] == 1
        assert connector_stats(pd.decode)["transfer_duration"] == 1
        assert pd.prefill.last_stats["held_blocks"] == 0
    leaked = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive()]
    assert not leaked


def test_config_errors_name_the_field() -> None:
    from kvx import ConfigError, KVTransferConfig

    for extra, needle in (
        ({"side_channel_host": "example.com"}, "side_channel_host: 'example.com' is not an IP"),
        ({"backends": ["RDMA"]}, "backends: ['RDMA'] is not allowed"),
        ({"kv_lease_duration": 0}, "kv_lease_duration"),
        ({"shared_secret": "short"}, "shared_secret: use at least 8 characters"),
        ({"lease": 3}, "lease"),
    ):
        with pytest.raises(ConfigError, match="kv_connector_extra_config") as err:
            KVTransferConfig.from_dict({**kv(**extra), "kv_role": "kv_both"})
        assert needle in str(err.value)
    assert replace(BASE).kv_transfer_config is None
