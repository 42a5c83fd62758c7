"""2P2D with NIXL behind `kvx proxy` (the online NIXL P/D test; each D reads from both Ps): the
40 requests complete with one engine's tokens, every server takes its share and the Ds READ
every prompt that shares no prefix, none failing; a P killed between prefill and decode fails
only the requests whose KV it held, per D's `kv_load_failure_policy` (`fail`: an error to that
client; `recompute`: the right tokens anyway), and D keeps serving; a killed D leaves the
rotation and later requests succeed. D0 runs with `fail`, D1 with `recompute`, so one fleet
covers both policies.

The same fleet serves the proxy's fleet behaviour: with the Ps publishing their KV events, a
second proxy routing `kv_aware` gets more prefix-cache hits on the Ps than round robin for the
same shape of shared-prefix traffic, with the tokens D alone computes; and a D killed while
streams are in flight on it fails every one of them by the rule of `vllm bench serve`'s own
client, /health turning `degraded`."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import serving_checks as checks
import serving_cluster as cluster
import serving_kit as kit
from serving_client import Request, run

pytestmark = pytest.mark.timeout(900)

NIXL_EXTRA = {"required_layout": None, "handshake_timeout_s": 5, "transfer_timeout_s": 15}
POLICIES = ("fail", "recompute")  # D0's and D1's


def events_endpoint(fleet: kit.Fleet, name: str) -> str:
    """Where P `name` publishes its KV events: an ipc socket (local only, no port)."""
    return f"ipc://{fleet.log_dir}/{name}-kv-events"


@pytest.fixture(scope="module")
def fleet2(fleet: kit.Fleet, long_tiny_model: Path) -> Iterator[kit.Deployment]:
    p_kv = [kit.kvx_json("NixlConnector", "kv_producer", **NIXL_EXTRA)] * 2
    d_kv = [kit.kvx_json("NixlConnector", "kv_consumer", p, **NIXL_EXTRA) for p in POLICIES]
    events = [
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint(fleet, p)}
        for p in ("P0", "P1")
    ]
    p_extra = [["--kv-events-config", json.dumps(e)] for e in events]
    yield kit.deploy(fleet, long_tiny_model, p_kv, d_kv, p_extra=p_extra)


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


def prefix_hits(server: cluster.HttpServer) -> float:
    """Prompt tokens the server found in its prefix cache, ever (vllm:prefix_cache_hits)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.findall(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert found, "P exports no vllm:prefix_cache_hits_total"
    return sum(float(v) for v in found)


def shared_prefix_prompts(seed: int) -> list[str]:
    """Three documents of 120 words (~500 tokens), each asked four questions, the documents in
    turn (so round robin over two Ps sends each document's questions to both)."""
    rng = random.Random(seed)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "river",
        "stone",
        "cloud",
        "paper",
        "seven",
        "orange",
        "quiet",
        "lamp",
    ]
    docs = [" ".join(rng.choice(words) for _ in range(120)) for _ in range(3)]
    return [f"Document: {d}\nQuestion {j}: what is word {j + 1}?" for j in range(4) for d in docs]


def completion_tokens(url: str, model: str, prompt: str) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["choices"][0]["token_ids"])


def test_kv_aware_routing_raises_prefix_hits_over_round_robin(
    fleet: kit.Fleet, fleet2: kit.Deployment
) -> None:
    model = fleet2.model.name
    kv_args = [f"--kv-events={p.url}={events_endpoint(fleet, p.name)}" for p in fleet2.prefills]
    kv_proxy = fleet.add(
        cluster.proxy_server(
            fleet.log_dir,
            [p.url for p in fleet2.prefills],
            [d.url for d in fleet2.decodes],
            extra=("--health-interval=1", "--request-timeout=120", "--routing=kv_aware", *kv_args),
            name="proxy-kv-aware",
        )
    )
    kv_proxy.wait_healthy(60)
    hits: dict[str, float] = {}
    for policy, url, seed in (("round_robin", fleet2.proxy.url, 1), ("kv_aware", kv_proxy.url, 2)):
        prompts = shared_prefix_prompts(seed)  # new documents: no hits from the other run
        # the tokens D alone computes (no P, no transfer) are the reference
        want = [completion_tokens(fleet2.decodes[1].url, model, p) for p in prompts]
        before = sum(prefix_hits(p) for p in fleet2.prefills)
        got = []
        for prompt in prompts:  # one at a time: each sees the KV events of the previous
            got.append(completion_tokens(url, model, prompt))
            time.sleep(0.2)
        hits[policy] = sum(prefix_hits(p) for p in fleet2.prefills) - before
        assert got == want, f"{policy}: the tokens differ from D's alone"
    # round robin: each document's first question misses on both Ps; kv_aware: on one only
    assert hits["kv_aware"] >= 1.3 * hits["round_robin"] > 0, hits
    index = httpx.get(f"{kv_proxy.url}/kvx/servers", timeout=10).json()["kv_index"]
    assert index["routed_by_prefix"]["prefill"] >= 9, index  # 3 questions of 3 documents
    assert index["events"]["refused"] == 0, index


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


def proxy_status(dep: kit.Deployment) -> dict[str, Any]:
    return dict(httpx.get(f"{dep.proxy.url}/health", timeout=5).json())


async def bench_streams_killing(
    dep: kit.Deployment, victim: cluster.HttpServer, prompts: list[list[int]]
) -> list[tuple[str | None, bool, Any]]:
    """Send `prompts` at once through the proxy with `vllm bench serve`'s own request function;
    a second after the first stream from `victim` began, SIGKILL it. Per request: its decode
    server (the proxy's x-kvx-decode header; None without one), whether it had ended before
    the kill, and the bench's RequestFuncOutput."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_completions,
    )

    decode_of: dict[str, str | None] = {}
    streaming_on_victim = asyncio.Event()

    async def on_end(session: Any, ctx: Any, params: Any) -> None:  # the answer's headers
        decode = params.response.headers.get("x-kvx-decode")
        decode_of[params.headers["x-request-id"]] = decode
        if decode == victim.url:
            streaming_on_victim.set()

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(on_end)
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(trace_configs=[trace], timeout=timeout) as session:
        inputs = [
            RequestFuncInput(
                prompt=prompt,
                api_url=f"{dep.proxy.url}/v1/completions",
                prompt_len=len(prompt),
                output_len=STREAMED_TOKENS,
                model=dep.model.name,
                ignore_eos=True,
                request_id=f"kill-d-{i}",
            )
            for i, prompt in enumerate(prompts)
        ]
        sent = [
            asyncio.ensure_future(async_request_openai_completions(one, session)) for one in inputs
        ]
        await asyncio.wait_for(streaming_on_victim.wait(), 120)
        await asyncio.sleep(1.0)  # tokens are flowing
        victim.kill()
        ended = [task.done() for task in sent]
        outputs = await asyncio.wait_for(asyncio.gather(*sent), 180)
    return [
        (decode_of.get(one.request_id or ""), done, out)
        for one, done, out in zip(inputs, ended, outputs)
    ]


STREAMED_TOKENS = 1000


def test_killed_d_fails_its_streams_for_vllm_bench_and_later_requests_succeed(
    fleet2: kit.Deployment, workload: list[Request], reference: list[list[int]]
) -> None:
    d0, d1 = fleet2.decodes
    short = [r.prompt for r in workload if len(r.prompt) < 400][:6]
    served = asyncio.run(bench_streams_killing(fleet2, d0, short))
    d0.proc.wait(30)
    on_d0 = [out for decode, done, out in served if decode == d0.url and not done]
    assert on_d0, f"no stream was in flight on D0 when it was killed: {served}"
    # every request streaming from D0 is a failure by vllm bench serve's own rule
    assert not [out for out in on_d0 if out.success], [out.error[-300:] for out in on_d0]
    # the others were served by D1 in full (a request D0 had not answered yet may also fail)
    on_d1 = [out for decode, _, out in served if decode == d1.url]
    assert all(out.success and out.output_tokens == STREAMED_TOKENS for out in on_d1), on_d1
    wait_proxy_sees_down(fleet2, d0.url)
    health = proxy_status(fleet2)
    assert health["status"] == "degraded" and health["decode"] == {"up": 1, "total": 2}, health
    assert {"role": "decode", "url": d0.url} in [
        {"role": s["role"], "url": s["url"]} for s in health["down"]
    ], health
    d0_status = next(
        s
        for s in httpx.get(f"{fleet2.proxy.url}/kvx/servers", timeout=5).json()["decode"]
        if s["url"] == d0.url
    )
    assert d0_status["failures"] >= len(on_d0), d0_status
    # later requests succeed on D1
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
    assert d1.alive
