"""2P2D with NIXL behind `kvx proxy` (the online NIXL P/D test; each D reads from both Ps): the
40 requests complete with one engine's tokens, every server takes its share and the Ds READ
every prompt that shares no prefix, none failing; a P killed between prefill and decode fails
only the requests whose KV it held, per D's `kv_load_failure_policy` (`fail`: an error to that
client; `recompute`: the right tokens anyway), and D keeps serving; a killed D leaves the
rotation and later requests succeed. D0 runs with `fail`, D1 with `recompute`, so one fleet
covers both policies."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import serving_checks as checks
import serving_kit as kit
from serving_client import Request, run

pytestmark = pytest.mark.timeout(900)

NIXL_EXTRA = {"required_layout": None, "handshake_timeout_s": 5, "transfer_timeout_s": 15}
POLICIES = ("fail", "recompute")  # D0's and D1's


@pytest.fixture(scope="module")
def fleet2(fleet: kit.Fleet, long_tiny_model: Path) -> Iterator[kit.Deployment]:
    p_kv = [kit.kvx_json("NixlConnector", "kv_producer", **NIXL_EXTRA)] * 2
    d_kv = [kit.kvx_json("NixlConnector", "kv_consumer", p, **NIXL_EXTRA) for p in POLICIES]
    yield kit.deploy(fleet, long_tiny_model, p_kv, d_kv)


def completions_served(server: Any) -> int:
    return server.log.read_text(errors="replace").count('"POST /v1/completions HTTP/1.1" 200')


def proxy_health(dep: kit.Deployment, url: str) -> str:
    servers = httpx.get(f"{dep.proxy.url}/kvx/servers", timeout=5).json()
    every = [s for role in ("prefill", "decode") for s in servers[role]]
    return next(str(s["health"]) for s in every if s["url"] == url)


BURST_LIMIT_S = 30.0
"""A burst of 10 requests after a kill takes a few seconds; one P lease (30 s) is far beyond."""


def wait_proxy_sees_down(dep: kit.Deployment, url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while proxy_health(dep, url) != "down":
        assert time.monotonic() < deadline, f"the proxy still counts {url} healthy"
        time.sleep(0.5)


def test_2p2d_forty_requests_equal_one_engines_tokens(
    fleet2: kit.Deployment, workload: list[Request], reference: list[list[int]]
) -> None:
    kit.serve_rounds(fleet2, workload, reference)
    served = {s.name: completions_served(s) for s in fleet2.engines}
    assert all(n >= 10 for n in served.values()), f"round robin left a server idle: {served}"

    def d_reads() -> None:  # both Ds READ; together a READ per prompt sharing no prefix
        stats = [checks.logged_stats(d) for d in fleet2.decodes]
        assert all(one.get("Num successful transfers", 0) > 0 for one in stats), stats
        checks.check_nixl_reads(checks.add(*stats), checks.unshared(workload))

    kit.eventually(d_reads)


def prefill(url: str, model: str, req: Request) -> dict[str, Any]:
    """What the proxy does first: P prefills with `do_remote_decode` and returns the params."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    params = reply.json()["kv_transfer_params"]
    assert params and params.get("do_remote_prefill"), params
    return dict(params)


def decode(url: str, model: str, req: Request, params: dict[str, Any]) -> httpx.Response:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_killed_p_fails_or_recomputes_only_its_requests_per_policy(
    fleet2: kit.Deployment, workload: list[Request], reference: list[list[int]]
) -> None:
    model = fleet2.model.name
    p1 = fleet2.prefills[1]
    # two long prompts P1 prefilled, whose KV only P1 holds, then P1 dies
    picks = [i for i, r in enumerate(workload) if len(r.prompt) > 1000][:2]
    params = [prefill(p1.url, model, workload[i]) for i in picks]
    p1.kill()
    p1.proc.wait(30)
    for d, i, p, policy in zip(fleet2.decodes, picks, params, POLICIES):
        start = time.monotonic()
        reply = decode(d.url, model, workload[i], p)
        took = time.monotonic() - start
        assert took < 60, f"D ({policy}) took {took:.0f} s to give up on the dead P"
        if policy == "fail":
            assert reply.status_code >= 400, f"D ({policy}) answered {reply.status_code}"
        else:
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == reference[i]
        assert d.alive, f"D ({policy}) died after a failed load"
    # the proxy takes P1 out; every later request succeeds on P0 and both Ds
    wait_proxy_sees_down(fleet2, p1.url)
    burst = [r for r in workload if r.burst == 0]
    start = time.monotonic()
    results = run(fleet2.proxy.url, model, burst)
    took = time.monotonic() - start
    want = [t for r, t in zip(workload, reference) if r.burst == 0]
    bad = kit.mismatches(burst, results, want)
    assert not bad, "after P1 died:\n" + "\n".join(bad)
    assert took < BURST_LIMIT_S, (
        f"after P1 died, {len(burst)} requests through P0 and D0/D1 took {took:.0f} s"
    )


def test_killed_d_leaves_the_rotation_and_later_requests_succeed(
    fleet2: kit.Deployment, workload: list[Request], reference: list[list[int]]
) -> None:
    d0 = fleet2.decodes[0]
    d0.kill()
    d0.proc.wait(30)
    wait_proxy_sees_down(fleet2, d0.url)
    burst = [r for r in workload if r.burst == 1]
    start = time.monotonic()
    results = run(fleet2.proxy.url, fleet2.model.name, burst)
    took = time.monotonic() - start
    want = [t for r, t in zip(workload, reference) if r.burst == 1]
    bad = kit.mismatches(burst, results, want)
    assert not bad, "after D0 died:\n" + "\n".join(bad)
    # P's lease is 30 s: a burst this slow means D1 waited out leases (a P starving it of CPU)
    assert took < BURST_LIMIT_S, (
        f"after D0 died, {len(burst)} requests through P0/P1 and D1 took {took:.0f} s"
    )
    assert fleet2.decodes[1].alive
