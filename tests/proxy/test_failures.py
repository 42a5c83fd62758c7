"""Failing, hanging and killed servers behind `kvx proxy`: which requests are retried, what the
client is told, and how servers leave and rejoin the rotation. Nothing may hang.

The upstream servers are small real HTTP servers on loopback ports standing in for vLLM
(tests/proxy/upstream_server.py); the killed one runs in its own process and gets SIGKILL.
The real `vllm serve` P/D runs belong to tests/vllm.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(90)

HOLD_LIMIT_S = 20.0  # how long the stub holds a request at most (upstream_server.HOLD_LIMIT_S)


def health_of(client: httpx.Client, proxy_url: str, role: str, url: str) -> str:
    servers = client.get(f"{proxy_url}/kvx/servers").json()[role]
    return next(s["health"] for s in servers if s["url"] == url)


def test_killed_decode_server_leaves_rotation_and_returns(
    stub, stub_process, free_port, start_proxy, client, wait_until
):
    p, d1 = stub("P"), stub("D1")
    port = free_port()
    d2_url = f"http://127.0.0.1:{port}"
    d2 = stub_process("D2", port)
    # health checks each second: the requests right after the kill reach D2 before a check
    # does (with checks every 0.2 s a check could take D2 out first and no request would fail)
    proxy = start_proxy([p.url], [d1.url, d2_url], health_interval=1.0)
    wait_until(lambda: client.get(f"{proxy.url}/health").status_code == 200, 10, "ready")
    before = [client.post(f"{proxy.url}/v1/completions", json={"prompt": "a"}) for _ in "ab"]
    assert {a.json()["choices"][0]["text"] for a in before} == {
        "decoded by D1",
        "decoded by D2",
    }

    d2.kill()
    d2.wait(10)
    # Requests right after the kill still succeed: one that reaches the dead D2 before a
    # health check does could not connect, so it is safely sent to D1 instead.
    during = [client.post(f"{proxy.url}/v1/completions", json={"prompt": "b"}) for _ in "abcd"]
    assert [a.status_code for a in during] == [200] * 4
    assert {a.headers["x-kvx-decode"] for a in during} == {d1.url}
    wait_until(lambda: health_of(client, proxy.url, "decode", d2_url) == "down", 10, "D2 down")
    status = client.get(f"{proxy.url}/kvx/servers").json()["decode"][1]
    assert "cannot connect" in status["last_error"]
    health = client.get(f"{proxy.url}/health")  # still serving, with one D of two
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    [down] = health.json()["down"]
    assert (down["role"], down["url"]) == ("decode", d2_url)
    assert "cannot connect" in down["last_error"]  # a request's or a health check's

    stub_process("D2", port)
    wait_until(lambda: health_of(client, proxy.url, "decode", d2_url) == "up", 10, "D2 up")
    status = client.get(f"{proxy.url}/kvx/servers").json()["decode"][1]
    assert (status["health"], status["last_error"]) == ("up", None)  # no stale reason
    assert status["failures"] >= 1  # the history stays in the counter
    after = [client.post(f"{proxy.url}/v1/completions", json={"prompt": "c"}) for _ in "ab"]
    assert {a.headers["x-kvx-decode"] for a in after} == {d1.url, d2_url}


def test_failed_prefill_is_retried_on_another_prefill_server(stub, start_proxy, client):
    p1, p2, d = stub("P1"), stub("P2"), stub("D")
    p1.behaviour.completion_status = 500  # its /health still says 200
    proxy = start_proxy([p1.url, p2.url], [d.url])
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 200
    assert answer.headers["x-kvx-prefill"] == p2.url
    assert len(p1.behaviour.completions()) == 1
    assert d.behaviour.completions()[0].body["kv_transfer_params"]["remote_engine_id"] == "P2"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_unreachable_server_is_taken_out_at_once_and_the_request_retried(
    stub, free_port, start_proxy, client, wait_until, role
):
    p, d = stub("P"), stub("D")
    dead_url = f"http://127.0.0.1:{free_port()}"
    prefill = [dead_url, p.url] if role == "prefill" else [p.url]
    decode = [dead_url, d.url] if role == "decode" else [d.url]
    # Health checks so rare that only the failed request can notice the dead server.
    proxy = start_proxy(prefill, decode, health_interval=3600)
    dead = next(s for s in proxy.pool.servers() if s.url == dead_url)
    wait_until(lambda: dead.checked_at is not None, 10, "the first round of health checks")
    proxy.pool.mark_up(dead)  # as if it died after its last check
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 200
    assert answer.headers[f"x-kvx-{role}"] == (p.url if role == "prefill" else d.url)
    assert health_of(client, proxy.url, role, dead_url) == "down"
    assert dead.failures == 1


def test_every_prefill_failing_gives_502_naming_each_server(stub, start_proxy, client):
    p1, p2, d = stub("P1"), stub("P2"), stub("D")
    p1.behaviour.completion_status = p2.behaviour.completion_status = 503
    proxy = start_proxy([p1.url, p2.url], [d.url])
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["type"] == "bad_gateway"
    assert [(a["server"], a["role"]) for a in error["attempts"]] == [
        (p1.url, "prefill"),
        (p2.url, "prefill"),
    ]
    assert error["attempts"][0]["reason"].startswith("answered HTTP 503: ")
    assert "P1 refuses" in error["attempts"][0]["reason"]
    assert d.behaviour.completions() == []
    assert [s.outstanding for s in proxy.pool.servers()] == [0, 0, 0]


def test_no_healthy_decode_server_gives_503_before_prefill_runs(
    stub, start_proxy, client, wait_until
):
    p, d = stub("P"), stub("D")
    d.behaviour.health_status = 500
    proxy = start_proxy([p.url], [d.url])
    wait_until(lambda: health_of(client, proxy.url, "decode", d.url) == "down", 10, "D down")
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 503
    message = answer.json()["error"]["message"]
    assert message.startswith(f"no healthy decode server: {d.url} (down since ")
    assert message.endswith("GET /health answered HTTP 500)")
    assert p.behaviour.completions() == []


def test_hanging_prefill_gives_504_within_the_request_timeout(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    p.behaviour.hold = threading.Event()  # never answers (until the stub stops)
    proxy = start_proxy([p.url], [d.url], request_timeout=1.0)
    started = time.monotonic()
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    elapsed = time.monotonic() - started
    assert answer.status_code == 504
    assert answer.json()["error"]["message"] == (
        f"prefill server {p.url}: no answer within 1 s (--request-timeout)"
    )
    assert elapsed < HOLD_LIMIT_S / 2, f"the 504 took {elapsed:.1f} s"
    assert d.behaviour.completions() == []


def read_cut_stream(client: httpx.Client, url: str) -> bytes:
    """A streamed completion's bytes; asserts the proxy cut the connection mid-body (so every
    HTTP client, vLLM's benchmark client too, reports the request as failed)."""
    received = b""
    with client.stream("POST", f"{url}/v1/completions", json={"stream": True}) as answer:
        assert answer.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            for chunk in answer.iter_raw():
                received += chunk
    return received


def error_event(received: bytes, prefix: bytes) -> dict:
    assert received.startswith(prefix)
    event = received[len(prefix) :]
    assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
    assert b"[DONE]" not in event
    return json.loads(event[len(b"data: ") :])["error"]


def test_hanging_decode_stream_ends_with_an_error_event(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    d.behaviour.stream_chunks = [b"data: one\n\n", b"data: [DONE]\n\n"]
    d.behaviour.hold_after_first_chunk = threading.Event()  # sends one chunk, then nothing
    proxy = start_proxy([p.url], [d.url], request_timeout=3.0)
    error = error_event(read_cut_stream(client, proxy.url), b"data: one\n\n")
    assert error["code"] == 504
    assert error["message"] == f"decode server {d.url}: no answer within 3 s (--request-timeout)"


def test_decode_dying_mid_stream_ends_with_an_error_event(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    d.behaviour.stream_chunks = [b"data: one\n\n", b"data: tw", b"o\n\n", b"data: [DONE]\n\n"]
    d.behaviour.cut_stream_after = 2
    proxy = start_proxy([p.url], [d.url])
    received = read_cut_stream(client, proxy.url)
    # The half-sent event is closed off, then the error follows as its own event.
    error = error_event(received, b"data: one\n\ndata: tw\n\n")
    assert error["code"] == 502
    assert error["message"].startswith(f"decode server {d.url}: closed the connection mid-answer")
    status = client.get(f"{proxy.url}/kvx/servers").json()["decode"][0]
    assert status["outstanding"] == 0 and status["failures"] == 1


def test_decode_error_event_ends_the_stream_without_done_and_counts(stub, start_proxy, client):
    """vLLM ends a request that failed mid-generation (its engine died, a KV load failed) with
    an error event and then `[DONE]`: the client gets the error event, no `[DONE]`, a cut."""
    p, d = stub("P"), stub("D")
    vllm_error = b'data: {"error": {"message": "EngineCore died", "type": "x", "code": 500}}\n\n'
    token = b'data: {"choices": [{"text": "error"}]}\n\n'  # the word alone is no error
    d.behaviour.stream_chunks = [token, vllm_error + b"data: [DONE]\n\n"]
    proxy = start_proxy([p.url], [d.url])
    received = read_cut_stream(client, proxy.url)
    assert received == token + vllm_error
    status = client.get(f"{proxy.url}/kvx/servers").json()["decode"][0]
    assert status["outstanding"] == 0 and status["failures"] == 1
    metrics = client.get(f"{proxy.url}/metrics").text
    assert f'kvx_proxy_upstream_errors_total{{role="decode",server="{d.url}"}} 1.0' in metrics


def test_decode_answering_500_is_passed_on_counted_and_logged(stub, start_proxy, client, caplog):
    """D answers 500 when it could not load the KV cache (kv_load_failure_policy fail)."""
    p, d = stub("P"), stub("D")
    d.behaviour.completion_status = 500
    proxy = start_proxy([p.url], [d.url])
    answer = client.post(
        f"{proxy.url}/v1/completions", json={"prompt": "a"}, headers={"x-request-id": "req-500"}
    )
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "D refuses"
    assert client.get(f"{proxy.url}/kvx/servers").json()["decode"][0]["failures"] == 1
    metrics = client.get(f"{proxy.url}/metrics").text
    assert f'kvx_proxy_upstream_errors_total{{role="decode",server="{d.url}"}} 1.0' in metrics
    logged = [r.getMessage() for r in caplog.records if "req-500" in r.getMessage()]
    assert any("answered HTTP 500" in line for line in logged), logged


def test_client_leaving_mid_stream_releases_the_decode_server(
    stub, start_proxy, client, wait_until
):
    p, d = stub("P"), stub("D")
    d.behaviour.hold_after_first_chunk = threading.Event()
    proxy = start_proxy([p.url], [d.url])
    with client.stream("POST", f"{proxy.url}/v1/completions", json={"stream": True}) as answer:
        # Keep the iterator: a dropped one is closed at once, and closes the connection with it.
        chunks = answer.iter_raw()
        next(chunks)
        assert proxy.pool.servers()[1].outstanding == 1
    wait_until(lambda: proxy.pool.servers()[1].outstanding == 0, 10, "D's request to be closed")


def test_prefill_answer_without_usable_kv_transfer_params_gives_502(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    p.behaviour.prefill_params = "blocks 1-3"  # type: ignore[assignment]
    proxy = start_proxy([p.url], [d.url])
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 502
    [attempt] = answer.json()["error"]["attempts"]
    assert attempt == {
        "server": p.url,
        "role": "prefill",
        "reason": "answered with kv_transfer_params that is not an object: 'blocks 1-3'",
    }
    assert d.behaviour.completions() == []


def test_client_body_that_never_ends_gives_408(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url], body_timeout=0.5)

    def trickle():
        yield b'{"prompt": '
        time.sleep(2)
        yield b'"x"}'

    answer = client.post(f"{proxy.url}/v1/completions", content=trickle())
    assert answer.status_code == 408
    assert answer.json()["error"]["message"] == (
        "the request body did not arrive within 0.5 s (--body-timeout)"
    )


def test_hanging_non_streamed_decode_gives_504(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    d.behaviour.hold = threading.Event()
    proxy = start_proxy([p.url], [d.url], request_timeout=3.0)
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 504
    error = answer.json()["error"]
    assert error["attempts"] == [
        {"server": d.url, "role": "decode", "reason": "no answer within 3 s (--request-timeout)"}
    ]
