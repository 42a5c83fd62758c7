"""`kvx proxy` serves Prometheus metrics on GET /metrics: the series move by exactly the
requests sent, legs timed per server, errors counted on the server that failed, health as a
0/1 gauge. Upstreams are the stub servers of tests/proxy/upstream_server.py (real HTTP)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(90)


def scrape(client: httpx.Client, url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    answer = client.get(f"{url}/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def up(client: httpx.Client, url: str, role: str, server: str) -> float:
    return value(scrape(client, url), "kvx_proxy_server_up", role=role, server=server)


def test_requests_legs_errors_and_health_are_counted(stub, start_proxy, client, wait_until):
    p1, p2, d = stub("P1"), stub("P2"), stub("D")
    p1.behaviour.completion_status = 500  # its /health still says 200: retried on P2
    proxy = start_proxy([p1.url, p2.url], [d.url], routing="round_robin")
    wait_until(lambda: client.get(f"{proxy.url}/health").status_code == 200, 10, "ready")
    wait_until(
        lambda: (
            value(scrape(client, proxy.url), "kvx_proxy_server_up", role="prefill", server=p1.url)
            == 1
        ),
        10,
        "P1 up in /metrics",
    )
    before = scrape(client, proxy.url)
    answers = [client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) for _ in range(4)]
    streamed = client.post(f"{proxy.url}/v1/completions", json={"prompt": "y", "stream": True})
    bad = client.post(f"{proxy.url}/v1/completions", content=b"{not json")
    assert [a.status_code for a in answers] + [streamed.status_code, bad.status_code] == [
        200
    ] * 5 + [400]
    after = scrape(client, proxy.url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/v1/completions"
    assert moved("kvx_proxy_requests_total", route=route, status="200") == 5
    assert moved("kvx_proxy_requests_total", route=route, status="400") == 1
    assert moved("kvx_proxy_request_duration_seconds_count", route=route) == 6
    assert moved("kvx_proxy_time_to_first_token_seconds_count", route=route) == 1
    # round robin over P1, P2: P1 fails some requests (each retried on P2), P2 serves all 5
    p1_sent = moved("kvx_proxy_upstream_requests_total", role="prefill", server=p1.url)
    assert p1_sent >= 1
    assert moved("kvx_proxy_upstream_errors_total", role="prefill", server=p1.url) == p1_sent
    assert moved("kvx_proxy_upstream_errors_total", role="prefill", server=p2.url) == 0
    assert moved("kvx_proxy_upstream_duration_seconds_count", role="prefill", server=p2.url) == 5
    assert (
        moved("kvx_proxy_upstream_duration_seconds_count", role="prefill", server=p1.url) == p1_sent
    )
    assert moved("kvx_proxy_upstream_duration_seconds_count", role="decode", server=d.url) == 5
    assert value(after, "kvx_proxy_server_up", role="decode", server=d.url) == 1
    assert value(after, "kvx_proxy_server_outstanding_requests", role="decode", server=d.url) == 0


def test_a_down_server_reads_0_and_a_streamed_leg_is_timed_to_its_end(
    stub, start_proxy, client, wait_until
):
    p, d = stub("P"), stub("D")
    release = threading.Event()
    d.behaviour.hold_after_first_chunk = release
    proxy = start_proxy([p.url], [d.url])
    wait_until(lambda: client.get(f"{proxy.url}/health").status_code == 200, 10, "ready")
    url = f"{proxy.url}/v1/completions"
    with client.stream("POST", url, json={"prompt": "y", "stream": True}) as answer:
        chunks = answer.iter_raw()
        assert next(chunks)  # the first token is out; D holds the rest of its stream
        time.sleep(0.3)
        release.set()
        assert b"".join(chunks)
    samples = scrape(client, proxy.url)
    leg = value(samples, "kvx_proxy_upstream_duration_seconds_sum", role="decode", server=d.url)
    route = "/v1/completions"
    ttft = value(samples, "kvx_proxy_time_to_first_token_seconds_sum", route=route)
    whole = value(samples, "kvx_proxy_request_duration_seconds_sum", route=route)
    # the leg and the request lasted until D's stream ended, 0.3 s after the first token
    assert leg >= 0.3 and whole - ttft >= 0.3

    d.behaviour.health_status = 503
    wait_until(
        lambda: (
            value(scrape(client, proxy.url), "kvx_proxy_server_up", role="decode", server=d.url)
            == 0
        ),
        10,
        "D down in /metrics",
    )
