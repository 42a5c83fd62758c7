"""The proxy's discovery listener: P and D servers that announce themselves by heartbeat
(`kvx.discovery.Announcer`) join the rotation, and leave it when their heartbeats stop.

A ZMQ ROUTER socket (loopback unless configured) served by one thread. Every message is refused,
logged and counted unless it is exactly one frame of at most `MAX_ANNOUNCEMENT_BYTES` that
authenticates (with a secret) and decodes into an `Announcement`; with a secret a replayed or
stale one is refused too. At most `max_servers` discovered servers are in the pool at once.
Servers given in the configuration are never removed by discovery; an announcement only adds
their KV address.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import zmq

from kvx.discovery import (
    DEFAULT_DISCOVERY_PORT,
    MAX_ANNOUNCEMENT_BYTES,
    ROLE_CODES,
    Announcement,
    BackgroundService,
    check_host_port,
    join_host_port,
    open_announcement,
)
from kvx.errors import ConfigProblem
from kvx.proxy.config import ProxySettingError, normalize_server_url
from kvx.proxy.pool import Role, ServerPool
from kvx.wire import MAC_BYTES, ReplayGuard, WireError

log = logging.getLogger("kvx.proxy.discovery")

REFUSAL_LOG_INTERVAL_S = 10.0
"""At most one refusal is logged per this many seconds (the rest are counted), so a flood of
garbage cannot flood the log."""
POLL_MS = 100


@dataclass(frozen=True)
class DiscoverySettings:
    """How the proxy listens for announcements (`kvx proxy --discovery-*`)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_DISCOVERY_PORT
    timeout_s: float = 10.0
    """A discovered server leaves the rotation this long after its last heartbeat."""
    max_servers: int = 256
    secret: str | None = None


@dataclass
class DiscoveryCounts:
    accepted: int = 0
    refused: int = 0
    joined: int = 0
    left: int = 0
    last_refusal: str | None = None


class DiscoveryListener(BackgroundService):
    """Listens for announcements and keeps `pool` in step with them; `start()` binds
    (ProxySettingError naming the flag if it cannot) and serves from a daemon thread."""

    def __init__(self, pool: ServerPool, settings: DiscoverySettings) -> None:
        self.pool, self.settings = pool, settings
        self.counts = DiscoveryCounts()
        self._guard = ReplayGuard(window_s=120.0) if settings.secret is not None else None
        self._deadlines: dict[tuple[Role, str], float] = {}  # discovered server -> expiry
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops a peer that sends a bigger message before it is buffered
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANNOUNCEMENT_BYTES + MAC_BYTES)
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        host = settings.host.strip("[]")
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(f"tcp://{join_host_port(host, settings.port)}")
        except zmq.ZMQError as exc:
            self._close()
            flag = "--discovery-host" if exc.errno == zmq.EADDRNOTAVAIL else "--discovery-port"
            raise ProxySettingError(
                [ConfigProblem(flag, f"cannot listen on {host}:{settings.port}: {exc}")]
            ) from None
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address = endpoint.removeprefix("tcp://")
        """host:port it listens on (the port chosen when `settings.port` is 0)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvx-discovery", daemon=True)
        self._last_logged = -REFUSAL_LOG_INTERVAL_S
        self._unlogged = 0

    def start(self) -> DiscoveryListener:
        self._thread.start()
        secured = "sealed with a secret" if self.settings.secret else "WITHOUT a secret"
        log.info("discovery listening on %s (%s)", self.address, secured)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"discovery listener on {self.address} did not stop in {timeout} s")
        self._close()

    def _close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.close()
            self._context.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(POLL_MS):
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self.handle(frames[1:])  # frame 0: the peer's ROUTER identity
            self.expire(time.monotonic())

    def handle(self, frames: list[bytes]) -> None:
        """One message (without its identity frame): accept it or log why not."""
        if len(frames) != 1:
            self._refuse(f"{len(frames)} frames; an announcement is one frame")
            return
        try:
            note = open_announcement(self.settings.secret, frames[0])
        except WireError as exc:
            self._refuse(str(exc))
            return
        if self._guard is not None and (why := self._guard.check(note.nonce, note.sent_at)):
            self._refuse(f"announcement of {note.http_address}: {why}")
            return
        try:
            self.accept(note, time.monotonic())
        except ValueError as exc:  # an address the pool cannot take as a URL
            self._refuse(f"announcement of {note.http_address}: {exc}")

    def accept(self, note: Announcement, now: float) -> None:
        role = Role(ROLE_CODES[note.type])
        host, port = check_host_port("http_address", note.http_address)
        url = f"http://{join_host_port(host, port)}"
        key = (role, normalize_server_url(url))
        if note.leaving:
            self.counts.accepted += 1
            if key in self._deadlines:
                self._leave(key, "it announced it is leaving")
            return
        server = self.pool.add_discovered(
            role, url, note.zmq_address or None, self.settings.max_servers
        )
        if server is None:
            self._refuse(
                f"{role} server {url}: {self.settings.max_servers} discovered servers are "
                "registered already (--discovery-max-servers)"
            )
            return
        self.counts.accepted += 1
        if server.discovered:
            if key not in self._deadlines:
                self.counts.joined += 1
            self._deadlines[key] = now + self.settings.timeout_s

    def expire(self, now: float) -> None:
        """Take out every discovered server whose last heartbeat is older than the timeout."""
        for key, deadline in list(self._deadlines.items()):
            if deadline <= now:
                self._leave(key, f"no heartbeat for {self.settings.timeout_s:g} s")

    def _leave(self, key: tuple[Role, str], why: str) -> None:
        del self._deadlines[key]
        self.counts.left += 1
        role, url = key
        log.warning("%s server %s leaves the rotation: %s", role, url, why)
        self.pool.remove(role, url)

    def _refuse(self, why: str) -> None:
        self.counts.refused += 1
        self.counts.last_refusal = why
        now = time.monotonic()
        if now - self._last_logged >= REFUSAL_LOG_INTERVAL_S:
            more = f" ({self._unlogged} more refused since the last one logged)" * bool(
                self._unlogged
            )
            log.warning("discovery refused a message: %s%s", why, more)
            self._last_logged, self._unlogged = now, 0
        else:
            self._unlogged += 1
