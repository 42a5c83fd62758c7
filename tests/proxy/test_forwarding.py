"""What P and D receive through `kvx proxy` and what the client gets back.

The upstream servers are small real HTTP servers on loopback ports standing in for vLLM
(tests/proxy/upstream_server.py); the real `vllm serve` P/D runs belong to tests/vllm.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

pytestmark = pytest.mark.timeout(60)


def test_prefill_gets_one_token_request_and_decode_gets_its_kv_transfer_params(
    stub, start_proxy, client
):
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    request = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 7,
        "min_tokens": 2,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    answer = client.post(
        f"{proxy.url}/v1/completions",
        json=request,
        headers={"Authorization": "Bearer sk-test", "X-Request-Id": "req-42"},
    )

    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "decoded by D"
    assert answer.headers["x-kvx-prefill"] == p.url
    assert answer.headers["x-kvx-decode"] == d.url
    assert answer.headers["x-request-id"] == "req-42"

    [to_p] = p.behaviour.completions()
    assert to_p.path == "/v1/completions"
    assert to_p.body == {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    [to_d] = d.behaviour.completions()
    assert to_d.body == {
        **request,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "P",
            "remote_block_ids": [3, 1, 4],
            "remote_host": "127.0.0.1",
            "remote_port": 5555,
        },
    }
    for received in (to_p, to_d):
        assert received.headers["authorization"] == "Bearer sk-test"
        assert received.headers["x-request-id"] == "req-42"


def test_chat_request_caps_max_completion_tokens_for_prefill(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9,
    }
    answer = client.post(f"{proxy.url}/v1/chat/completions", json=request)

    assert answer.status_code == 200, answer.text
    [to_p] = p.behaviour.completions()
    assert to_p.path == "/v1/chat/completions"
    assert to_p.body["max_completion_tokens"] == 1
    assert to_p.body["max_tokens"] == 1
    [to_d] = d.behaviour.completions()
    assert to_d.path == "/v1/chat/completions"
    assert to_d.body["max_completion_tokens"] == 9
    assert "max_tokens" not in to_d.body
    # Each request gets its own id when the client sends none; P and D see the same one.
    assert to_p.headers["x-request-id"] == to_d.headers["x-request-id"]
    assert to_p.headers["x-request-id"] == answer.headers["x-request-id"]


def test_decode_gets_the_request_unchanged_when_prefill_returns_no_params(
    stub, start_proxy, client
):
    p, d = stub("P"), stub("D")
    p.behaviour.prefill_params = {}
    proxy = start_proxy([p.url], [d.url])
    request = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
    assert client.post(f"{proxy.url}/v1/completions", json=request).status_code == 200
    [to_d] = d.behaviour.completions()
    assert to_d.body == request


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_is_passed_through_byte_for_byte_as_it_arrives(stub, start_proxy, client, path):
    p, d = stub("P"), stub("D")
    # Chunk boundaries that do not follow event boundaries, non-ASCII text, a keep-alive comment.
    d.behaviour.stream_chunks = [
        b'data: {"choices": [{"text": "\xc3\xa9t\xc3\xa9"}]}\n',
        b'\ndata: {"choices": [{"te',
        b'xt": " two"}]}\n\n: keep-alive\n\n',
        b"data: [DONE]\n\n",
    ]
    d.behaviour.hold_after_first_chunk = released = threading.Event()
    proxy = start_proxy([p.url], [d.url])
    body = {"model": "tiny", "prompt": "x", "messages": [], "max_tokens": 5, "stream": True}

    received = b""
    first_chunk_before_release = False
    with client.stream("POST", proxy.url + path, json=body) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        for chunk in answer.iter_raw():
            if not received:
                first_chunk_before_release = not released.is_set()
                released.set()
            received += chunk
    assert first_chunk_before_release, "the proxy held D's first chunk back"
    assert received == b"".join(d.behaviour.stream_chunks)
    [to_p] = p.behaviour.completions()
    assert to_p.body["stream"] is False


def test_prefill_refusal_reaches_the_client_and_decode_is_not_asked(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    p.behaviour.completion_status = 400
    proxy = start_proxy([p.url], [d.url])
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 400
    assert answer.json() == {"error": {"message": "P refuses", "code": 42}}
    assert answer.headers["x-kvx-prefill"] == p.url
    assert d.behaviour.completions() == []
    assert [s.outstanding for s in proxy.pool.servers()] == [0, 0]


def test_decode_refusal_of_a_stream_reaches_the_client_whole(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    d.behaviour.completion_status = 422
    proxy = start_proxy([p.url], [d.url])
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x", "stream": True})
    assert answer.status_code == 422
    assert answer.json() == {"error": {"message": "D refuses", "code": 42}}


def test_models_health_and_server_status(stub, start_proxy, client, wait_until):
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    models = client.get(f"{proxy.url}/v1/models")
    assert models.status_code == 200
    assert models.json()["data"][0]["served_by"] == "D"  # decode servers are asked first

    d.behaviour.health_status = 503

    wait_until(
        lambda: client.get(f"{proxy.url}/kvx/servers").json()["decode"][0]["health"] == "down",
        10,
        "the unhealthy decode server to be marked down",
    )
    health = client.get(f"{proxy.url}/health")
    assert health.status_code == 503
    assert health.json() == {
        "status": "unavailable",
        "prefill": {"up": 1, "total": 1},
        "decode": {"up": 0, "total": 1},
        "down": [{"role": "decode", "url": d.url, "last_error": "GET /health answered HTTP 503"}],
    }
    d.behaviour.health_status = 200
    wait_until(
        lambda: client.get(f"{proxy.url}/health").status_code == 200, 10, "the proxy to be ready"
    )
    status = client.get(f"{proxy.url}/kvx/servers").json()
    assert status["routing"] == "round_robin"
    [decode] = status["decode"]
    assert decode["url"] == d.url
    assert decode["health"] == "up"
    assert decode["last_error"] is None  # it is up: the reason it was down no longer applies
    assert {"outstanding", "requests", "failures", "since", "checked_at"} <= decode.keys()


def test_client_errors_are_json(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    not_json = client.post(f"{proxy.url}/v1/completions", content=b"{oops")
    assert not_json.status_code == 400
    assert "not valid JSON" in not_json.json()["error"]["message"]
    not_object = client.post(f"{proxy.url}/v1/completions", json=[1, 2])
    assert not_object.status_code == 400
    assert not_object.json()["error"]["message"] == (
        "the request body must be a JSON object, not list"
    )
    unknown = client.get(f"{proxy.url}/v1/embeddings")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found"
    wrong_method = client.get(f"{proxy.url}/v1/completions")
    assert wrong_method.status_code == 405
    assert json.loads(wrong_method.content)["error"]["code"] == 405
    assert p.behaviour.completions() == [] and d.behaviour.completions() == []


def test_body_over_the_limit_is_refused_with_413(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url], max_body_bytes=1000)
    fits = {"prompt": "x" * 900}
    assert client.post(f"{proxy.url}/v1/completions", json=fits).status_code == 200

    too_big = b'{"prompt": "' + b"x" * 1000 + b'"}'
    declared = client.post(f"{proxy.url}/v1/completions", content=too_big)
    assert declared.status_code == 413
    assert declared.json()["error"]["message"] == (
        f"the request body is {len(too_big)} bytes; the limit is 1000 (--max-body-bytes)"
    )

    def chunked() -> httpx.SyncByteStream:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    undeclared = client.post(f"{proxy.url}/v1/completions", content=chunked())
    assert undeclared.status_code == 413
    assert "exceeds 1000 bytes" in undeclared.json()["error"]["message"]
    assert len(p.behaviour.completions()) == 1


def test_a_streamed_answer_carries_ps_transfer_facts_in_a_header(stub, start_proxy, client):
    """vLLM sends no kv_transfer_params in a stream: P's facts reach the client as a header."""
    p, d = stub("P"), stub("D")
    facts = {"connector": "NixlConnector", "kept": {"blocks": 3, "held": True}, "note": "é"}
    p.behaviour.prefill_params = {"do_remote_prefill": True, "kvx_transfer": {"prefill": facts}}
    proxy = start_proxy([p.url], [d.url])
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}
    with client.stream("POST", proxy.url + "/v1/completions", json=body) as answer:
        answer.read()
    assert answer.status_code == 200
    assert json.loads(answer.headers["x-kvx-prefill-transfer"]) == facts
    d_params = d.behaviour.completions()[0].body["kv_transfer_params"]
    assert d_params["kvx_transfer"] == {"prefill": facts}  # and D gets them with the rest

    p.behaviour.prefill_params = {"kvx_transfer": {"prefill": {"x": "y" * 5000}}}
    with client.stream("POST", proxy.url + "/v1/completions", json=body) as answer:
        answer.read()
    assert answer.status_code == 200
    assert "x-kvx-prefill-transfer" not in answer.headers  # too large for a header
