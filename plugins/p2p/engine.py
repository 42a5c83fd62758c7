"""One worker's P2P engine: a ZMQ ROUTER listener (thread) and DEALER connections to peers.

Every exchange is "sealed request [+ data frames] -> sealed reply [+ data frames]" with a
timeout; the data plane (`planes.py`) decides whether bytes ride as frames (CPU) or over NCCL
after the reply. The listener survives anything a peer sends: bytes that do not authenticate
or decode are dropped with a logged refusal; a request it cannot serve gets a refusal reply.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from kvx.layouts import get_layout
from kvx.plugins.p2p.addresses import format_address
from kvx.plugins.p2p.affinity import leave_compute_cores
from kvx.plugins.p2p.buffers import RecvBuffer, SendStore
from kvx.plugins.p2p.messages import (
    MAX_CONTROL_BYTES,
    Geometry,
    Get,
    Hello,
    Put,
    Reply,
    TensorMeta,
    open_reply,
    open_request,
    seal_reply,
    seal_request,
)
from kvx.plugins.p2p.planes import DataPlane, PlaneError
from kvx.plugins.p2p.tensors import Segments, expected_nbytes, gather, has_heads, physical
from kvx.wire import ReplayGuard, WireError

logger = logging.getLogger(__name__)
POLL_MS = 100
MAX_PAIRS = 4096
"""DEALERs one listener pairs with before it refuses new ones."""
WARN_EVERY_S = 10.0
CONNECT_S = 5.0
"""How long first contact waits for a TCP connection before the peer counts as down."""
MAX_UNACKED = 256
"""PUTs sent ahead of their acks to one peer (`send_puts`), well under ZMQ's queue limits: a
ROUTER drops replies to a peer whose queue is full."""


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
    unacked: deque[tuple[TensorMeta, bytes, float]] = field(default_factory=deque)
    """PUTs sent by `send_puts` whose ack is still to be read: (meta, nonce, deadline)."""


class P2pEngine:
    """`listen`: (host, port) to bind, or None for a worker that only connects out.
    `recv` takes PUTs (D in PUT modes), `store` serves GETs (P in GET mode)."""

    def __init__(
        self,
        name: str,
        listen: tuple[str, int] | None,
        plane: DataPlane,
        geometry: Geometry,
        *,
        secret: str | None,
        timeout_s: float,
        max_tensor_bytes: int,
        recv: RecvBuffer | None = None,
        store: SendStore | None = None,
        count: Callable[[str, int], None] = lambda key, n: None,
    ) -> None:
        self.name, self.plane, self.geometry = name, plane, geometry
        self.secret, self.timeout_s, self.max_tensor_bytes = secret, timeout_s, max_tensor_bytes
        self.recv, self.store, self.count = recv, store, count
        self._context = zmq.Context()
        self._peers: dict[str, Peer] = {}
        self._peers_lock = threading.Lock()
        self._paired: set[bytes] = set()
        self._replays = ReplayGuard()
        self._stop = threading.Event()
        self._last_warning = 0.0
        self._lost: list[tuple[TensorMeta, str]] = []
        self._lost_lock = threading.Lock()
        self._router: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self.address: str | None = None
        if listen is not None:
            self._bind(*listen)

    # -- listener -------------------------------------------------------------------------

    def _bind(self, host: str, port: int) -> None:
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, max(self.max_tensor_bytes, MAX_CONTROL_BYTES) + 64)
        address = format_address(host, port)
        try:
            if port == 0:
                port = router.bind_to_random_port(
                    f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
                )
                address = format_address(host, port)
            else:
                router.bind(f"tcp://{address}")
        except zmq.ZMQError as exc:
            router.close(0)
            self._context.term()
            raise OSError(
                f"P2P worker {self.name}: cannot listen on {address} ({exc}); kv_port + rank "
                "must be free on kv_ip"
            ) from None
        self._router, self.address = router, address
        self._thread = threading.Thread(target=self._serve, name=f"kvx-p2p-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._router is not None
        leave_compute_cores()
        router = self._router
        while not self._stop.is_set():
            try:
                if not router.poll(POLL_MS):
                    continue
                frames = router.recv_multipart(copy=False)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            try:
                self._handle(router, frames)
            except Exception as exc:  # an untrusted peer: refuse, keep serving
                self._refused(f"handling a message failed: {type(exc).__name__}: {exc}")

    def _refused(self, why: str) -> None:
        self.count("refused_messages", 1)
        now = time.monotonic()
        if now - self._last_warning > WARN_EVERY_S:
            self._last_warning = now
            logger.warning("P2P listener %s refused a message: %s", self.address, why)

    def _handle(self, router: zmq.Socket, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._refused(f"{len(frames)} frames, at least 2 expected")
            return
        identity = frames[0].bytes
        try:
            envelope = open_request(self.secret, frames[1].buffer)
        except WireError as exc:
            self._refused(str(exc))
            return
        nonce, data = envelope.nonce, frames[2:]
        answered = False

        def answer(reply: Reply, extra: list[Any] | None = None) -> None:
            nonlocal answered
            answered = True
            router.send_multipart([identity, seal_reply(self.secret, nonce, reply), *(extra or [])])

        try:
            self._dispatch(identity, envelope, data, answer)
        except Exception as exc:  # an untrusted peer: refuse, keep serving
            why = f"{type(exc).__name__}: {exc}"
            self._refused(why)
            if not answered:
                answer(Reply(False, why[:1000]))

    def _dispatch(
        self, identity: bytes, envelope: Any, data: list[Any], answer: Callable[..., None]
    ) -> None:

        if self.secret is not None:
            stale = self._replays.check(envelope.nonce, envelope.timestamp)
            if stale is not None:
                self._refused(stale)
                answer(Reply(False, stale))
                return
        message = envelope.message
        if isinstance(message, Hello):
            self._on_hello(identity, message, answer)
        elif identity not in self._paired:
            self._refused("a transfer before HELLO")
            answer(Reply(False, "send HELLO first"))
        elif isinstance(message, Put):
            self._on_put(identity, message.meta, data, answer)
        else:
            self._on_get(identity, message, answer)

    def _on_hello(self, identity: bytes, hello: Hello, answer: Callable[..., None]) -> None:
        if hello.plane != self.plane.name:
            why = f"this worker's data plane is {self.plane.name!r}, the peer's {hello.plane!r}"
            self._refused(why)
            answer(Reply(False, why))
            return
        if identity not in self._paired and len(self._paired) >= MAX_PAIRS:
            answer(Reply(False, f"too many peers ({MAX_PAIRS})"))
            return
        answer(Reply(True, geometry=self.geometry))
        self.plane.join(identity, hello.unique_id, 1)
        self._paired.add(identity)

    def _on_put(
        self, identity: bytes, meta: TensorMeta, data: list[Any], answer: Callable[..., None]
    ) -> None:
        why = self._meta_problem(meta) or self.plane.check(meta, data)
        if why is None and self.recv is None:
            why = "this worker takes no PUTs (it is not a consumer with send_type PUT*)"
        if why is None:
            assert self.recv is not None
            admitted = self.recv.admit(meta)
            if admitted not in (None, "spill"):
                self.count("refused_puts", 1)
                answer(Reply(False, admitted))
                return
            spill = admitted == "spill"
            try:
                prepared = self.plane.prepare(identity, meta)
            except PlaneError as exc:
                self.recv.unreserve(meta.nbytes, spill)
                self.count("refused_puts", 1)
                answer(Reply(False, str(exc)))
                return
            answer(Reply(True))
            try:
                raw, keep = self.plane.collect(identity, meta, data, prepared)
                self.recv.put(
                    (meta.request_id, meta.layer, meta.first_head), meta, raw, spill, keep
                )
            except Exception:
                self.recv.unreserve(meta.nbytes, spill)
                raise
            self.count("received_bytes", meta.nbytes)
            return
        self._refused(why)
        answer(Reply(False, why))

    def _on_get(self, identity: bytes, get: Get, answer: Callable[..., None]) -> None:
        item = self.store.lookup(get.request_id, get.layer) if self.store else None
        if item is None:
            answer(
                Reply(
                    False,
                    f"{get.request_id}#{get.layer}: not held here (never stored, "
                    "evicted or expired)",
                )
            )
            return
        held = range(item.meta.first_head, item.meta.first_head + item.meta.num_heads)
        asked = range(get.first_head, get.first_head + get.num_heads)
        layout = get_layout(item.meta.layout)
        if has_heads(layout) and not (asked.start >= held.start and asked.stop <= held.stop):
            answer(Reply(False, f"heads {asked} asked, {held} held"))
            return
        tensor = item.tensor
        if has_heads(layout) and asked != held:
            local = range(asked.start - held.start, asked.stop - held.start)
            tensor = gather(
                tensor, layout, list(range(item.meta.num_blocks)), local, item.meta.head_size
            )
        wire = physical(tensor, layout)
        meta = msgspec.structs.replace(
            item.meta,
            first_head=asked.start if has_heads(layout) else item.meta.first_head,
            num_heads=len(asked) if has_heads(layout) else item.meta.num_heads,
            nbytes=wire.numel(),
        )
        if self.store is not None:
            self.store.served(get.request_id, get.layer, get.readers)
        answer(Reply(True, meta=meta), self.plane.frames([wire]))
        self.plane.deliver(identity, [wire])
        self.count("served_bytes", wire.numel())

    def _meta_problem(self, meta: TensorMeta) -> str | None:
        if meta.nbytes > self.max_tensor_bytes:
            return f"{meta.nbytes} bytes exceed max_tensor_bytes {self.max_tensor_bytes}"
        try:
            expected = expected_nbytes(meta)
        except (LookupError, ValueError, TypeError, AttributeError) as exc:
            return f"unusable tensor meta: {exc}"
        if expected != meta.nbytes:
            return f"meta announces {meta.nbytes} bytes, its shape makes {expected}"
        return None

    # -- connecting out -------------------------------------------------------------------

    def _peer(self, address: str) -> Peer:
        with self._peers_lock:
            peer = self._peers.get(address)
            if peer is None:
                socket = self._context.socket(zmq.DEALER)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout_s * 1000)))
                identity = os.urandom(16)
                socket.setsockopt(zmq.IDENTITY, identity)
                socket.connect(f"tcp://{address}")
                peer = Peer(address, socket, identity, threading.Lock())
                self._peers[address] = peer
            return peer

    @contextmanager
    def _locked(self, address: str, deadline: float, what: str) -> Iterator[Peer]:
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

    def _drop(self, peer: Peer, why: str = "connection dropped") -> None:
        """A peer that failed an exchange: its socket may hold a late reply, so start over."""
        peer.closed = True
        if peer.unacked:  # their frames are discarded with the socket: they failed
            with self._lost_lock:
                self._lost.extend(
                    (meta, f"{peer.address}: {why} (before its ack)") for meta, _, _ in peer.unacked
                )
            peer.unacked.clear()
        with self._peers_lock:
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
        peer.socket.close(0)
        self.plane.leave(peer.identity)

    def _exchange(
        self,
        peer: Peer,
        message: Hello | Put | Get,
        frames: list[Any],
        deadline: float,
        what: str,
    ) -> tuple[Reply, list[Any]]:
        """One request and its reply (with any data frames behind it)."""
        envelope, nonce = seal_request(self.secret, message)
        try:
            peer.socket.send_multipart([envelope, *frames], copy=False)
        except zmq.ZMQError as exc:
            self._drop(peer)
            raise TransferError(f"{what}: {exc}") from None
        return self._reply(peer, nonce, deadline, what)

    def _pair(self, peer: Peer, deadline: float, what: str) -> None:
        """HELLO, once per connection; the caller holds `peer.lock`."""
        if peer.geometry is None:
            address = peer.address
            self._probe(peer, deadline, what)
            pair_id = self.plane.new_pair_id()
            hello = Hello(self.plane.name, pair_id)
            reply, _ = self._exchange(peer, hello, [], deadline, f"HELLO before {what}")
            if not reply.ok or reply.geometry is None:
                self._drop(peer)
                raise TransferError(f"{address} refused HELLO: {reply.error or 'no geometry'}")
            try:
                self.plane.join(peer.identity, pair_id, 0)
            except PlaneError as exc:
                self._drop(peer)
                raise TransferError(f"{address}: {exc}") from None
            peer.geometry = reply.geometry

    def _probe(self, peer: Peer, deadline: float, what: str) -> None:
        """A plain TCP connect before first contact: a peer that is not running fails at once
        (its port refuses) instead of after the whole timeout, which on P would hold the
        engine's step. A live peer's kernel accepts even while the peer itself is busy."""
        host, port = peer.address.rsplit(":", 1)
        timeout = min(_left(deadline, what), CONNECT_S)
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except OSError as exc:
            self._drop(peer)
            raise TransferError(
                f"{what}: cannot connect to {peer.address} ({exc}); is it running?"
            ) from None

    def geometry_of(self, address: str) -> Geometry:
        """The KV geometry of the worker at `address` (HELLO on first contact). A paired peer's
        is answered without its lock, which a PUT_ASYNC send may hold while it waits for acks:
        P's next layer must not wait for them."""
        with self._peers_lock:
            known = self._peers.get(address)
        if known is not None and known.geometry is not None and not known.closed:
            return known.geometry
        with self._locked(address, time.monotonic() + self.timeout_s, "HELLO") as peer:
            assert peer.geometry is not None
            return peer.geometry

    def put(self, address: str, meta: TensorMeta, wire: torch.Tensor) -> None:
        """Push one tensor (its memory-order bytes); `TransferError` if it did not land."""
        failed = self.put_many(address, [(meta, [wire])])
        if failed:
            raise TransferError(failed[0][1])

    def put_many(
        self, address: str, items: list[tuple[TensorMeta, Segments]]
    ) -> list[tuple[TensorMeta, str]]:
        """Push several tensors (each as segments of its memory-order bytes) to one peer,
        pipelined: every announcement (with its frames on the CPU plane) goes out first, then
        the replies are read in order and each admitted tensor is delivered (NCCL: in that same
        order). Returns the ones that did not land, with why; a dead peer fails them all within
        the timeout. Once it returns, the peer holds (or refused) every byte: segments that
        view a KV cache may change again."""
        deadline = time.monotonic() + self.timeout_s
        what = _batch(items)
        try:
            with self._locked(address, deadline, what) as peer:
                sent = []
                for meta, wire in items:
                    envelope, nonce = seal_request(self.secret, Put(meta))
                    peer.socket.send_multipart([envelope, *self.plane.frames(wire)], copy=False)
                    sent.append((meta, wire, nonce))
                failed: list[tuple[TensorMeta, str]] = []
                for index, (meta, wire, nonce) in enumerate(sent):
                    try:
                        reply, _ = self._reply(
                            peer, nonce, deadline, f"PUT {meta.request_id}#{meta.layer}"
                        )
                    except TransferError as exc:
                        return failed + [(m, str(exc)) for m, _, _ in sent[index:]]
                    if reply.ok:
                        try:
                            self.plane.deliver(peer.identity, wire)
                        except PlaneError as exc:  # the pair is gone: start over next time
                            self._drop(peer)
                            return failed + [(m, str(exc)) for m, _, _ in sent[index:]]
                    else:
                        failed.append(
                            (
                                meta,
                                f"{address} refused {meta.request_id}#{meta.layer}: {reply.error}",
                            )
                        )
                return failed
        except (TransferError, zmq.ZMQError) as exc:
            return [(meta, str(exc)) for meta, _ in items]

    def send_puts(
        self, address: str, items: list[tuple[TensorMeta, Segments]]
    ) -> list[tuple[TensorMeta, str]]:
        """Push tensors without waiting for their acks (a plane whose frames carry the bytes:
        nothing is delivered after the reply); `settle` reads the acks. Returns those that could
        not be sent. Until `settle` accounted for it, a tensor's segments may still be read."""
        if not self.plane.sends_views:
            raise TypeError(f"send_puts: the {self.plane.name} plane delivers after the ack")
        deadline = time.monotonic() + self.timeout_s
        sent = 0
        what = _batch(items)
        try:
            with self._locked(address, deadline, what) as peer:
                for meta, wire in items:
                    while len(peer.unacked) >= MAX_UNACKED and not peer.closed:
                        self._read_ack(peer)
                    if peer.closed:
                        raise TransferError(f"{what}: {address}: connection dropped")
                    envelope, nonce = seal_request(self.secret, Put(meta))
                    try:
                        peer.socket.send_multipart([envelope, *self.plane.frames(wire)], copy=False)
                    except zmq.ZMQError as exc:
                        self._drop(peer, str(exc))
                        raise TransferError(f"{what}: {address}: {exc}") from None
                    peer.unacked.append((meta, nonce, deadline))
                    sent += 1
                while peer.unacked and not peer.closed and peer.socket.poll(0):
                    self._read_ack(peer)
        except TransferError as exc:
            return [(meta, str(exc)) for meta, _ in items[sent:]]
        return []

    def _read_ack(self, peer: Peer) -> None:
        """Read the oldest unacked PUT's reply (the caller holds `peer.lock`); a refusal or a
        broken connection goes to what `settle` reports."""
        meta, nonce, deadline = peer.unacked[0]
        try:
            # past its deadline an ack already here is still read (1 ms), never waited for
            late = max(deadline, time.monotonic() + 0.001)
            reply, _ = self._reply(peer, nonce, late, f"PUT {meta.request_id}#{meta.layer}")
        except TransferError:
            return  # `_reply` dropped the peer: every unacked PUT of it is lost
        peer.unacked.popleft()
        if not reply.ok:
            with self._lost_lock:
                self._lost.append(
                    (meta, f"{peer.address} refused {meta.request_id}#{meta.layer}: {reply.error}")
                )

    def settle(self) -> list[tuple[TensorMeta, str]]:
        """Read every outstanding ack of `send_puts` (each within its deadline); return the
        PUTs that did not land, with why. Afterwards no frame of theirs is read any more."""
        with self._peers_lock:
            peers = list(self._peers.values())
        for peer in peers:
            with peer.lock:
                while peer.unacked and not peer.closed:
                    self._read_ack(peer)
        with self._lost_lock:
            lost, self._lost = self._lost, []
        return lost

    def _reply(
        self, peer: Peer, nonce: bytes, deadline: float, what: str
    ) -> tuple[Reply, list[Any]]:
        """The reply to `what`, or a `TransferError` naming it (the peer is dropped)."""
        try:
            timeout_s = _left(deadline, what)
            if not peer.socket.poll(max(1, int(timeout_s * 1000))):
                raise TransferError(
                    f"{what}: no reply from {peer.address} within {timeout_s:.1f}s "
                    "(is it running? is its listener thread getting CPU?)"
                )
            parts = peer.socket.recv_multipart(copy=False)
            return open_reply(self.secret, nonce, parts[0].buffer), parts[1:]
        except TransferError as exc:
            self._drop(peer, str(exc))
            raise
        except (WireError, zmq.ZMQError) as exc:
            self._drop(peer, f"{what}: {exc}")
            raise TransferError(f"{what}: {exc}") from None

    def get(self, address: str, get: Get, deadline: float) -> tuple[TensorMeta, Segments, Any]:
        """Pull one tensor: (meta, its segments, what must outlive them)."""
        what = (
            f"GET {get.request_id}#{get.layer} heads "
            f"{get.first_head}..{get.first_head + get.num_heads}"
        )
        with self._locked(address, deadline, what) as peer:
            reply, frames = self._exchange(peer, get, [], deadline, what)
            if not reply.ok or reply.meta is None:
                raise TransferError(f"{what}: {address}: {reply.error or 'no tensor meta'}")
            meta = reply.meta
            why = self._meta_problem(meta) or self.plane.check(meta, frames)
            if why is None and (meta.request_id, meta.layer) != (get.request_id, get.layer):
                why = f"asked {get.request_id}#{get.layer}, got {meta.request_id}#{meta.layer}"
            if why is not None:
                self._drop(peer)
                raise TransferError(f"{what}: {address}: bad reply: {why}")
            try:
                raw, keep = self.plane.collect(peer.identity, meta, frames)
            except PlaneError as exc:
                self._drop(peer)
                raise TransferError(f"{what}: {address}: {exc}") from None
            return meta, raw, keep

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._router is not None:
            self._router.close(0)
            self._router = None
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            with peer.lock:
                peer.socket.close(0)
        self.plane.close()
        self._context.term()


def _batch(items: list[tuple[TensorMeta, Any]]) -> str:
    """`what` of a batch of PUTs, for errors: how many, and the first."""
    first = f" ({items[0][0].request_id}#{items[0][0].layer}, ...)" if items else ""
    return f"PUT of {len(items)} tensors{first}"


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(f"{what}: out of time before the exchange started")
    return left
