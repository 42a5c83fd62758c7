"""Redis vectored IO: values sent from and read into many buffers through the RESP client,
against real redis-server processes (and one hostile fake server), every byte checked."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from kvx.plugins.storage.backends import redis_backend
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.redis_backend import RedisBackend
from kvx.plugins.storage.backends.resp import RespConnection, RespProtocolError, RespReplyError

CHUNK = 32 << 10  # one layer's K or V region of a block
CHUNKS = 64  # per value: 32 layers x K|V
HEADER = 64
VALUE_BYTES = HEADER + CHUNKS * CHUNK  # 2 MiB + 64


class Cache:
    """A uint8 "KV cache" of 32 KiB chunks with random bytes; each value's chunks are scattered
    over it (never adjacent), behind a 64-byte header of its own."""

    def __init__(self, values: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.chunks = torch.randint(
            0, 256, (values * CHUNKS * 2, CHUNK), dtype=torch.uint8, generator=gen
        )
        self.headers = torch.randint(0, 256, (values, HEADER), dtype=torch.uint8, generator=gen)
        self.order = torch.randperm(values * CHUNKS * 2, generator=gen)[: values * CHUNKS]
        self.order = self.order.view(values, CHUNKS)

    def buffers(self, i: int) -> list[memoryview]:
        """The 65 buffers of value `i`: its header, then its chunks (numpy memoryviews)."""
        rows = self.chunks.numpy()
        return [
            memoryview(self.headers.numpy()[i]),
            *(memoryview(rows[int(r)]) for r in self.order[i]),
        ]

    def value(self, i: int) -> bytes:
        return b"".join(bytes(b) for b in self.buffers(i))

    def clear(self, fill: int = 0) -> None:
        self.chunks.fill_(fill)
        self.headers.fill_(fill)


def untouched(buffers: list[memoryview], fill: int) -> bool:
    return all(bytes(b) == bytes([fill]) * len(b) for b in buffers)


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    b = RedisBackend(redis_url, BackendOptions(timeout_s=10.0))
    yield b
    b.close()


@pytest.mark.timeout(60)
def test_round_trip_of_many_buffer_values(redis_url: str, backend: RedisBackend) -> None:
    """8 values of 65 buffers (16 MiB, far more than the socket buffers) in one call, read
    back with plain redis-py GET and into an emptied cache in another order."""
    cache = Cache(8, seed=1)
    want = [cache.value(i) for i in range(8)]
    backend.put_vectored([(f"ns/v{i}", cache.buffers(i)) for i in range(8)])
    client = redis.Redis.from_url(redis_url)
    assert [client.get(f"kvx/ns/v{i}") for i in range(8)] == want
    client.close()
    cache.clear()
    order = [5, 0, 7, 2, 1, 6, 3, 4]
    sizes = backend.get_vectored([f"ns/v{i}" for i in order], [cache.buffers(i) for i in order])
    assert sizes == [VALUE_BYTES] * 8
    assert [cache.value(i) for i in range(8)] == want


@pytest.mark.timeout(60)
def test_one_big_value_and_odd_buffers(backend: RedisBackend) -> None:
    """A 40 MiB value of three buffers, and values of a single buffer, of non-byte formats
    (float32: lengths count bytes, not items), of empty buffers."""
    big = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8)
    third = big.numel() // 3
    floats = torch.randn(1000)
    parts = [big[:third], big[third : 2 * third], big[2 * third :]]
    backend.put_vectored(
        [
            ("ns/big", [memoryview(p.numpy()) for p in parts]),
            ("ns/f", [memoryview(b""), memoryview(floats.numpy()), memoryview(b"")]),
        ]
    )
    out = torch.zeros_like(big)
    out_floats = torch.zeros_like(floats)
    sizes = backend.get_vectored(
        ["ns/f", "ns/big"],
        [
            [memoryview(out_floats.numpy())],
            [memoryview(out.numpy()[: 7 << 20]), memoryview(out.numpy()[7 << 20 :])],
        ],
    )
    assert sizes == [4000, 40 << 20]
    assert torch.equal(out, big) and torch.equal(out_floats, floats)


@pytest.mark.timeout(30)
def test_missing_and_wrong_sized_values_leave_buffers_untouched(backend: RedisBackend) -> None:
    """Absent -> None, another size -> that size (dropped, also when bigger than the 1 MiB
    discard piece); the stream stays in sync for the values after them and the next call."""
    cache = Cache(3, seed=2)
    want = [cache.value(i) for i in range(3)]
    backend.put_vectored(
        [("ns/a", cache.buffers(0)), ("ns/b", cache.buffers(1)), ("ns/small", [memoryview(b"xyz")])]
    )
    cache.clear(0xAB)
    too_few = cache.buffers(2)[:40]  # shorter than the stored 2 MiB value
    sizes = backend.get_vectored(
        ["ns/none", "ns/a", "ns/small", "ns/b"],
        [cache.buffers(0), too_few, cache.buffers(1), cache.buffers(1)],
    )
    assert sizes == [None, VALUE_BYTES, 3, VALUE_BYTES]
    assert untouched(cache.buffers(0), 0xAB) and untouched(too_few, 0xAB)
    assert cache.value(1) == want[1]
    assert backend.get_vectored(["ns/a"], [cache.buffers(0)]) == [VALUE_BYTES]
    assert cache.value(0) == want[0]


@pytest.mark.timeout(30)
def test_error_replies_name_the_key_and_the_next_call_works(own_redis: Any) -> None:
    """A GET of a list (WRONGTYPE) and a SET over maxmemory (OOM) raise with the key and the
    server's message after the other replies are read; the backend then works on."""
    b = RedisBackend(own_redis.url, BackendOptions())
    client = redis.Redis(port=own_redis.port)
    try:
        b.put_vectored([("ns/x", [memoryview(b"xx")]), ("ns/y", [memoryview(b"yy")])])
        client.rpush("kvx/ns/l", b"item")
        outs = [bytearray(2) for _ in range(3)]
        with pytest.raises(RespReplyError, match="GET 'kvx/ns/l' failed: WRONGTYPE"):
            b.get_vectored(["ns/x", "ns/l", "ns/y"], [[memoryview(o)] for o in outs])
        assert outs == [b"xx", bytes(2), b"yy"]
        client.config_set("maxmemory", 1)
        with pytest.raises(RespReplyError, match="SET 'kvx/ns/z' failed: OOM"):
            b.put_vectored([("ns/z", [memoryview(b"zz")]), ("ns/w", [memoryview(b"ww")])])
        client.config_set("maxmemory", 0)
        b.put_vectored([("ns/z", [memoryview(b"zz")])])
        assert b.get_vectored(["ns/z", "ns/y"], [[memoryview(o)] for o in outs[:2]]) == [2, 2]
        assert outs[:2] == [b"zz", b"yy"]
    finally:
        client.close()
        b.close()


@pytest.mark.timeout(30)
def test_ttl_is_set(redis_url: str) -> None:
    with_ttl = RedisBackend(redis_url, BackendOptions(ttl_s=120))
    without = RedisBackend(redis_url, BackendOptions())
    try:
        with_ttl.put_vectored([("ns/t", [memoryview(b"a"), memoryview(b"b")])])
        without.put_vectored([("ns/u", [memoryview(b"c")])])
        assert 0 < with_ttl.ttl("ns/t") <= 120
        assert without.ttl("ns/u") == -1
    finally:
        with_ttl.close()
        without.close()


@pytest.mark.timeout(30)
def test_password_protected_server(own_redis: Any) -> None:
    """The server requires a password (set on the fixture's real redis-server with CONFIG SET
    requirepass): the right one works, with and without a user name; a wrong one is a clear
    error that does not show it."""
    client = redis.Redis(port=own_redis.port)
    client.config_set("requirepass", "pw")
    client.close()
    base = f"127.0.0.1:{own_redis.port}"
    for url in (f"redis://:pw@{base}/0", f"redis://default:pw@{base}/0"):
        b = RedisBackend(url, BackendOptions())
        try:
            b.put_vectored([("ns/p", [memoryview(b"secret "), memoryview(b"value")])])
            out = bytearray(12)
            assert b.get_vectored(["ns/p"], [[memoryview(out)]]) == [12]
            assert out == b"secret value"
        finally:
            b.close()
    with pytest.raises(ConnectionError, match="refused the credentials") as info:
        RedisBackend(f"redis://:wrong-pw@{base}/0", BackendOptions())
    assert "wrong-pw" not in str(info.value) and base in str(info.value)
    with pytest.raises(ConnectionError, match=f"Redis at {base} refused AUTH") as info:
        RespConnection("127.0.0.1", own_redis.port, password="wrong-pw")
    assert "wrong-pw" not in str(info.value)


@pytest.mark.timeout(30)
def test_db_selection(own_redis: Any) -> None:
    base = f"redis://127.0.0.1:{own_redis.port}"
    one = RedisBackend(f"{base}/1", BackendOptions())
    zero = RedisBackend(f"{base}/0", BackendOptions())
    try:
        one.put_vectored([("ns/d", [memoryview(b"db1")])])
        out = bytearray(3)
        assert zero.get_vectored(["ns/d"], [[memoryview(out)]]) == [None]
        assert out == bytes(3)
        assert one.get_vectored(["ns/d"], [[memoryview(out)]]) == [3]
        assert out == b"db1"
        client = redis.Redis(port=own_redis.port, db=1)
        assert client.get("kvx/ns/d") == b"db1"
        client.close()
    finally:
        one.close()
        zero.close()


@pytest.mark.timeout(60)
def test_concurrent_puts_and_gets(backend: RedisBackend) -> None:
    """4 threads write and read their own values at once, through a shared pool."""
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            cache = Cache(2, seed=10 + t)
            want = [cache.value(i) for i in range(2)]
            for round_ in range(5):
                keys = [f"ns/t{t}/r{round_}/{i}" for i in range(2)]
                backend.put_vectored([(k, cache.buffers(i)) for i, k in enumerate(keys)])
                cache.clear()
                assert (
                    backend.get_vectored(keys, [cache.buffers(i) for i in range(2)])
                    == [VALUE_BYTES] * 2
                )
                assert [cache.value(i) for i in range(2)] == want
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert 1 <= len(backend._idle) <= 4


@pytest.mark.timeout(30)
def test_redis_py_path_for_tls_and_unix_urls(
    backend: RedisBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same calls through redis-py (what `rediss://` and `unix://` URLs use)."""
    monkeypatch.setattr(backend, "_resp", False)
    monkeypatch.setattr(redis_backend, "RespConnection", None)  # never used on this path
    cache = Cache(2, seed=3)
    want = cache.value(0)
    backend.put_vectored([("ns/r", cache.buffers(0)), ("ns/s", [memoryview(b"xy")])])
    cache.clear(7)
    sizes = backend.get_vectored(
        ["ns/r", "ns/s", "ns/none"],
        [cache.buffers(0), cache.buffers(1), [memoryview(bytearray(1))]],
    )
    assert sizes == [VALUE_BYTES, 2, None]
    assert cache.value(0) == want and untouched(cache.buffers(1), 7)


@pytest.mark.timeout(30)
def test_frozen_server_times_out(own_redis: Any) -> None:
    b = RedisBackend(own_redis.url, BackendOptions(timeout_s=1.0))
    try:
        cache = Cache(8, seed=4)
        b.put_vectored([("ns/f", cache.buffers(0))])
        own_redis.freeze()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not answer GET within 1\.0s"):
            b.get_vectored(["ns/f"], [cache.buffers(0)])
        with pytest.raises(TimeoutError):  # 16 MiB fill the socket buffers, then wait
            b.put_vectored([(f"ns/g{i}", cache.buffers(i)) for i in range(8)])
        assert time.monotonic() - start < 2 * 1.0 + 3
        assert not b._idle
    finally:
        b.close()


@pytest.mark.timeout(30)
def test_killed_server_is_a_connection_error(own_redis: Any) -> None:
    b = RedisBackend(own_redis.url, BackendOptions(timeout_s=5.0))
    try:
        b.put_vectored([("ns/k", [memoryview(b"v")])])
        own_redis.kill()
        start = time.monotonic()
        out = [memoryview(bytearray(1))]
        with pytest.raises(ConnectionError):  # the pooled connection
            b.get_vectored(["ns/k"], [out])
        with pytest.raises(ConnectionError, match="cannot connect"):  # a new one
            b.put_vectored([("ns/k", [memoryview(b"v")])])
        assert time.monotonic() - start < 5
    finally:
        b.close()


class FakeServer:
    """A loopback server that answers the first request with `reply` and then holds the
    connection open, sending nothing more."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(1 << 16)
            conn.sendall(self.reply)
            self.done.wait(30)

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.listener.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (b"$999999999999\r\n", "announced a 999999999999-byte value .* at most 536870912"),
        (b"$" + b"9" * 100 + b"\r\n", "announced a 9999.*-byte value"),
        (b"+" + b"x" * (100 << 10), "reply line longer than 65536 bytes"),
        (b"*1\r\n$1\r\nx\r\n", "not a bulk string"),
        (b"$3\r\nabcXY", "without its CRLF"),
    ],
)
def test_hostile_server_is_a_clear_error(reply: bytes, message: str) -> None:
    """A server that lies about sizes or never ends a line. This is a fault a real
    redis-server cannot be made to produce, hence the fake one: the client must raise a clear
    error at once, without a big allocation or waiting for more bytes, and close the
    connection."""
    server = FakeServer(reply)
    try:
        conn = RespConnection("127.0.0.1", server.port, timeout_s=10.0)
        out = bytearray(4)  # no reply above is a 4-byte value
        tracemalloc.start()
        start = time.monotonic()
        try:
            with pytest.raises(RespProtocolError, match=message):
                conn.get_vectored(["k"], [[memoryview(out)]])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert time.monotonic() - start < 5
        assert peak < 4 << 20, peak
        assert conn.closed and out == bytes(4)
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_redis_client_setting_forces_redis_py(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`redis_client: "redis-py"`: the same values round trip, and no RESP connection is made
    (the RESP path keeps its connection for reuse; this one has none)."""
    cache = Cache(3, seed=7)
    want = [cache.value(i) for i in range(3)]
    forced = RedisBackend(redis_url, BackendOptions(redis_client="redis-py"))
    resp = RedisBackend(redis_url, BackendOptions())
    try:
        with monkeypatch.context() as patch:
            patch.setattr(redis_backend, "RespConnection", None)  # never used on this path
            forced.put_vectored([(f"forced/v{i}", cache.buffers(i)) for i in range(3)])
            cache.clear()
            sizes = forced.get_vectored(
                [f"forced/v{i}" for i in range(3)], [cache.buffers(i) for i in range(3)]
            )
        assert sizes == [len(w) for w in want]
        assert [cache.value(i) for i in range(3)] == want
        assert forced._idle == []
        resp.get_vectored(["forced/v0"], [cache.buffers(0)])
        assert len(resp._idle) == 1  # the other path, for contrast: one pooled RESP connection
    finally:
        forced.close()
        resp.close()
