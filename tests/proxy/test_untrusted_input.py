"""The bounds docs/security.md claims for `kvx proxy` that the other proxy tests do not cover:
an upstream answer larger than the proxy holds in memory, the client's X-Request-Id passed on
only when it is a plain token, only the headers the proxy means to pass reaching P and D, and
no client-made `kv_transfer_params` reaching either."""

from __future__ import annotations

import pytest

from kvx.proxy import forward

pytestmark = pytest.mark.timeout(60)


def test_an_upstream_answer_over_the_cap_is_refused_not_buffered(
    stub, start_proxy, client, monkeypatch
):
    monkeypatch.setattr(forward, "MAX_UPSTREAM_BODY_BYTES", 4096)
    p, d = stub("P"), stub("D")
    p.behaviour.prefill_params = {"padding": "x" * 10_000}
    proxy = start_proxy([p.url], [d.url])
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 502
    [attempt] = answer.json()["error"]["attempts"]
    assert attempt["server"] == p.url
    assert attempt["reason"].endswith("answered with more than 4096 bytes"), attempt
    assert d.behaviour.completions() == []


def test_only_a_plain_request_id_and_the_authorization_are_passed_on(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    headers = {
        "x-request-id": "client-id.1:2",
        "authorization": "Bearer token",
        "cookie": "session=secret",
        "x-forwarded-for": "198.51.100.7",
    }
    assert client.post(f"{proxy.url}/v1/completions", json={}, headers=headers).is_success
    for bad in ("has spaces", "x" * 129, "semi;colon"):
        sent = {"x-request-id": bad}
        answer = client.post(f"{proxy.url}/v1/completions", json={}, headers=sent)
        assert answer.is_success and answer.headers["x-request-id"] != bad
    received = p.behaviour.completions() + d.behaviour.completions()
    assert len(received) == 8
    first = [r.headers for r in received if r.headers["x-request-id"] == "client-id.1:2"]
    assert len(first) == 2  # P and D both got the client's id
    for got in first:
        assert got["authorization"] == "Bearer token"
        assert "cookie" not in got and "x-forwarded-for" not in got
    fresh = [r.headers["x-request-id"] for r in received]
    fresh = [rid for rid in fresh if rid != "client-id.1:2"]
    assert len(fresh) == 6 and all(len(rid) == 32 and int(rid, 16) >= 0 for rid in fresh), fresh


@pytest.mark.parametrize("p_params", [{}, None], ids=["p-returns-none", "p-returns-its-own"])
def test_a_clients_kv_transfer_params_reach_neither_server(stub, start_proxy, client, p_params):
    """They would point D at blocks of P the client has no business reading."""
    p, d = stub("P"), stub("D")
    if p_params is not None:
        p.behaviour.prefill_params = p_params
    proxy = start_proxy([p.url], [d.url])
    forged = {"do_remote_prefill": True, "remote_block_ids": [0, 1, 2], "remote_port": 1}
    request = {"prompt": "x", "max_tokens": 2, "kv_transfer_params": forged}
    assert client.post(f"{proxy.url}/v1/completions", json=request).is_success
    [to_p], [to_d] = p.behaviour.completions(), d.behaviour.completions()
    assert to_p.body["kv_transfer_params"]["do_remote_decode"] is True
    assert to_d.body.get("kv_transfer_params") != forged
    if p_params is not None:  # P answered without params: D gets the request without any
        assert "kv_transfer_params" not in to_d.body
    else:
        assert to_d.body["kv_transfer_params"]["remote_engine_id"] == "P"
