"""Service discovery for xPyD serving: P and D servers announce themselves to `kvx proxy`.

A public module of kvx's API. A server (its connector's worker or scheduler) runs an
`Announcer`: a background thread that sends an `Announcement` (role, HTTP address, KV/ZMQ
address) over a ZMQ DEALER socket to the proxy's discovery listener every few seconds, and a
last one with `leaving` set when it stops. The proxy puts an announced server into rotation and
takes it out when its heartbeats stop (`kvx.proxy.discovery`).

The message is msgpack with the keys vLLM's P2P NCCL example uses (`type` "P"/"D",
`http_address`, `zmq_address`, each "host:port"), so a vLLM instance of that example can announce
itself to `kvx proxy` too, plus kvx's own optional keys. With a shared secret every message is
sealed (`kvx.wire.seal`, HMAC-SHA256) and carries a nonce and a timestamp the proxy checks
against replays.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import re
import threading
import time
from types import TracebackType
from typing import Annotated, Self

import msgspec
import zmq

from kvx.errors import quote
from kvx.wire import WireError, decode_sealed, encode, seal

__all__ = [
    "DEFAULT_DISCOVERY_PORT",
    "DISCOVERY_DOMAIN",
    "HEARTBEAT_INTERVAL_S",
    "MAX_ANNOUNCEMENT_BYTES",
    "ROLE_CODES",
    "Announcement",
    "Announcer",
    "BackgroundService",
    "check_host_port",
    "open_announcement",
    "seal_announcement",
]

log = logging.getLogger("kvx.discovery")

DEFAULT_DISCOVERY_PORT = 30001
"""The port vLLM's xPyD example listens on for heartbeats."""
HEARTBEAT_INTERVAL_S = 3.0
"""How often a server announces itself (vLLM's example pings every 3 s)."""
MAX_ANNOUNCEMENT_BYTES = 1024
"""The largest announcement the proxy decodes (a real one is about 150 bytes)."""
MAX_ADDRESS_CHARS = 300
HOST_NAME = re.compile(r"[A-Za-z0-9._-]{1,253}")
DISCOVERY_DOMAIN = b"kvx-discovery-v1"
"""The seal's domain: an announcement's tag cannot pass for any other sealed kvx message."""
NONCE_BYTES = 16
CONNECT_POLL_MS = 200
ROLE_CODES = {"P": "prefill", "D": "decode"}
"""The announcement's `type` and the proxy role it stands for."""


class Announcement(msgspec.Struct, frozen=True):
    """One heartbeat of a P or D server."""

    type: Annotated[str, msgspec.Meta(max_length=1)]
    """"P" (prefill) or "D" (decode)."""
    http_address: Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS)]
    """host:port of the server's OpenAI-compatible HTTP endpoint."""
    zmq_address: Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS)] = ""
    """host:port of the connector's KV listener (rank 0's); empty if it has none."""
    nonce: Annotated[bytes, msgspec.Meta(max_length=NONCE_BYTES)] = b""
    sent_at: float = 0.0
    """Unix time when it was sent (checked against replays with a secret)."""
    leaving: bool = False
    """The server stops: take it out of rotation now rather than after the heartbeat timeout."""


def check_host_port(field: str, text: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[v6]:port`; ValueError naming `field` otherwise."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"{field}: {quote(text)} is not host:port")
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            valid = ipaddress.ip_address(host).version == 6
        except ValueError:
            valid = False
    elif ":" in host:
        raise ValueError(f"{field}: {quote(text)}: write an IPv6 address as [addr]:port")
    else:
        valid = HOST_NAME.fullmatch(host) is not None
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{field}: {quote(text)} is not host:port with a port in 1-65535")
    if not valid:
        raise ValueError(
            f"{field}: {quote(text)}: the host must be a name or IPv4 address (letters, digits, "
            "'.', '-', '_') or an IPv6 address in brackets"
        )
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def seal_announcement(secret: str | None, note: Announcement) -> bytes:
    return seal(secret, DISCOVERY_DOMAIN, encode(note))


def open_announcement(secret: str | None, data: bytes | memoryview) -> Announcement:
    """Authenticate (with a secret), decode and check an announcement; `WireError` says why
    it was refused."""
    note = decode_sealed(
        data, Announcement, secret, DISCOVERY_DOMAIN, max_bytes=MAX_ANNOUNCEMENT_BYTES
    )
    if note.type not in ROLE_CODES:
        raise WireError(f'announcement: type {quote(note.type)} is not "P" or "D"')
    try:
        check_host_port("http_address", note.http_address)
        if note.zmq_address:
            check_host_port("zmq_address", note.zmq_address)
    except ValueError as exc:
        raise WireError(f"announcement: {exc}") from None
    if secret is not None and (len(note.nonce) != NONCE_BYTES or not math.isfinite(note.sent_at)):
        raise WireError("announcement: a sealed announcement needs a 16-byte nonce and sent_at")
    return note


class BackgroundService:
    """Something that serves from a background thread: `with service:` enters through `start()`
    and leaves through `stop()` (the announcer and both of the proxy's listeners)."""

    def start(self) -> Self:
        """Start serving (default: it serves from construction on) and return self."""
        return self

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class Announcer(BackgroundService):
    """Announces one server to the proxy every `interval_s` from a daemon thread until
    `stop()`, which sends a last announcement with `leaving` set. A proxy that is down or
    unreachable only means heartbeats are dropped (never queued): the server keeps serving and
    is announced again once the proxy is back."""

    def __init__(
        self,
        proxy_address: str,
        role: str,
        http_address: str,
        kv_address: str = "",
        *,
        interval_s: float = HEARTBEAT_INTERVAL_S,
        secret: str | None = None,
    ) -> None:
        codes = {**{c: c for c in ROLE_CODES}, **{name: c for c, name in ROLE_CODES.items()}}
        if role not in codes:
            raise ValueError(f'role: {quote(role)} is not one of "prefill", "decode", P, D')
        check_host_port("proxy_address", proxy_address)
        check_host_port("http_address", http_address)
        if kv_address:
            check_host_port("kv_address", kv_address)
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s: {interval_s!r} is not a number of seconds > 0")
        self.proxy_address, self.code = proxy_address, codes[role]
        self.http_address, self.kv_address = http_address, kv_address
        self.interval_s, self._secret = interval_s, secret
        self.sent = 0
        """Announcements handed to ZMQ so far (dropped ones are not counted)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def message(self, leaving: bool = False) -> bytes:
        note = Announcement(
            self.code,
            self.http_address,
            self.kv_address,
            os.urandom(NONCE_BYTES) if self._secret is not None else b"",
            time.time(),
            leaving,
        )
        return seal_announcement(self._secret, note)

    def start(self) -> Announcer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvx-announcer", daemon=True)
            self._thread.start()
            log.info(
                "announcing %s server %s (kv %s) to the proxy at %s every %g s",
                ROLE_CODES[self.code],
                self.http_address,
                self.kv_address or "-",
                self.proxy_address,
                self.interval_s,
            )
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Send the leaving announcement and end the thread (at most `timeout` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the announcer to {self.proxy_address} did not stop")

    def _run(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a proxy not connected
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.setsockopt(zmq.LINGER, 500)  # the leaving message may take this long
        try:
            sock.connect(f"tcp://{self.proxy_address}")
            while True:
                leaving = self._stop.is_set()
                # writable only once connected: the first heartbeat goes as soon as it can
                if sock.poll(CONNECT_POLL_MS, zmq.POLLOUT):
                    with contextlib.suppress(zmq.Again):
                        sock.send(self.message(leaving), zmq.NOBLOCK)
                        self.sent += 1
                    if not leaving:
                        self._stop.wait(self.interval_s)  # stop() ends it: send the last one
                        continue
                if leaving:
                    break
        except zmq.ZMQError as exc:
            log.error("announcer to %s stopped: %s", self.proxy_address, exc)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.close()
                context.term()
