"""The vLLM adapter's per-request transfer facts, driven as vLLM's scheduler drives them (the
served proof is tests/vllm/serving/test_metrics_serving.py)."""

from __future__ import annotations

import json
import logging

import pytest

from kvx.adapters.request_facts import FACTS_KEY, MAX_PEER_FACTS_BYTES, RequestFacts
from kvx.contract.stats import KVConnectorStats, TransferFigures
from kvx.contract.types import NULL_BLOCK, KVCacheBlocks, KVCacheSpec, Request

CACHE = KVCacheSpec(("l0", "l1"), num_kv_heads=2, head_size=8, block_size=16, dtype="float32")
BLOCK_BYTES = 2 * 2 * 2 * 8 * 16 * 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FailedStats(KVConnectorStats):
    def figures(self) -> TransferFigures:
        return TransferFigures(failures=dict(self.data))


def request(req_id: str, tokens: int, params: dict[str, object] | None = None) -> Request:
    return Request(
        request_id=req_id, prompt_token_ids=list(range(tokens)), kv_transfer_params=params
    )


def facts(policy: str = "recompute") -> tuple[RequestFacts, Clock]:
    clock = Clock()
    return RequestFacts("StoreX", "engine-1", CACHE, policy, clock), clock


def test_block_bytes_is_every_layer_k_and_v() -> None:
    assert facts()[0].block_bytes == BLOCK_BYTES


def test_an_async_load_reports_tokens_bytes_time_and_peer(caplog: pytest.LogCaptureFixture) -> None:
    f, clock = facts()
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 5600}
    params[FACTS_KEY] = {"prefill": {"connector": "P", "kept": {"blocks": 3}}}
    req = request("r1", 41, params)
    req.num_computed_tokens = 16  # one block hit locally: tokens 16..41 load, blocks 1..2
    f.arrived("r1")
    f.matched("r1", is_async=True)
    f.allocated(req, KVCacheBlocks(([7, 8, 9],), (1,)), 25)
    f.sources("r1", {"storage": 25, "disk": 0})
    clock.now += 0.5
    f.output(["other"], [], set(), None)
    assert f._live["r1"].load.outcome is None  # type: ignore[union-attr]
    clock.now += 0.25
    f.output(["r1"], [], set(), None)
    clock.now += 1.0
    with caplog.at_level(logging.INFO, logger="kvx.requests"):
        out = f.finished(req, [7, 8, 9], False, {"x": 1})
    assert out["x"] == 1
    legs = out[FACTS_KEY]
    assert legs["prefill"] == params[FACTS_KEY]["prefill"]  # type: ignore[index]
    load = legs["decode"]["load"]
    assert load == {
        "tokens": 25,
        "blocks": 2,
        "bytes": 2 * BLOCK_BYTES,
        "seconds": 0.75,
        "outcome": "loaded",
        "sources": {"storage": 25},
        "peer": "10.0.0.1:5600",
    }
    assert legs["decode"]["seconds"] == 1.75
    assert "kept" not in legs["decode"]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvx.requests"]
    assert json.loads(line) == {"leg": "decode", **legs["decode"]}
    assert len(f) == 0


def test_a_block_that_failed_to_load_names_the_request_and_the_kind() -> None:
    f, clock = facts()
    a, b = request("a", 32), request("b", 32)
    for req, blocks in ((a, [1, 2]), (b, [3, 4])):
        f.arrived(req.request_id)
        f.matched(req.request_id, is_async=False)
        f.allocated(req, KVCacheBlocks((blocks,), (0,)), 31)
    f.scheduled(["a", "b"])
    clock.now += 0.1
    f.output([], [], {4}, FailedStats({"checksum": 1}))
    clock.now += 0.1
    f.scheduled(["a", "b"])
    fa = f.finished(a, [1, 2], False, None)[FACTS_KEY]["decode"]["load"]
    fb = f.finished(b, [3, 4], False, None)[FACTS_KEY]["decode"]["load"]
    assert (fa["outcome"], fb["outcome"], fb["failure"]) == ("loaded", "recomputed", "checksum")
    assert "failure" not in fa
    assert fb["bytes"] == 2 * BLOCK_BYTES and fb["tokens"] == 31


def test_failed_receives_under_the_fail_policy_say_failed() -> None:
    f, _ = facts("fail")
    req = request("r", 20)
    f.matched("r", is_async=True)
    f.allocated(req, KVCacheBlocks(([5, 6],), (0,)), 20)
    f.output(["r"], ["r"], set(), None)
    load = f.finished(req, [5, 6], False, None)[FACTS_KEY]["decode"]["load"]
    assert (load["outcome"], load["failure"]) == ("failed", "unknown")


def test_p_says_what_it_kept_for_d() -> None:
    f, _ = facts()
    big = {"prefill": {"x": "y" * MAX_PEER_FACTS_BYTES}}
    req = request("p", 40, {"do_remote_decode": True, FACTS_KEY: big})
    f.arrived("p")
    out = f.finished(req, [NULL_BLOCK, 3, 4, 5], True, None)
    assert set(out[FACTS_KEY]) == {"prefill"}
    prefill = out[FACTS_KEY]["prefill"]  # its own, not the oversized incoming entry
    assert prefill["kept"] == {"blocks": 3, "bytes": 3 * BLOCK_BYTES, "held": True}
    assert "load" not in prefill and prefill["prompt_tokens"] == 40


def test_oversized_or_malformed_facts_of_the_other_leg_are_dropped() -> None:
    f, _ = facts()
    for bad in ({"prefill": {"x": "y" * MAX_PEER_FACTS_BYTES}}, {"prefill": "text"}, ["x"]):
        req = request("d", 8, {FACTS_KEY: bad})
        assert set(f.finished(req, [], False, None)[FACTS_KEY]) == {"decode"}, bad
