"""Failures end the request per kv_load_failure_policy, in bounded time, with every block
back in D's pool: a dead P (GET), KV that never arrives (PUT), a PUT refused because D's
receive buffer is full."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kvx.engine.disagg import DisaggregatedPair, baseline_tokens, pd_configs
from kvx.engine.engine import EngineConfig
from kvx.engine.server import EngineHandle

from ._ports import free_port_range, p2p_config

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=64)
PROMPT = list(range(3, 43))


def _finish(decode: EngineHandle, request_id: str, timeout_s: float = 30) -> tuple[str, list]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outputs, _ = decode.step()
        for out in outputs:
            if out.request_id == request_id and out.finished:
                return out.status.value, out.output_token_ids
        time.sleep(0.01)
    raise AssertionError(f"{request_id} did not finish within {timeout_s}s")


def _drained(handle: EngineHandle, config: EngineConfig) -> None:
    handle.step()
    assert handle.last_stats["held_blocks"] == 0
    assert handle.last_stats["free_blocks"] == config.num_blocks


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("send_type", "policy"), [("GET", "fail"), ("PUT_ASYNC", "recompute")])
def test_kv_that_never_comes_ends_the_request_per_policy(send_type: str, policy: str) -> None:
    port = free_port_range(4)
    kv = p2p_config(send_type, port, transfer_timeout_s=1)
    kv["kv_load_failure_policy"] = policy
    _, d = pd_configs(BASE, kv)
    dead = free_port_range(1)  # nobody listens there (GET); nothing was pushed (PUT)
    params = {
        "do_remote_prefill": True,
        "remote_request_id": "ghost",
        "remote_address": f"127.0.0.1:{dead}",
        "remote_tp_size": 1,
        "remote_pp_size": 1,
        "remote_num_tokens": len(PROMPT),
        "send_type": send_type,
    }
    with DisaggregatedPair(replace(d, kv_transfer_config=None), d, processes=False) as pair:
        start = time.monotonic()
        pair.decode.add_request("r", PROMPT, 3, params)
        status, tokens = _finish(pair.decode, "r")
        assert time.monotonic() - start < 20
        if policy == "fail":
            assert status == "finished_error"
        else:
            assert status == "finished_length_capped"
            assert tokens == baseline_tokens(d, {"r": PROMPT}, 3)["r"]  # recomputed
        _drained(pair.decode, d)


@pytest.mark.timeout(60)
def test_refused_put_fails_the_request_at_once() -> None:
    port = free_port_range(4)
    kv = p2p_config("PUT", port, mem_pool_size_gb=0, transfer_timeout_s=20)
    kv["kv_buffer_size"] = 1024  # smaller than one layer's slice: D refuses every PUT
    p, d = pd_configs(BASE, kv)
    with DisaggregatedPair(p, d, processes=False) as pair:
        start = time.monotonic()
        report = pair.run({"r": PROMPT}, 3, timeout_s=40)
        assert report.results["r"].status == "finished_error"  # policy "fail" (the default)
        assert time.monotonic() - start < 15  # refused, not waited out (timeout is 20 s)
        _drained(pair.decode, d)
        _drained(pair.prefill, p)
