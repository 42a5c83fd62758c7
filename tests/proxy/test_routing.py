"""Routing among several P and D servers, and servers added or removed while the proxy runs.

The upstream servers are small real HTTP servers on loopback ports standing in for vLLM
(tests/proxy/upstream_server.py); the real `vllm serve` P/D runs belong to tests/vllm.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvx.proxy import Role

pytestmark = pytest.mark.timeout(60)


def served_by(answers) -> list[tuple[str, str]]:
    return [(a.headers["x-kvx-prefill"], a.headers["x-kvx-decode"]) for a in answers]


def test_round_robin_takes_servers_in_turn(stub, start_proxy, client):
    p1, p2, d1, d2 = stub("P1"), stub("P2"), stub("D1"), stub("D2")
    proxy = start_proxy([p1.url, p2.url], [d1.url, d2.url], routing="round_robin")
    answers = [
        client.post(f"{proxy.url}/v1/completions", json={"prompt": str(i)}) for i in range(4)
    ]
    assert served_by(answers) == [
        (p1.url, d1.url),
        (p2.url, d2.url),
        (p1.url, d1.url),
        (p2.url, d2.url),
    ]
    # The D that decoded each request got the KV of the P that prefilled it.
    for answer in answers:
        prefill_name = "P1" if answer.headers["x-kvx-prefill"] == p1.url else "P2"
        assert answer.json()["kv_transfer_params_received"]["remote_engine_id"] == prefill_name


@pytest.mark.parametrize(
    ("routing", "expected"),
    [("least_outstanding", ["D2", "D2", "D2"]), ("round_robin", ["D2", "D1", "D2"])],
)
def test_least_outstanding_avoids_the_busy_decode_server(
    stub, start_proxy, client, routing, expected
):
    p, d1, d2 = stub("P"), stub("D1"), stub("D2")
    # D1 streams its first chunk of the first request, then keeps that request open.
    d1.behaviour.hold_after_first_chunk = release_d1 = threading.Event()
    proxy = start_proxy([p.url], [d1.url, d2.url], routing=routing)
    busy = {"prompt": "long", "stream": True}
    with client.stream("POST", f"{proxy.url}/v1/completions", json=busy) as stream:
        assert stream.headers["x-kvx-decode"] == d1.url
        chunks = stream.iter_raw()
        next(chunks)  # D1 now has one request in flight
        answers = [
            client.post(f"{proxy.url}/v1/completions", json={"prompt": str(i)}) for i in range(3)
        ]
        release_d1.set()
        rest = b"".join(chunks)
    assert rest.endswith(b"data: [DONE]\n\n")
    names = {d1.url: "D1", d2.url: "D2"}
    assert [names[a.headers["x-kvx-decode"]] for a in answers] == expected
    status = client.get(f"{proxy.url}/kvx/servers").json()
    assert [s["outstanding"] for s in status["decode"]] == [0, 0]
    assert [s["requests"] for s in status["decode"]] == [
        1 + expected.count("D1"),
        expected.count("D2"),
    ]


def test_decode_server_is_chosen_first_and_counted_busy_while_prefill_works(
    stub, start_proxy, client, wait_until
):
    p, d1, d2 = stub("P"), stub("D1"), stub("D2")
    p.behaviour.hold = release_p = threading.Event()
    proxy = start_proxy([p.url], [d1.url, d2.url], routing="least_outstanding")
    with ThreadPoolExecutor(2) as requests:
        first = requests.submit(client.post, f"{proxy.url}/v1/completions", json={"prompt": "a"})
        wait_until(lambda: len(p.behaviour.completions()) == 1, 10, "the first prefill")
        assert [s.outstanding for s in proxy.pool.servers()] == [1, 1, 0]
        second = requests.submit(client.post, f"{proxy.url}/v1/completions", json={"prompt": "b"})
        wait_until(lambda: len(p.behaviour.completions()) == 2, 10, "the second prefill")
        assert [s.outstanding for s in proxy.pool.servers()] == [2, 1, 1]
        release_p.set()
        answers = [first.result(timeout=15), second.result(timeout=15)]
    assert [a.headers["x-kvx-decode"] for a in answers] == [d1.url, d2.url]
    assert [s.outstanding for s in proxy.pool.servers()] == [0, 0, 0]


def test_servers_added_and_removed_at_run_time(stub, start_proxy, client, wait_until):
    p, d1, d2 = stub("P"), stub("D1"), stub("D2")
    proxy = start_proxy([p.url], [d1.url])
    added = proxy.pool.add(Role.DECODE, d2.url + "/")
    assert added.url == d2.url
    assert proxy.pool.add("decode", d2.url) is added  # adding twice changes nothing
    answers = [
        client.post(f"{proxy.url}/v1/completions", json={"prompt": str(i)}) for i in range(2)
    ]
    assert {a.headers["x-kvx-decode"] for a in answers} == {d1.url, d2.url}
    wait_until(lambda: added.health.value == "up", 10, "the added server to be checked")

    assert proxy.pool.remove(Role.DECODE, d1.url)
    assert not proxy.pool.remove(Role.DECODE, d1.url)
    answers = [
        client.post(f"{proxy.url}/v1/completions", json={"prompt": str(i)}) for i in range(3)
    ]
    assert {a.headers["x-kvx-decode"] for a in answers} == {d2.url}
    assert [s["url"] for s in client.get(f"{proxy.url}/kvx/servers").json()["decode"]] == [d2.url]
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        proxy.pool.add(Role.PREFILL, "localhost:1234")
