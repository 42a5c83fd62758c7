"""Prometheus metrics of a served P/D deployment: `vllm serve` P and D (kvx's NIXL connector,
then a store) behind `kvx proxy`; all three /metrics are scraped before and after requests and
the series must move by the right amounts: D's bytes equal the blocks vLLM itself counts as
loaded from outside times the model's bytes per block, the proxy counts every request and leg,
and a fault injected for real moves the failure counter of its kind (NIXL: P's lease runs out
when D never reads; store: a stored block corrupted on disk fails its checksum on D).

The same requests check the per-request transfer facts: each non-streamed answer through the
proxy carries both legs' facts in `kv_transfer_params.kvx_transfer`, equal to what D loaded,
D logs one `kvx.requests` line per request whose bytes add up to what D's series counted, and
the corrupted block's answer says its load was recomputed after a checksum failure.

The NIXL deployment also serves pre-connect through `vllm serve`: P on a fixed
`side_channel_port`, D with it in `preconnect`; once D logged its pre-connect, the requests
make no handshake of their own, D still READs each prompt, and the tokens equal P's asked
directly (one engine, no transfer).

One deployment at a time (two vLLM engines at most on this machine)."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import dashboard
import httpx
import pytest
import serving_checks as checks
import serving_cluster as cluster
import serving_kit as kit
from prometheus_client.parser import text_string_to_metric_families
from serving_client import Request, Result, body, complete

pytestmark = pytest.mark.timeout(1200)

BLOCK = checks.BLOCK
PROMPT_LENGTHS = (129, 257, 641)  # each 1 token past whole blocks
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
SCRAPED: dict[str, set[str]] = {}
"""Every sample name scraped in this module with the label keys seen on it (the dashboard
check at the end reads them)."""
PASSED: set[str] = set()
"""The deployments whose test passed (the dashboard check needs both)."""


def scrape(url: str) -> Samples:
    answer = httpx.get(f"{url}/metrics", timeout=10)
    assert answer.status_code == 200, answer.text[:300]
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }
    for name, labels in samples:
        SCRAPED.setdefault(name, set()).update(k for k, _ in labels)
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def block_bytes(model: Path) -> int:
    """KV bytes of one 128-token block of the tiny model (float32, K and V, every layer)."""
    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * BLOCK * 4


def prompts(seed: int) -> list[Request]:
    """Prompts sharing no first block (each needs a load on D), one streamed."""
    rng = random.Random(seed)
    return [
        Request([rng.randrange(4, 512) for _ in range(n)], 2, stream=i == 0)
        for i, n in enumerate(PROMPT_LENGTHS)
    ]


def send_through_proxy(dep: kit.Deployment, requests: list[Request]) -> list[Result]:
    results = []
    with httpx.Client(timeout=120, trust_env=False) as client:
        for req in requests:
            result = complete(client, dep.proxy.url, dep.model.name, req)
            assert result.ok, result.error
            results.append(result)
    return results


def request_log(server: cluster.Server) -> dict[str, dict[str, object]]:
    """The `kvx.requests` lines in a server's log, by request id."""
    marker = " kvx.requests INFO "
    lines = server.log.read_text(errors="replace").splitlines()
    records = [json.loads(line.split(marker, 1)[1]) for line in lines if marker in line]
    return {r["request_id"]: r for r in records}


def check_facts(
    dep: kit.Deployment,
    requests: list[Request],
    results: list[Result],
    loads: Callable[[int], int],
    block_size_bytes: int,
    connector: str,
) -> int:
    """Each non-streamed answer carries P's and D's facts: D loaded `loads(prompt length)`
    tokens, their whole blocks' bytes, from the deployment's connector; D's log has the same
    facts. Returns the bytes D's log lines say were loaded (streamed requests too)."""
    for req, result in zip(requests, results, strict=True):
        if req.stream:  # vLLM sends no kv_transfer_params in a stream: the log line says it
            continue
        legs = (result.kv_transfer_params or {}).get("kvx_transfer")
        assert isinstance(legs, dict) and set(legs) == {"prefill", "decode"}, legs
        d, p = legs["decode"], legs["prefill"]
        tokens = loads(len(req.prompt))
        blocks = -(-tokens // BLOCK)
        load = d["load"]
        got = (load["tokens"], load["blocks"], load["bytes"], load["outcome"])
        assert got == (tokens, blocks, blocks * block_size_bytes, "loaded"), d
        assert d["connector"] == p["connector"] == connector, legs
        assert p["kept"]["blocks"] >= blocks and "load" not in p, p
        assert 0 < load["seconds"] <= d["seconds"], d
    logged = {k: r for k, r in request_log(dep.decodes[0]).items() if LOOK not in k}
    assert len(logged) == len(requests), logged
    for result in results:
        if result.kv_transfer_params:
            d = result.kv_transfer_params["kvx_transfer"]["decode"]
            assert logged[d["request_id"]] == {"leg": "decode", **d}
    return sum(r["load"]["bytes"] for r in logged.values())  # type: ignore[index]


def check_series_moved(
    dep: kit.Deployment, before: list[Samples], after: list[Samples], external_tokens: int
) -> None:
    """The proxy counted every request and leg; vLLM's own count of the prompt tokens D loaded
    from outside is `external_tokens`."""
    proxy0, proxy1 = before[2], after[2]
    n = len(PROMPT_LENGTHS)
    route = "/v1/completions"
    assert moved(proxy0, proxy1, "kvx_proxy_requests_total", route=route, status="200") == n
    for role, server in (("prefill", dep.prefills[0]), ("decode", dep.decodes[0])):
        legs = moved(
            proxy0,
            proxy1,
            "kvx_proxy_upstream_duration_seconds_count",
            role=role,
            server=server.url,
        )
        assert legs == n, (role, legs)
        assert total(proxy1, "kvx_proxy_server_up", role=role, server=server.url) == 1
    assert moved(proxy0, proxy1, "kvx_proxy_time_to_first_token_seconds_count", route=route) == 1
    d0, d1 = before[1], after[1]
    external = moved(d0, d1, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert external == external_tokens, external


LOOK = "kvx-test-look-"
"""The request id's prefix of `wait_preconnected`'s requests (left out of the facts checked)."""


def wait_preconnected(d: cluster.HttpServer, model: str, engines: int) -> None:
    """Until D's logged stats count `engines` pre-connects. D reports its connector's stats
    only from an engine step, so each look sends D a plain one-token request (no P, no load)."""
    body = {"model": model, "prompt": [5], "max_tokens": 1}

    def preconnected() -> None:
        look = {"x-request-id": f"{LOOK}{uuid.uuid4().hex}"}
        reply = httpx.post(f"{d.url}/v1/completions", json=body, headers=look, timeout=60)
        assert reply.status_code == 200, reply.text[:300]
        stats = checks.logged_stats(d)
        assert stats.get("Num preconnects", 0) >= engines, f"{d.name} pre-connected: {stats}"

    kit.eventually(preconnected, 120)


@pytest.fixture
def own_fleet(tmp_path: Path) -> Iterator[kit.Fleet]:
    fleet = kit.Fleet(tmp_path / "logs", [])
    fleet.log_dir.mkdir()
    try:
        yield fleet
    finally:
        fleet.stop()


def test_nixl_pd_series_move_by_what_moved(own_fleet: kit.Fleet, long_tiny_model: Path) -> None:
    extra = {"required_layout": None, "handshake_timeout_s": 5, "transfer_timeout_s": 15}
    side_channel = cluster.free_port()
    dep = kit.deploy(
        own_fleet,
        long_tiny_model,
        [
            kit.kvx_json(
                "NixlConnector",
                "kv_producer",
                kv_lease_duration=8,
                side_channel_port=side_channel,
                **extra,
            )
        ],
        [
            kit.kvx_json(
                "NixlConnector", "kv_consumer", preconnect=[f"127.0.0.1:{side_channel}"], **extra
            )
        ],
    )
    wait_preconnected(dep.decodes[0], dep.model.name, 1)
    servers = [dep.prefills[0].url, dep.decodes[0].url, dep.proxy.url]
    before = [scrape(u) for u in servers]
    requests = prompts(11)
    results = send_through_proxy(dep, requests)
    received = {"connector": "NixlConnector", "direction": "received"}
    size = block_bytes(long_tiny_model)
    facts_bytes = check_facts(dep, requests, results, lambda n: n, size, "NixlConnector")

    def stats_arrived() -> None:
        after = [scrape(u) for u in servers]
        # NIXL: D reads every block of the prompt, the partial last one too
        check_series_moved(dep, before, after, sum(PROMPT_LENGTHS))
        blocks = sum(-(-n // BLOCK) for n in PROMPT_LENGTHS)
        got = moved(before[1], after[1], "kvx_kv_transfer_bytes_total", **received)
        assert got == blocks * size == facts_bytes, (got, blocks, facts_bytes)
        reads = moved(before[1], after[1], "kvx_kv_transfer_duration_seconds_count", **received)
        assert reads >= len(requests)
        failed = moved(before[1], after[1], "kvx_kv_transfer_failures_total")
        assert failed == 0

    kit.eventually(stats_arrived, 30)

    def no_handshake() -> None:  # pre-connected at start-up: no request made a handshake
        stats = checks.logged_stats(dep.decodes[0])
        checks.check_nixl_reads(stats, requests)  # the log holds every request's step
        assert (stats.get("Num preconnects"), stats.get("Num handshakes")) == (1, 0), stats

    kit.eventually(no_handshake, 30)
    with httpx.Client(timeout=120, trust_env=False) as client:  # one engine: P, no transfer
        alone = [complete(client, dep.prefills[0].url, dep.model.name, r) for r in requests]
    assert all(a.ok for a in alone), [a.error for a in alone]
    assert [r.tokens for r in results] == [r.tokens for r in alone], (results, alone)

    # The fault: P prefills a request whose D never comes; its lease (8 s) runs out.
    p = dep.prefills[0]
    mid = scrape(p.url)
    lonely = prompts(12)[1]
    payload = {**body(dep.model.name, lonely), "max_tokens": 1}
    payload["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    reply = httpx.post(
        f"{p.url}/v1/completions",
        json=payload,
        headers={"x-request-id": uuid.uuid4().hex},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text[:300]

    def held_then_expired() -> None:
        now = scrape(p.url)
        assert moved(mid, now, "kvx_kv_transfer_failures_total", kind="timeout") == 1
        assert total(now, "kvx_kv_held_requests", connector="NixlConnector") == 0

    deadline = time.monotonic() + 5
    held_seen = False
    while time.monotonic() < deadline and not held_seen:
        held_seen = total(scrape(p.url), "kvx_kv_held_requests") == 1
        time.sleep(0.2)
    assert held_seen, "P's held request never showed in kvx_kv_held_requests"
    kit.eventually(held_then_expired, 40)
    PASSED.add("nixl")


def test_store_pd_series_move_by_what_moved(
    own_fleet: kit.Fleet, long_tiny_model: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"

    def kv(role: str, policy: str | None = None) -> dict[str, object]:
        url = f"file://{store}"
        return kit.kvx_json("SharedStorageConnector", role, policy, storage_url=url)

    d_kv = kv("kv_consumer", "recompute")  # a failed load is recomputed, not an error
    dep = kit.deploy(own_fleet, long_tiny_model, [kv("kv_producer")], [d_kv])
    servers = [dep.prefills[0].url, dep.decodes[0].url, dep.proxy.url]
    before = [scrape(u) for u in servers]
    requests = prompts(21)
    results = send_through_proxy(dep, requests)
    c = {"connector": "SharedStorageConnector"}
    size = block_bytes(long_tiny_model)
    facts_bytes = check_facts(
        dep, requests, results, checks.store_loadable, size, "SharedStorageConnector"
    )

    def stats_arrived() -> None:
        after = [scrape(u) for u in servers]
        # a store: the whole blocks before each prompt's last token
        loadable = [checks.store_loadable(n) for n in PROMPT_LENGTHS]
        check_series_moved(dep, before, after, sum(loadable))
        blocks = sum(loadable) // BLOCK
        d0, d1 = before[1], after[1]
        loaded = moved(d0, d1, "kvx_kv_transfer_bytes_total", **c, direction="loaded")
        assert loaded == blocks * size == facts_bytes, (loaded, blocks, facts_bytes)
        # blocks as stored: the store's blocks may be smaller than the engine's (16 of 128)
        stored = moved(d0, d1, "kvx_kv_transfer_blocks_total", **c, direction="loaded")
        assert stored >= blocks and stored % blocks == 0, (stored, blocks)
        assert moved(d0, d1, "kvx_kv_hit_tokens_total", **c, source="storage") == blocks * BLOCK
        p0, p1 = before[0], after[0]
        saved_blocks = moved(p0, p1, "kvx_kv_transfer_blocks_total", **c, direction="saved")
        saved = moved(p0, p1, "kvx_kv_transfer_bytes_total", **c, direction="saved")
        assert saved >= blocks * size, (saved, saved_blocks)  # P saved what D loaded, or more
        assert saved_blocks * size * blocks == saved * stored, (saved, saved_blocks)
        assert moved(d0, d1, "kvx_kv_transfer_failures_total", **c) == 0

    kit.eventually(stats_arrived, 30)

    # The fault: P stores a new prompt, one of its stored blocks is corrupted on disk, then D
    # is asked for it: the checksum catches it (D recomputes: policy recompute).
    fresh = prompts(22)[2]
    p, d = dep.prefills[0], dep.decodes[0]
    with httpx.Client(timeout=120, trust_env=False) as client:
        assert complete(client, p.url, dep.model.name, fresh).ok
    files_before = {f for f in store.rglob("*") if f.is_file()}
    assert files_before, "P stored nothing"
    newest = max(files_before, key=lambda f: f.stat().st_mtime)
    data = bytearray(newest.read_bytes())
    data[-8] ^= 0xFF  # inside the payload, after the header
    newest.write_bytes(bytes(data))
    mid = scrape(d.url)
    with httpx.Client(timeout=120, trust_env=False) as client:
        answer = complete(client, d.url, dep.model.name, fresh)
    assert answer.ok, answer.error
    load = (answer.kv_transfer_params or {})["kvx_transfer"]["decode"]["load"]
    assert (load["outcome"], load.get("failure")) == ("recomputed", "checksum"), load
    kit.eventually(
        lambda: _assert_moved(
            mid, scrape(d.url), "kvx_kv_transfer_failures_total", 1, kind="checksum"
        ),
        30,
    )
    PASSED.add("store")


def _assert_moved(before: Samples, after: Samples, name: str, by: float, **labels: str) -> None:
    got = moved(before, after, name, **labels)
    assert got == by, (name, labels, got)


def test_every_dashboard_query_matches_the_scrapes_above() -> None:
    """Runs after the two deployments: their scrapes hold every series the dashboard uses."""
    if {"nixl", "store"} != PASSED:
        pytest.fail(f"needs both deployments of this module to pass; passed: {sorted(PASSED)}")
    assert not dashboard.problems(SCRAPED), "\n".join(dashboard.problems(SCRAPED))
