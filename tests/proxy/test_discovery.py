"""Service discovery: P and D servers announce themselves to the proxy by heartbeat (a real
`kvx.discovery.Announcer` over ZMQ on loopback), join the rotation with their KV address, and
leave it when they say so or their heartbeats stop. Hostile bytes, a wrong or missing secret,
replays and too many servers are refused and logged, and the listener keeps serving."""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvx.cli.commands import main
from kvx.discovery import (
    Announcement,
    Announcer,
    open_announcement,
    seal_announcement,
)
from kvx.proxy import ProxyConfig, ServerPool, serve_in_thread
from kvx.proxy.config import ProxySettingError
from kvx.proxy.discovery import DiscoveryListener, DiscoverySettings
from kvx.proxy.forward import PREFILL_KV_TRANSFER_PARAMS
from kvx.wire import WireError

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-for-tests"


@pytest.fixture
def listen() -> Iterator[Callable[..., DiscoveryListener]]:
    """`listen(pool, **settings)`: a listener on a free loopback port; all stopped after."""
    running: list[DiscoveryListener] = []

    def start(pool: ServerPool, **settings: object) -> DiscoveryListener:
        listener = DiscoveryListener(pool, DiscoverySettings(port=0, **settings)).start()  # type: ignore[arg-type]
        running.append(listener)
        return listener

    yield start
    for listener in running:
        listener.stop()


@pytest.fixture
def raw() -> Iterator[Callable[[str], zmq.Socket[bytes]]]:
    """`raw(address)`: a bare DEALER connected to the listener, for hand-made bytes."""
    context = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []

    def connect(address: str) -> zmq.Socket[bytes]:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close()
    context.term()


def urls(pool: ServerPool, role: str) -> dict[str, str | None]:
    return {s.url: s.kv_address for s in pool.servers() if s.role == role}


def test_announced_servers_join_with_their_kv_address_and_leave_when_they_stop(listen, wait_until):
    pool = ServerPool()
    listener = listen(pool)
    p = Announcer(listener.address, "prefill", "127.0.0.1:8100", "127.0.0.1:21001", interval_s=0.1)
    d = Announcer(listener.address, "D", "127.0.0.1:8200", "127.0.0.1:22001", interval_s=0.1)
    with p, d:
        wait_until(lambda: len(pool.servers()) == 2, 10, "P and D to join")
        assert urls(pool, "prefill") == {"http://127.0.0.1:8100": "127.0.0.1:21001"}
        assert urls(pool, "decode") == {"http://127.0.0.1:8200": "127.0.0.1:22001"}
        assert all(s.discovered for s in pool.servers())
        wait_until(lambda: p.sent >= 3, 10, "heartbeats")
        assert len(pool.servers()) == 2  # heartbeats keep them, once each
        assert listener.counts.joined == 2
    # stop() sends a leaving announcement: out now, not after the 10 s timeout
    wait_until(lambda: not pool.servers(), 3, "both to leave")
    assert listener.counts.left == 2
    assert listener.counts.refused == 0


def test_a_server_whose_heartbeats_stop_leaves_after_the_timeout(listen, raw, wait_until):
    pool = ServerPool()
    listener = listen(pool, timeout_s=0.5)
    note = Announcement("D", "127.0.0.1:8200", "127.0.0.1:22001")
    raw(listener.address).send(seal_announcement(None, note))  # one heartbeat, then silence
    wait_until(lambda: len(pool.servers()) == 1, 5, "D to join")
    joined = time.monotonic()
    wait_until(lambda: not pool.servers(), 5, "D to leave")
    assert time.monotonic() - joined >= 0.3
    assert listener.counts.left == 1


def test_vllm_examples_plain_msgpack_ping_is_accepted_without_a_secret(listen, raw, wait_until):
    pool = ServerPool()
    listener = listen(pool)
    ping = {"type": "P", "http_address": "10.0.0.1:8100", "zmq_address": "10.0.0.1:21001"}
    raw(listener.address).send(msgspec.msgpack.encode(ping))
    wait_until(lambda: len(pool.servers()) == 1, 5, "P to join")
    assert urls(pool, "prefill") == {"http://10.0.0.1:8100": "10.0.0.1:21001"}


HOSTILE: list[tuple[list[bytes], str]] = [
    ([b"\xff\xfe garbage"], "malformed Announcement message"),
    ([b""], "malformed Announcement message"),
    ([b"a", b"b"], "2 frames; an announcement is one frame"),
    ([msgspec.msgpack.encode({"type": "X", "http_address": "h:1"})], 'type "X" is not'),
    ([msgspec.msgpack.encode({"type": "PP", "http_address": "h:1"})], "malformed"),
    ([msgspec.msgpack.encode({"type": "P", "http_address": "h"})], "is not host:port"),
    ([msgspec.msgpack.encode({"type": "P", "http_address": "h:0"})], "port in 1-65535"),
    ([msgspec.msgpack.encode({"type": "P", "http_address": "a/b:80"})], "must be a name"),
    ([msgspec.msgpack.encode({"type": "P", "http_address": "a\x00:80"})], "must be a name"),
    ([msgspec.msgpack.encode({"type": "P", "http_address": "[zz]:80"})], "must be a name"),
    ([msgspec.msgpack.encode({"type": "P", "http_address": "h:1", "zmq_address": 5})], "malformed"),
    ([msgspec.msgpack.encode({"type": "D", "http_address": "h" * 400 + ":1"})], "malformed"),
    ([msgspec.msgpack.encode([1, 2, 3])], "malformed"),
]


def test_hostile_bytes_are_refused_logged_and_the_listener_keeps_serving(
    listen, raw, wait_until, caplog
):
    pool = ServerPool()
    listener = listen(pool)
    sock = raw(listener.address)
    for n, (frames, why) in enumerate(HOSTILE, 1):
        caplog.clear()
        listener._last_logged = -1e9  # log each one here, to check its reason
        with caplog.at_level(logging.WARNING, "kvx.proxy.discovery"):
            sock.send_multipart(frames)
            wait_until(lambda n=n: listener.counts.refused == n, 5, f"refusal {n}")
        assert why in (listener.counts.last_refusal or ""), listener.counts.last_refusal
        assert any("discovery refused a message" in r.message for r in caplog.records)
    assert not pool.servers()
    # a message larger than the limit never reaches the listener: libzmq drops that peer
    big = raw(listener.address)
    big.send(b"\x80" * 100_000)
    sock.send(seal_announcement(None, Announcement("P", "127.0.0.1:8100")))
    wait_until(lambda: len(pool.servers()) == 1, 5, "a good announcement after the bad ones")
    assert listener.counts.refused == len(HOSTILE)


def test_refusals_are_counted_but_logged_at_most_once_per_interval(listen, raw, wait_until, caplog):
    listener = listen(ServerPool())
    sock = raw(listener.address)
    with caplog.at_level(logging.WARNING, "kvx.proxy.discovery"):
        for _ in range(50):
            sock.send(b"junk")
        wait_until(lambda: listener.counts.refused == 50, 5, "50 refusals")
    assert sum("refused" in r.message for r in caplog.records) == 1


def test_with_a_secret_only_sealed_fresh_announcements_count(listen, raw, wait_until):
    pool = ServerPool()
    listener = listen(pool, secret=SECRET)
    sock = raw(listener.address)
    plain = Announcement("P", "127.0.0.1:8100", "", os.urandom(16), time.time())
    sock.send(seal_announcement(None, plain))
    wait_until(lambda: listener.counts.refused == 1, 5, "unsealed refused")
    assert "authentication failed" in (listener.counts.last_refusal or "")
    sock.send(seal_announcement("another-secret", plain))
    wait_until(lambda: listener.counts.refused == 2, 5, "wrong secret refused")
    assert "authentication failed" in (listener.counts.last_refusal or "")
    stale = Announcement("P", "127.0.0.1:8100", "", os.urandom(16), time.time() - 3600)
    sock.send(seal_announcement(SECRET, stale))
    wait_until(lambda: listener.counts.refused == 3, 5, "stale refused")
    assert "stale request" in (listener.counts.last_refusal or "")
    no_nonce = Announcement("P", "127.0.0.1:8100", "", b"", time.time())
    sock.send(seal_announcement(SECRET, no_nonce))
    wait_until(lambda: listener.counts.refused == 4, 5, "no nonce refused")
    assert not pool.servers()

    with Announcer(listener.address, "P", "127.0.0.1:8100", secret=SECRET, interval_s=0.1) as a:
        wait_until(lambda: len(pool.servers()) == 1, 5, "the sealed P to join")
        sealed = a.message()
    sock.send(sealed)
    sock.send(sealed)  # a replay of a heartbeat already accepted
    wait_until(lambda: listener.counts.refused == 5, 5, "the replay refused")
    assert "replayed request" in (listener.counts.last_refusal or "")
    assert listener.counts.refused == 5


def test_at_most_max_servers_are_discovered(listen, wait_until):
    pool = ServerPool()
    listener = listen(pool, max_servers=2)
    announcers = [
        Announcer(listener.address, "D", f"127.0.0.1:{8200 + i}", interval_s=0.1) for i in range(3)
    ]
    try:
        announcers[0].start()
        announcers[1].start()
        wait_until(lambda: len(pool.servers()) == 2, 10, "two to join")
        announcers[2].start()
        wait_until(lambda: listener.counts.refused >= 2, 10, "the third refused")
        assert len(pool.servers()) == 2
        assert "(--discovery-max-servers)" in (listener.counts.last_refusal or "")
        announcers[0].stop()  # one leaves: room for the third
        wait_until(lambda: "http://127.0.0.1:8202" in urls(pool, "decode"), 10, "the third in")
        assert len(pool.servers()) == 2
    finally:
        for announcer in announcers:
            announcer.stop()


def test_configured_servers_get_the_kv_address_but_never_leave_by_discovery(listen, wait_until):
    pool = ServerPool(prefill=("http://127.0.0.1:8100",))
    listener = listen(pool, timeout_s=0.3)
    with Announcer(listener.address, "P", "127.0.0.1:8100", "127.0.0.1:21001", interval_s=0.1):
        wait_until(lambda: pool.servers()[0].kv_address == "127.0.0.1:21001", 5, "kv address")
    time.sleep(0.6)  # past the timeout, after the leaving announcement
    assert [s.url for s in pool.servers()] == ["http://127.0.0.1:8100"]
    assert not pool.servers()[0].discovered


def test_a_busy_discovery_port_is_a_setting_error_naming_the_flag(listen):
    first = listen(ServerPool())
    port = int(first.address.rsplit(":", 1)[1])
    with pytest.raises(
        ProxySettingError, match=f"--discovery-port: cannot listen on 127.0.0.1:{port}"
    ):
        DiscoveryListener(ServerPool(), DiscoverySettings(port=port))


def test_announcer_arguments_are_checked():
    with pytest.raises(ValueError, match='role: "both"'):
        Announcer("127.0.0.1:1", "both", "127.0.0.1:2")
    with pytest.raises(ValueError, match='http_address: "8100" is not host:port'):
        Announcer("127.0.0.1:1", "P", "8100")
    with pytest.raises(ValueError, match="write an IPv6 address as"):
        Announcer("::1:30001", "P", "127.0.0.1:2")
    assert Announcer("[::1]:30001", "P", "[::1]:8100").proxy_address == "[::1]:30001"


def test_proxy_routes_to_announced_servers_and_passes_their_kv_addresses(stub, client, wait_until):
    p, d = stub("P"), stub("D")
    config = ProxyConfig(port=0, discovery_port=0, health_interval=0.1, request_timeout=10.0)
    with serve_in_thread(config) as proxy:
        assert proxy.discovery is not None
        assert client.get(f"{proxy.url}/health").status_code == 503  # nobody yet
        address = proxy.discovery.address
        p_kv, d_kv = "127.0.0.1:21001", "127.0.0.1:22001"
        with (
            Announcer(address, "P", p.url.removeprefix("http://"), p_kv, interval_s=0.1),
            Announcer(address, "D", d.url.removeprefix("http://"), d_kv, interval_s=0.1),
        ):
            wait_until(
                lambda: client.get(f"{proxy.url}/health").status_code == 200, 10, "P and D up"
            )
            answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": "hi"})
            assert answer.status_code == 200, answer.text
            to_p = p.behaviour.completions()[0].body["kv_transfer_params"]
            assert to_p == {**PREFILL_KV_TRANSFER_PARAMS, "decode_address": d_kv}
            to_d = answer.json()["kv_transfer_params_received"]
            assert to_d["remote_engine_id"] == "P"  # P's own answer, unchanged
            assert "decode_address" not in to_d
            servers = client.get(f"{proxy.url}/kvx/servers").json()
            assert servers["decode"][0]["kv_address"] == d_kv
            assert servers["discovery"]["joined"] == 2
        wait_until(lambda: not proxy.pool.servers(), 5, "both to leave")
        assert client.get(f"{proxy.url}/health").status_code == 503


def test_without_discovery_p_gets_no_peer_addresses(stub, start_proxy, client):
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    assert client.post(f"{proxy.url}/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert p.behaviour.completions()[0].body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS


KVX = shutil.which("kvx", path=str(Path(sys.executable).parent))


def test_cli_with_discovery_needs_no_servers_and_says_where_it_listens(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    process = subprocess.Popen(
        [KVX, "proxy", "--port", "0", "--discovery-port", "0", "--discovery-secret-file", secret],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("kvx proxy listening on http://127.0.0.1:"), line
        assert "prefill: -; decode: -; discovery on 127.0.0.1:" in line
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert "discovery listening on 127.0.0.1:" in err
    assert "(sealed with a secret)" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--discovery-port", "x"], '--discovery-port: "x" is not an integer'),
        (["--discovery-port", "-1"], "--discovery-port: -1 is not allowed; expected an integer"),
        (["--discovery-port", "0", "--discovery-timeout", "0"], "--discovery-timeout: 0.0 is not"),
        (["--discovery-port", "0", "--discovery-max-servers", "0"], "--discovery-max-servers: 0"),
        (
            ["--discovery-port", "0", "--discovery-secret-file", "/nonexistent/s"],
            '--discovery-secret-file: "/nonexistent/s": [Errno 2] No such file or directory',
        ),
        (["--discovery-port", "0", "--discovery-host", " "], '--discovery-host: " " is not a host'),
    ],
)
def test_bad_discovery_flag_exits_2_naming_it(flags, message, capsys):
    assert main(["proxy", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "--prefill" not in err  # discovery makes --prefill/--decode optional
    assert "Traceback" not in err


def test_a_short_secret_is_refused(tmp_path, capsys):
    secret = tmp_path / "secret"
    secret.write_text("short")
    flags = ["--discovery-port", "0", "--discovery-secret-file", str(secret)]
    assert main(["proxy", *flags]) == 2
    assert (
        "--discovery-secret-file: the secret must be a text of at least 8"
        in capsys.readouterr().err
    )


def test_a_dead_announced_d_fails_only_its_request_and_is_not_replaced(
    stub, client, wait_until, free_port
):
    p, d = stub("P"), stub("D")
    dead = f"127.0.0.1:{free_port()}"  # announced, but nothing listens there
    config = ProxyConfig(
        port=0, discovery_port=0, routing="round_robin", health_interval=60, request_timeout=10.0
    )
    with serve_in_thread(config) as proxy:
        assert proxy.discovery is not None
        address = proxy.discovery.address
        with (
            Announcer(address, "P", p.url.removeprefix("http://"), "127.0.0.1:21001"),
            Announcer(address, "D", dead, "127.0.0.1:22009"),
            Announcer(address, "D", d.url.removeprefix("http://"), "127.0.0.1:22001"),
        ):
            wait_until(lambda: len(proxy.pool.servers()) == 3, 10, "P and both Ds to join")
            answers = [
                client.post(f"{proxy.url}/v1/completions", json={"prompt": "hi"}) for _ in range(3)
            ]
    failed = [a for a in answers if a.status_code != 200]
    assert len(failed) == 1, [a.text for a in answers]
    message = failed[0].json()["error"]["message"]
    assert f"decode server http://{dead}: cannot connect" in message
    assert "P sent this request's KV cache to it (127.0.0.1:22009)" in message
    # the dead D was taken out at once: the other requests went to the live one
    assert [a.headers["x-kvx-decode"] for a in answers if a.status_code == 200] == [d.url] * 2


@pytest.mark.parametrize("secret", [None, SECRET])
def test_fuzzed_announcements_raise_nothing_but_wire_error(secret):
    """5,000 random and mutated messages (seeded): `open_announcement` refuses them with
    WireError and nothing else; with a secret none gets past the tag."""
    rng = random.Random(14)
    good = seal_announcement(
        secret, Announcement("D", "127.0.0.1:8200", "127.0.0.1:22001", os.urandom(16), time.time())
    )
    assert open_announcement(secret, good).http_address == "127.0.0.1:8200"
    values = [None, -1, 2**64 - 1, 1e308, "P", "D", "h:1", "x" * 2000, b"\x00" * 40, [1], {}]
    refused = 0
    for n in range(5000):
        if n % 3 == 0:
            data = rng.randbytes(rng.randrange(64))
        elif n % 3 == 1:
            data = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                at = rng.randrange(len(data))
                data[at : at + rng.randrange(1, 4)] = rng.randbytes(rng.randrange(4))
            data = bytes(data)
        else:
            keys = ["type", "http_address", "zmq_address", "nonce", "sent_at", "leaving"]
            data = msgspec.msgpack.encode(
                {k: rng.choice(values) for k in keys if rng.random() < 0.8}
            )
        try:
            open_announcement(secret, data)
        except WireError as exc:
            refused += 1
            assert secret is None or re.search("authentication failed|exceeds the limit", str(exc))
    assert refused > 4500
