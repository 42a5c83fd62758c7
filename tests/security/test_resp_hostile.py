"""The RESP client against a hostile local server (a real TCP socket on loopback): garbage,
huge and negative lengths, a reply dripped a byte at a time, and a close mid-reply. Every call
ends with a clear error within its whole-call deadline, never a hang or a huge allocation."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvx.plugins.storage.backends.resp import RespConnection, RespProtocolError

TIMEOUT_S = 1.0
Behaviour = Callable[[socket.socket, threading.Event], None]


class HostileServer:
    """Accepts connections and answers each with `behaviour` (after reading the request)."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.behaviour = behaviour
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(1 << 16)
                    self.behaviour(conn, self.stop)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


def drip(reply: bytes, every_s: float) -> Behaviour:
    def behaviour(conn: socket.socket, stop: threading.Event) -> None:
        for i in range(len(reply)):
            if conn.send(reply[i : i + 1]) != 1 or stop.wait(every_s):
                return

    return behaviour


def send(reply: bytes, then_close: bool = False) -> Behaviour:
    def behaviour(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(reply)
        if not then_close:
            stop.wait(3 * TIMEOUT_S)

    return behaviour


CASES: dict[str, tuple[Behaviour, type[BaseException], str]] = {
    "garbage": (send(b"\x00\xffHELLO\r\n"), RespProtocolError, "not a bulk string"),
    "huge length": (send(b"$99999999999999\r\n"), RespProtocolError, "at most 536870912 bytes"),
    "negative length": (send(b"$-5\r\n"), RespProtocolError, "not a bulk string"),
    "endless line": (send(b"+" + b"a" * (70 << 10)), RespProtocolError, "longer than 65536"),
    "no CRLF after value": (send(b"$4\r\nabcdXY"), RespProtocolError, "without its CRLF"),
    "close mid-reply": (send(b"$64\r\nabc", then_close=True), ConnectionError, "closed"),
    "silence": (send(b""), TimeoutError, "did not answer GET within 1.0s"),
    "drip": (drip(b"$64\r\n" + b"v" * 64 + b"\r\n", 0.05), TimeoutError, "within 1.0s"),
}


@pytest.fixture
def hostile(request: pytest.FixtureRequest) -> Iterator[HostileServer]:
    server = HostileServer(CASES[request.param][0])
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hostile", list(CASES), indirect=True)
def test_a_hostile_reply_ends_the_call_within_its_deadline(
    hostile: HostileServer, request: pytest.FixtureRequest
) -> None:
    _, error, needle = CASES[request.node.callspec.params["hostile"]]
    conn = RespConnection("127.0.0.1", hostile.port, timeout_s=TIMEOUT_S)
    buffer = memoryview(bytearray(64))
    started = time.monotonic()
    with pytest.raises(error, match=needle):
        conn.get_vectored(["kvx/key"], [[buffer]])
    elapsed = time.monotonic() - started
    assert elapsed < TIMEOUT_S + 0.5, f"the call took {elapsed:.2f}s"
    assert conn.closed  # never reused after an error


@pytest.mark.timeout(60)
def test_the_deadline_covers_the_whole_call_not_each_socket_call() -> None:
    """70 bytes dripped at 20 ms: every recv returns well within 1 s, the call does not."""
    server = HostileServer(drip(b"$64\r\n" + b"v" * 64 + b"\r\n", 0.02))
    try:
        conn = RespConnection("127.0.0.1", server.port, timeout_s=TIMEOUT_S)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            conn.get_vectored(["kvx/key"], [[memoryview(bytearray(64))]])
        assert time.monotonic() - started < TIMEOUT_S + 0.5
    finally:
        server.close()
    # ...and a reply inside the deadline is read whole
    server = HostileServer(drip(b"$4\r\nabcd\r\n", 0.01))
    try:
        conn = RespConnection("127.0.0.1", server.port, timeout_s=TIMEOUT_S)
        buffer = bytearray(4)
        assert conn.get_vectored(["kvx/key"], [[memoryview(buffer)]]) == [4]
        assert buffer == b"abcd"
    finally:
        server.close()
