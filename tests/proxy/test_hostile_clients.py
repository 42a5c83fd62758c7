"""Clients an attacker writes, against a real proxy on loopback: malformed bodies get a 400
naming what is wrong and no traceback in the logs, connections dribbling their headers are
closed by the header deadline (and past --max-connections, to make room) while legitimate
requests are served, request bodies are held within --max-body-memory, and a client that
leaves cancels its request's work on P and D whether it streamed or not."""

from __future__ import annotations

import concurrent.futures
import logging
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]


MALFORMED = {
    b'{"prompt": NaN}': "NaN is not a JSON number",
    b'{"prompt": "x", "temperature": Infinity}': "Infinity is not a JSON number",
    b'{"temperature": -Infinity}': "-Infinity is not a JSON number",
    b'{"temperature": 1e999}': "the number 1e999 is out of range",
    b'{"prompt": "\\ud800"}': "the string at $.prompt holds a lone surrogate (\\ud800)",
    b'{"\\udfff": 1}': "a key in $ holds a lone surrogate (\\udfff)",
    b'{"messages": [{"content": "\\ud83d"}]}': "$.messages[0].content holds a lone surrogate",
    b"[" * 100_000 + b"]" * 100_000: "nests deeper than 64 levels",
    b'{"a": ' * 500 + b"1" + b"}" * 500: "nests deeper than 64 levels (at $.a.a.a",
    b'{"prompt": "x", "stream": "yes"}': "'stream' must be true, false or null, not \"yes\"",
    b'{"max_tokens": ' + b"9" * 5000 + b"}": "the request body is not valid JSON",
    b"\xff\xfe{}": "the request body is not valid JSON",
    b'["prompt"]': "must be a JSON object, not list",
    b'{"prompt": "x"': "the request body is not valid JSON",
}


def test_malformed_bodies_get_a_400_naming_the_problem_and_no_traceback(
    stub, start_proxy, client, caplog
):
    caplog.set_level(logging.DEBUG)
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    for body, expected in MALFORMED.items():
        answer = client.post(
            f"{proxy.url}/v1/completions", content=body, headers={"content-type": "x"}
        )
        assert answer.status_code == 400, (body[:60], answer.text[:300])
        error = answer.json()["error"]
        assert expected in error["message"], (body[:60], error["message"])
    assert p.behaviour.completions() == [] and d.behaviour.completions() == []
    no_tracebacks(caplog)


def test_fuzzed_bodies_get_200_or_400_and_no_traceback(stub, start_proxy, client, caplog):
    """Seeded: 300 mutations of a valid request (bytes flipped, hostile tokens spliced in)."""
    caplog.set_level(logging.DEBUG)
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    base = b'{"prompt": "hello", "max_tokens": 3, "stream": false, "stop": ["a"], "n": 1}'
    tokens = [b"NaN", b"1e999", b'"\\ud800"', b"[[[[", b"}", b"\\", b'"', b"\x00", b"\xff", b"-0"]
    rng = random.Random(33)
    statuses: dict[int, int] = {}
    for _ in range(300):
        body = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(body))
            if rng.random() < 0.5:
                body[at] = rng.randrange(256)
            else:
                body[at:at] = rng.choice(tokens)
        answer = client.post(f"{proxy.url}/v1/completions", content=bytes(body))
        assert answer.status_code in (200, 400), (bytes(body), answer.text[:300])
        statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 0, statuses
    no_tracebacks(caplog)


def slow_header_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0.01)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_300_slow_header_connections_do_not_lock_out_clients(stub, start_proxy, client, caplog):
    caplog.set_level(logging.INFO)
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url], header_timeout=2.0, max_connections=100)
    port = int(proxy.url.rsplit(":", 1)[1])
    started = time.monotonic()
    slow = [slow_header_connection(port) for _ in range(300)]
    try:
        for sock in slow[:50]:  # keep dribbling: still past the deadline
            sock.sendall(b"x-a: b\r\n")
        latencies = []
        for _ in range(10):
            t0 = time.monotonic()
            answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
            latencies.append(time.monotonic() - t0)
            assert answer.status_code == 200, answer.text
        assert max(latencies) < 2.0, latencies  # served at once, not after the deadline
        deadline = time.monotonic() + 10
        while not all(closed_by_peer(s) for s in slow):
            assert time.monotonic() < deadline, "slow connections outlived the header deadline"
            time.sleep(0.2)
        assert time.monotonic() - started > 1.5  # some waited for the deadline itself
    finally:
        for sock in slow:
            sock.close()
    no_tracebacks(caplog)


def test_a_request_over_the_concurrency_limit_gets_a_clear_503(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    p.behaviour.hold = release = threading.Event()
    proxy = start_proxy([p.url], [d.url], max_concurrent_requests=2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = [
            pool.submit(client.post, f"{proxy.url}/v1/completions", json={"prompt": "x"})
            for _ in range(2)
        ]
        deadline = time.monotonic() + 10
        while len(p.behaviour.completions()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "y"})
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["message"] == (
            "the proxy is serving 2 requests (--max-concurrent-requests); retry later"
        )
        release.set()
        assert [f.result(timeout=15).status_code for f in held] == [200, 200]


def peak_and_current_mib(pid: int) -> tuple[float, float]:
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            fields[name] = value.split()[0] if value.split() else "0"
    return int(fields["VmHWM"]) / 1024, int(fields["VmRSS"]) / 1024


def test_20_concurrent_9_mib_bodies_stay_within_the_body_memory(stub, free_port):
    """The proxy in its own process (`kvx proxy`), so its memory is its own."""
    p, d = stub("P"), stub("D")
    port = free_port()
    proxy = subprocess.Popen(
        [
            *(sys.executable, "-c", "from kvx.cli.commands import run; run()", "proxy"),
            *("--port", str(port), "--prefill", p.url, "--decode", d.url),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        assert "kvx proxy listening" in proxy.stdout.readline()
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
        with httpx.Client(timeout=60, trust_env=False) as warm:
            assert warm.post(url, json={"prompt": "x"}).status_code == 200
        before, _ = peak_and_current_mib(proxy.pid)

        def send(_: int) -> httpx.Response:
            with httpx.Client(timeout=60, trust_env=False) as http:
                return http.post(url, content=body)

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(send, range(20)))
        peak, _ = peak_and_current_mib(proxy.pid)
        statuses = [a.status_code for a in answers]
        assert set(statuses) <= {200, 503} and 200 in statuses, statuses
        for answer in answers:
            if answer.status_code == 503:
                assert "--max-body-memory" in answer.json()["error"]["message"]
        assert peak - before <= 64, f"grew {peak - before:.0f} MiB ({before:.0f} -> {peak:.0f})"
    finally:
        proxy.terminate()
        _, err = proxy.communicate(timeout=20)
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_non_streaming_client_that_leaves_cancels_the_upstream_work(
    stub, start_proxy, phase, wait_until
):
    p, d = stub("P"), stub("D")
    held = p if phase == "prefill" else d
    held.behaviour.hold = threading.Event()
    proxy = start_proxy([p.url], [d.url])
    with (
        httpx.Client(timeout=0.5, trust_env=False) as impatient,
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
    wait_until(lambda: held.behaviour.left, 5, f"{phase} to see the proxy leave")
    assert held.behaviour.left == ["/v1/completions"]
    if phase == "prefill":
        time.sleep(0.3)
        assert d.behaviour.completions() == []  # D was never asked
    servers = httpx.get(f"{proxy.url}/kvx/servers", timeout=5).json()
    assert all(s["outstanding"] == 0 for role in ("prefill", "decode") for s in servers[role])
