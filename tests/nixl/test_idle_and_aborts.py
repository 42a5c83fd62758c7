"""The two root causes behind D engines dying in online P/D serving, over real NIXL:

- an idle P (its engine not stepping) still serves D's READs: the connector's progress thread
  keeps P's agent progressing while it holds blocks (without it the READ stays in progress and
  D's request fails at `transfer_timeout_s`);
- a request D aborts before its read was queued only tells P to free: D's worker never reports
  it received (vLLM has freed it by then and stops the engine on such a report).
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from kvx.engine.disagg import DisaggregatedPair, baseline_tokens, pd_configs
from kvx.engine.engine import EngineConfig
from kvx.engine.server import LocalEngine

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=128)


def kv(policy: str = "fail", **extra: Any) -> dict[str, Any]:
    options = {"kv_lease_duration": 30, "handshake_timeout_s": 5, "transfer_timeout_s": 5}
    return {
        "kv_connector": "NixlConnector",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {**options, **extra},
    }


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(BASE.vocab_size) for _ in range(n)]


def wait_until(what: str, done: Any, step: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"never happened within {timeout_s}s: {what}"
        step()
        time.sleep(0.001)


def hand_off_then_idle(pd: DisaggregatedPair, rid: str, victim: list[int], want: Any) -> Any:
    """Send `victim` through P; once D has it, P takes one more step (the one that starts
    its lease: engines take it, they still hold the request) and then idles while D is
    stepped until it ends the request (KV bytes checked every step). D's last output."""
    pd.submit(rid, victim, 5, want)
    wait_until(
        f"P handed {rid} to D",
        lambda: pd.results[rid].status == "decoding",
        lambda: pd.step(),
    )
    pd.prefill.step()
    assert pd.prefill.last_stats["held_blocks"] > 0
    outputs: list[Any] = []

    def step_decode_only() -> None:
        out, _ = pd.decode.step()
        outputs.extend(out)
        assert not pd.decode.check_kv()

    wait_until(
        f"D ended {rid} with P idle",
        lambda: any(o.request_id == rid and o.finished for o in outputs),
        step_decode_only,
    )
    return next(o for o in outputs if o.request_id == rid and o.finished)


@pytest.mark.timeout(120)
def test_decode_reads_from_an_idle_prefill_engine() -> None:
    """P idles after handing a prompt to D: D's READ still completes, the output equals one
    engine's, every KV byte is checked. Twice: the idle P's first contact with D (handshake
    and UCX connection set-up), then a read on the connected endpoint."""
    first, second = prompt(70, 2), prompt(50, 4)
    expected = baseline_tokens(BASE, {"first": first, "second": second}, 5)
    p, d = pd_configs(BASE, kv())
    with DisaggregatedPair(p, d, processes=True, timeout_s=30) as pd:
        for rid, victim in (("first", first), ("second", second)):
            last = hand_off_then_idle(pd, rid, victim, expected[rid])
            assert last.status.value == "finished_length_capped", last
            assert last.output_token_ids == expected[rid]
            stats = pd.decode.last_stats
            assert stats["load_errors"] == 0 and stats["external_tokens"] > 0, stats
            # P's thread kept D's `done` notifications: its next step frees the blocks.
            pd.prefill.step()
            assert pd.prefill.last_stats["held_blocks"] == 0


@pytest.mark.timeout(120)
def test_idle_progress_can_be_turned_off_and_then_the_read_times_out() -> None:
    """The control for the test above: without the progress thread the same idle P leaves
    D's READ in progress until `transfer_timeout_s`, and under `fail` the request errors."""
    p, d = pd_configs(BASE, kv(idle_progress=False, transfer_timeout_s=2))
    with DisaggregatedPair(p, d, processes=True, timeout_s=30) as pd:
        last = hand_off_then_idle(pd, "victim", prompt(70, 2), None)
        assert last.status.value == "finished_error", last
        assert pd.decode.last_stats["load_errors"] == 1


@pytest.mark.timeout(120)
def test_abort_before_the_read_only_frees_p_and_is_never_reported_received() -> None:
    """D aborts a request before its read was queued: D's worker shakes hands with P and tells
    it to free (P's blocks go back at once, not at lease expiry), and never reports the request
    received."""
    p_config, d_config = pd_configs(BASE, kv())
    prefill, decode = LocalEngine(p_config, name="prefill"), LocalEngine(d_config, name="decode")
    try:
        reported: list[str] = []
        for worker in decode.engine.workers:
            assert worker.connector is not None
            original = worker.connector.get_finished

            def record(finished: set[str], original: Any = original) -> Any:
                sending, recving = original(finished)
                reported.extend(recving or ())
                return sending, recving

            worker.connector.get_finished = record  # type: ignore[method-assign]
        victim = prompt(70, 3)
        prefill.add_request("victim", victim, 1, {"do_remote_decode": True})
        outputs: list[Any] = []
        wait_until(
            "P finished the prefill",
            lambda: any(o.finished for o in outputs),
            lambda: outputs.extend(prefill.step()[0]),
        )
        params = outputs[-1].kv_transfer_params
        assert params and params["do_remote_prefill"]
        assert prefill.last_stats["held_blocks"] > 0
        decode.add_request("victim", victim, 5, dict(params))
        decode.abort_request("victim")

        def step_both() -> None:
            decode.step()
            prefill.step()

        wait_until("P freed the aborted request's blocks", lambda: not _held(prefill), step_both)
        for _ in range(20):  # any late report would come within a few steps
            step_both()
        assert "victim" not in reported
        assert decode.last_stats["load_errors"] == 0
    finally:
        decode.close()
        prefill.close()


def _held(engine: LocalEngine) -> int:
    return int(engine.last_stats.get("held_blocks", 0))
