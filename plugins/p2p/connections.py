"""The requesting side of a worker's P2P engine: one DEALER connection per peer.

A connection is paired by HELLO on first contact (after a plain TCP probe, so a peer that is
not running fails at once), carries one exchange at a time under its lock, and is dropped on
any failure (its socket may hold a late reply). PUTs it loses unacked are kept for `take_lost`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvx.plugins.p2p.messages import (
    Geometry,
    Hello,
    Reply,
    Request,
    TensorMeta,
    open_reply,
    seal_request,
)
from kvx.plugins.p2p.planes import DataPlane, PlaneError
from kvx.wire import WireError, curve_client

CONNECT_S = 5.0
"""How long first contact waits for a TCP connection before the peer counts as down."""


RECHECK_S = 0.5
"""While it waits for a reply, how often a connection checks that the peer's port still accepts:
a peer that died (its port refuses) fails its exchanges at once; a slow one (its kernel still
accepts) gets the whole timeout."""


class TransferError(RuntimeError):
    """An exchange with a peer failed: no reply in time, a refusal or a bad reply."""


@dataclass
class Peer:
    address: str
    socket: zmq.Socket
    identity: bytes
    lock: threading.Lock
    geometry: Geometry | None = None
    closed: bool = False
    busy: str = ""
    """The exchange holding `lock` (for the error of a caller that waited on it)."""
    busy_since: float = 0.0
    unacked: deque[tuple[list[TensorMeta], bytes, float]] = field(default_factory=deque)
    """PUT batches sent ahead of their acks: (their metas, nonce, deadline)."""


class Connections:
    """DEALER connections to peers, by address, for one worker."""

    def __init__(
        self, context: zmq.Context, plane: DataPlane, *, secret: str | None, timeout_s: float
    ) -> None:
        self.plane, self.secret, self.timeout_s = plane, secret, timeout_s
        self._context = context
        self._peers: dict[str, Peer] = {}
        self._peers_lock = threading.Lock()
        self._lost: list[tuple[TensorMeta, str]] = []
        self._lost_lock = threading.Lock()

    def known(self, address: str) -> Peer | None:
        """The open connection to `address`, if any (without taking its lock)."""
        with self._peers_lock:
            peer = self._peers.get(address)
        return None if peer is None or peer.closed else peer

    def all(self) -> list[Peer]:
        with self._peers_lock:
            return list(self._peers.values())

    def lose(self, lost: list[tuple[TensorMeta, str]]) -> None:
        """Record PUTs that did not land, for `take_lost`."""
        with self._lost_lock:
            self._lost.extend(lost)

    def take_lost(self) -> list[tuple[TensorMeta, str]]:
        with self._lost_lock:
            lost, self._lost = self._lost, []
        return lost

    def _peer(self, address: str) -> Peer:
        with self._peers_lock:
            peer = self._peers.get(address)
            if peer is None:
                sock = self._context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout_s * 1000)))
                identity = os.urandom(16)
                sock.setsockopt(zmq.IDENTITY, identity)
                if self.secret is not None:
                    curve_client(sock, self.secret)
                sock.connect(f"tcp://{address}")
                peer = Peer(address, sock, identity, threading.Lock())
                self._peers[address] = peer
            return peer

    @contextmanager
    def locked(self, address: str, deadline: float, what: str) -> Iterator[Peer]:
        """The live, paired peer at `address`, its lock held (one exchange at a time) for
        `what` (e.g. "GET req#layer"); a `TransferError` naming the exchange that kept the
        connection busy if the lock is not free before `deadline`."""
        while True:
            peer = self._peer(address)
            if not peer.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TransferError(
                    f"{what}: the connection to {address} stayed busy with {peer.busy or '?'} "
                    f"for {time.monotonic() - peer.busy_since:.1f}s"
                )
            try:
                if peer.closed:  # dropped by another thread meanwhile: take the new one
                    continue
                peer.busy, peer.busy_since = what, time.monotonic()
                self._pair(peer, deadline, what)
                yield peer
                return
            finally:
                peer.busy = ""
                peer.lock.release()

    def drop(self, peer: Peer, why: str = "connection dropped") -> None:
        """A peer that failed an exchange: its socket may hold a late reply, so start over."""
        peer.closed = True
        if peer.unacked:  # their frames are discarded with the socket: they failed
            self.lose(
                [
                    (meta, f"{peer.address}: {why} (before its ack)")
                    for metas, _, _ in peer.unacked
                    for meta in metas
                ]
            )
            peer.unacked.clear()
        with self._peers_lock:
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
        peer.socket.close(0)
        self.plane.leave(peer.identity)

    def exchange(
        self,
        peer: Peer,
        message: Request,
        frames: list[Any],
        deadline: float,
        what: str,
    ) -> tuple[Reply, list[Any]]:
        """One request and its reply (with any data frames behind it)."""
        envelope, nonce = seal_request(self.secret, message)
        try:
            peer.socket.send_multipart([envelope, *frames], copy=False)
        except zmq.ZMQError as exc:
            self.drop(peer)
            raise TransferError(f"{what}: {exc}") from None
        return self.reply(peer, nonce, deadline, what)

    def reply(
        self, peer: Peer, nonce: bytes, deadline: float, what: str
    ) -> tuple[Reply, list[Any]]:
        """The reply to `what`, or a `TransferError` naming it (the peer is dropped)."""
        try:
            timeout_s = left(deadline, what)
            start = time.monotonic()
            while not peer.socket.poll(max(1, int(min(RECHECK_S, timeout_s) * 1000))):
                waited = time.monotonic() - start
                if waited >= timeout_s:
                    raise TransferError(
                        f"{what}: no reply from {peer.address} within {timeout_s:.1f}s "
                        "(is it running? is its listener thread getting CPU? does it have the "
                        "same shared_secret? a peer with another one cannot complete the ZMQ "
                        "handshake)"
                    )
                gone = _refused(peer.address, timeout_s - waited)
                if gone is not None:
                    raise TransferError(
                        f"{what}: no reply from {peer.address} after {waited:.1f}s: its port "
                        f"refuses connections ({gone}); it went away"
                    )
            parts = peer.socket.recv_multipart(copy=False)
            return open_reply(self.secret, nonce, parts[0].buffer), parts[1:]
        except TransferError as exc:
            self.drop(peer, str(exc))
            raise
        except (WireError, zmq.ZMQError) as exc:
            self.drop(peer, f"{what}: {exc}")
            raise TransferError(f"{what}: {exc}") from None

    def _pair(self, peer: Peer, deadline: float, what: str) -> None:
        """HELLO, once per connection; the caller holds `peer.lock`."""
        if peer.geometry is None:
            address = peer.address
            self._probe(peer, deadline, what)
            pair_id = self.plane.new_pair_id()
            hello = Hello(self.plane.name, pair_id)
            reply, _ = self.exchange(peer, hello, [], deadline, f"HELLO before {what}")
            if not reply.ok or reply.geometry is None:
                self.drop(peer)
                raise TransferError(f"{address} refused HELLO: {reply.error or 'no geometry'}")
            try:
                self.plane.join(peer.identity, pair_id, 0)
            except PlaneError as exc:
                self.drop(peer)
                raise TransferError(f"{address}: {exc}") from None
            peer.geometry = reply.geometry

    def _probe(self, peer: Peer, deadline: float, what: str) -> None:
        """A plain TCP connect before first contact: a peer that is not running fails at once
        (its port refuses) instead of after the whole timeout, which on P would hold the
        engine's step. A live peer's kernel accepts even while the peer itself is busy."""
        try:
            _tcp_connect(peer.address, min(left(deadline, what), CONNECT_S))
        except OSError as exc:
            self.drop(peer)
            raise TransferError(
                f"{what}: cannot connect to {peer.address} ({exc}); is it running?"
            ) from None

    def close(self) -> None:
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            with peer.lock:
                peer.socket.close(0)


def left(deadline: float, what: str) -> float:
    """Seconds to `deadline`; a `TransferError` naming `what` if none are left."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferError(f"{what}: out of time before the exchange started")
    return remaining


def _tcp_connect(address: str, timeout: float) -> None:
    """Open and close a plain TCP connection to `host:port` (raises OSError)."""
    host, port = address.rsplit(":", 1)
    socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()


def _refused(address: str, within_s: float) -> str | None:
    """Why `address` refuses a TCP connection (nothing listens there any more), or None if it
    accepts or cannot be told within `within_s` (at most a second)."""
    try:
        _tcp_connect(address, min(within_s, 1.0))
    except ConnectionRefusedError as exc:
        return str(exc)
    except OSError:
        return None
    return None
