"""One worker's P2P engine: its listener (`listener.py`) and its connections to peers
(`connections.py`), with the exchanges a worker asks for: HELLO, PUT (one by one, pipelined, or
unacked with `send_puts` + `settle`) and GET. On the CPU plane several PUTs to one peer travel
as one `PutBatch` (one sealed header, one ack).

Every exchange is "sealed request [+ data frames] -> sealed reply [+ data frames]" with a
timeout; the data plane (`planes.py`) decides whether bytes ride as frames (CPU) or over NCCL
after the reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from kvx.plugins.p2p.buffers import RecvBuffer, SendStore
from kvx.plugins.p2p.connections import Connections, Peer, TransferError
from kvx.plugins.p2p.listener import Listener
from kvx.plugins.p2p.messages import (
    MAX_BATCH,
    MAX_CONTROL_BYTES,
    Geometry,
    Get,
    Put,
    PutBatch,
    Reply,
    TensorMeta,
    seal_request,
)
from kvx.plugins.p2p.planes import DataPlane, PlaneError
from kvx.plugins.p2p.tensors import Segments, meta_problem

__all__ = ["P2pEngine", "TransferError"]

MAX_UNACKED = 256
"""PUT batches sent ahead of their acks to one peer (`send_puts`), well under ZMQ's queue
limits: a ROUTER drops replies to a peer whose queue is full."""
Sealed = tuple[bytes, bytes, list[TensorMeta], list[Any]]
"""One batch ready to send: (sealed envelope, its nonce, the metas, every data frame)."""


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
        self.recv, self.store = recv, store
        self._context = zmq.Context()
        self._connections = Connections(self._context, plane, secret=secret, timeout_s=timeout_s)
        self.listener: Listener | None = None
        self.address: str | None = None
        if listen is not None:
            try:
                self.listener = Listener(
                    name,
                    *listen,
                    self._context,
                    plane,
                    geometry,
                    secret=secret,
                    max_tensor_bytes=max_tensor_bytes,
                    recv=recv,
                    store=store,
                    count=count,
                )
            except OSError:
                self._context.term()
                raise
            self.address = self.listener.address

    def geometry_of(self, address: str) -> Geometry:
        """The KV geometry of the worker at `address` (HELLO on first contact). A paired peer's
        is answered without its lock, which a PUT_ASYNC send may hold while it waits for acks:
        P's next layer must not wait for them."""
        known = self._connections.known(address)
        if known is not None and known.geometry is not None:
            return known.geometry
        with self._connections.locked(address, self._deadline(), "HELLO") as peer:
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
        if self.plane.sends_views:
            return self._put_batches(address, items)
        deadline = self._deadline()
        connections = self._connections
        try:
            with connections.locked(address, deadline, _batch(items)) as peer:
                sent = []
                for meta, wire in items:
                    envelope, nonce = seal_request(self.secret, Put(meta))
                    peer.socket.send_multipart([envelope, *self.plane.frames(wire)], copy=False)
                    sent.append((meta, wire, nonce))
                failed: list[tuple[TensorMeta, str]] = []
                for index, (meta, wire, nonce) in enumerate(sent):
                    try:
                        reply, _ = connections.reply(
                            peer, nonce, deadline, f"PUT {meta.request_id}#{meta.layer}"
                        )
                    except TransferError as exc:
                        return failed + [(m, str(exc)) for m, _, _ in sent[index:]]
                    if reply.ok:
                        try:
                            self.plane.deliver(peer.identity, wire)
                        except PlaneError as exc:  # the pair is gone: start over next time
                            connections.drop(peer)
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

    def _put_batches(
        self, address: str, items: list[tuple[TensorMeta, Segments]]
    ) -> list[tuple[TensorMeta, str]]:
        """`put_many` on a plane whose frames carry the bytes: every batch goes out, then each
        batch's one reply is read."""
        deadline = self._deadline()
        sealed = self._seal_batches(items)
        failed: list[tuple[TensorMeta, str]] = []
        try:
            with self._connections.locked(address, deadline, _batch(items)) as peer:
                try:
                    for envelope, _, _, frames in sealed:
                        peer.socket.send_multipart([envelope, *frames], copy=False)
                except zmq.ZMQError as exc:  # replies to what went out would confuse the next
                    self._connections.drop(peer, str(exc))
                    raise TransferError(f"{_batch(items)}: {address}: {exc}") from None
                for index, (_, nonce, metas, _) in enumerate(sealed):
                    try:
                        reply, _ = self._connections.reply(peer, nonce, deadline, _what(metas))
                    except TransferError as exc:
                        return failed + [(m, str(exc)) for b in sealed[index:] for m in b[2]]
                    failed += _refused(address, metas, reply)
                return failed
        except (TransferError, zmq.ZMQError) as exc:
            return [(meta, str(exc)) for meta, _ in items]

    def _seal_batches(self, items: list[tuple[TensorMeta, Segments]]) -> list[Sealed]:
        """`items` as sealed `PutBatch`es of at most `MAX_BATCH` slices whose header fits
        `MAX_CONTROL_BYTES` (a batch over it is halved)."""
        out: list[Sealed] = []
        todo = [items[i : i + MAX_BATCH] for i in range(0, len(items), MAX_BATCH)]
        while todo:
            chunk = todo.pop(0)
            metas = [meta for meta, _ in chunk]
            frames = [self.plane.frames(wire) for _, wire in chunk]
            envelope, nonce = seal_request(self.secret, PutBatch(metas, [len(f) for f in frames]))
            if len(envelope) > MAX_CONTROL_BYTES and len(chunk) > 1:
                half = len(chunk) // 2
                todo[:0] = [chunk[:half], chunk[half:]]
                continue
            out.append((envelope, nonce, metas, [f for fs in frames for f in fs]))
        return out

    def send_puts(
        self, address: str, items: list[tuple[TensorMeta, Segments]]
    ) -> list[tuple[TensorMeta, str]]:
        """Push tensors without waiting for their acks (a plane whose frames carry the bytes:
        nothing is delivered after the reply); `settle` reads the acks. Returns those that could
        not be sent. Until `settle` accounted for it, a tensor's segments may still be read."""
        if not self.plane.sends_views:
            raise TypeError(f"send_puts: the {self.plane.name} plane delivers after the ack")
        deadline = self._deadline()
        sent = 0
        what = _batch(items)
        try:
            with self._connections.locked(address, deadline, what) as peer:
                for envelope, nonce, metas, frames in self._seal_batches(items):
                    while len(peer.unacked) >= MAX_UNACKED and not peer.closed:
                        self._read_ack(peer)
                    if peer.closed:
                        raise TransferError(f"{what}: {address}: connection dropped")
                    try:
                        peer.socket.send_multipart([envelope, *frames], copy=False)
                    except zmq.ZMQError as exc:
                        self._connections.drop(peer, str(exc))
                        raise TransferError(f"{what}: {address}: {exc}") from None
                    peer.unacked.append((metas, nonce, deadline))
                    sent += len(metas)
                while peer.unacked and not peer.closed and peer.socket.poll(0):
                    self._read_ack(peer)
        except TransferError as exc:
            return [(meta, str(exc)) for meta, _ in items[sent:]]
        return []

    def _read_ack(self, peer: Peer) -> None:
        """Read the oldest unacked batch's reply (the caller holds `peer.lock`); its refusals
        or a broken connection go to what `settle` reports."""
        metas, nonce, deadline = peer.unacked[0]
        try:
            # past its deadline an ack already here is still read (1 ms), never waited for
            late = max(deadline, time.monotonic() + 0.001)
            reply, _ = self._connections.reply(peer, nonce, late, _what(metas))
        except TransferError:
            return  # the peer was dropped: every unacked PUT of it is lost
        peer.unacked.popleft()
        refused = _refused(peer.address, metas, reply)
        if refused:
            self._connections.lose(refused)

    def settle(self) -> list[tuple[TensorMeta, str]]:
        """Read every outstanding ack of `send_puts` (each within its deadline); return the
        PUTs that did not land, with why. Afterwards no frame of theirs is read any more."""
        for peer in self._connections.all():
            with peer.lock:
                while peer.unacked and not peer.closed:
                    self._read_ack(peer)
        return self._connections.take_lost()

    def get(self, address: str, get: Get, deadline: float) -> tuple[TensorMeta, Segments, Any]:
        """Pull one tensor: (meta, its segments, what must outlive them)."""
        what = (
            f"GET {get.request_id}#{get.layer} heads "
            f"{get.first_head}..{get.first_head + get.num_heads}"
        )
        connections = self._connections
        with connections.locked(address, deadline, what) as peer:
            reply, frames = connections.exchange(peer, get, [], deadline, what)
            if not reply.ok or reply.meta is None:
                raise TransferError(f"{what}: {address}: {reply.error or 'no tensor meta'}")
            meta = reply.meta
            why = meta_problem(meta, self.max_tensor_bytes) or self.plane.check(meta, frames)
            if why is None and (meta.request_id, meta.layer) != (get.request_id, get.layer):
                why = f"asked {get.request_id}#{get.layer}, got {meta.request_id}#{meta.layer}"
            if why is not None:
                connections.drop(peer)
                raise TransferError(f"{what}: {address}: bad reply: {why}")
            try:
                raw, keep = self.plane.collect(peer.identity, meta, frames)
            except PlaneError as exc:
                connections.drop(peer)
                raise TransferError(f"{what}: {address}: {exc}") from None
            return meta, raw, keep

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self._connections.close()
        self.plane.close()
        self._context.term()

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s


def _what(metas: list[TensorMeta]) -> str:
    """`what` of one sent batch, for errors."""
    first = metas[0]
    more = f" and {len(metas) - 1} more" if len(metas) > 1 else ""
    return f"PUT {first.request_id}#{first.layer}{more}"


def _refused(address: str, metas: list[TensorMeta], reply: Reply) -> list[tuple[TensorMeta, str]]:
    """The slices of a batch that `reply` says did not land, with why."""
    if not reply.ok:
        return [(m, f"{address} refused {m.request_id}#{m.layer}: {reply.error}") for m in metas]
    return [
        (metas[r.index], f"{address} refused {r.why}")
        for r in reply.refused
        if r.index < len(metas)
    ]


def _batch(items: list[tuple[TensorMeta, Any]]) -> str:
    """`what` of a batch of PUTs, for errors: how many, and the first."""
    first = f" ({items[0][0].request_id}#{items[0][0].layer}, ...)" if items else ""
    return f"PUT of {len(items)} tensors{first}"
