"""How the scheduler learns what LMCache holds: each worker answers prefix lookups on its own
LMCache engine over a local ZMQ socket, and the scheduler takes the smallest answer (a prefix
is a hit only if every worker holds its share).

The sockets are `ipc://` files in a directory only this user can open (mode 0700), so only
processes of the same user can ask; requests are msgpack lists of token ids, bounded in size.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence

import msgspec
import zmq

logger = logging.getLogger(__name__)

MAX_TOKENS = 1 << 22  # the longest token list a worker accepts in one lookup
_MAX_REQUEST_BYTES = MAX_TOKENS * 9 + 64
_POLL_MS = 100


def socket_path(engine_id: str, rank: int) -> str:
    """The lookup socket file of worker `rank` (global rank) of engine `engine_id`."""
    folder = os.path.join(tempfile.gettempdir(), f"kvx-lmcache-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    tag = hashlib.sha256(engine_id.encode()).hexdigest()[:24]
    return os.path.join(folder, f"{tag}-{rank}.sock")


class LookupServer:
    """A worker's thread answering `lookup(tokens) -> prefix tokens held`."""

    def __init__(self, path: str, lookup: Callable[[list[int]], int]) -> None:
        self.path = path
        self._lookup = lookup
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        if os.path.exists(path):  # a dead engine's socket of the same id: take it over
            os.unlink(path)
        self._socket.bind(f"ipc://{path}")
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(list[int])
        self._thread = threading.Thread(target=self._serve, name="kvx-lmcache-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            raw = self._socket.recv()
            try:
                tokens = self._decoder.decode(raw)
                if len(tokens) > MAX_TOKENS:
                    raise ValueError(f"{len(tokens)} tokens > {MAX_TOKENS}")
                answer = int(self._lookup(tokens))
            except Exception as exc:  # a bad request or a failing store: answer "none held"
                logger.warning("kvx lmcache: lookup failed: %s: %s", type(exc).__name__, exc)
                answer = 0
            self._socket.send(msgspec.msgpack.encode(answer))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class LookupClient:
    """The scheduler's side: asks every worker and returns the smallest prefix held."""

    def __init__(self, paths: Sequence[str], timeout_s: float) -> None:
        self.paths = list(paths)
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket[bytes]] = {}

    def _socket(self, path: str) -> zmq.Socket[bytes]:
        sock = self._sockets.get(path)
        if sock is None:
            sock = self._context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            sock.connect(f"ipc://{path}")
            self._sockets[path] = sock
        return sock

    def lookup(self, tokens: list[int]) -> int:
        """Tokens of the longest prefix every worker holds (0 when a worker does not answer in
        time: the engine then computes them)."""
        if not tokens:
            return 0
        request = msgspec.msgpack.encode(tokens)
        for path in self.paths:  # send to all first, so workers look up in parallel
            self._socket(path).send(request)
        answers = []
        for path in self.paths:
            try:
                answers.append(int(msgspec.msgpack.decode(self._socket(path).recv())))
            except zmq.Again:
                logger.warning(
                    "kvx lmcache: worker lookup socket %s did not answer within %d ms; "
                    "counting no hit",
                    path,
                    self.timeout_ms,
                )
                self._sockets.pop(path).close(linger=0)  # a REQ socket without a reply is stuck
                answers.append(0)
        return min(answers)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        self._context.term()
