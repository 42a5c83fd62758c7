"""The serving side of a worker's P2P engine: a ZMQ ROUTER listener on its own thread.

It answers HELLO (pairing), PUT and PUT_BATCH (into the receive buffer; a batch gets one reply
naming the slices it refused) and GET (from the send store). It survives anything a peer sends:
bytes that do not authenticate or decode are dropped with a logged refusal; a request it cannot
serve gets a refusal reply.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

import kvx
from kvx.layouts import Layout, get_layout
from kvx.plugins.p2p.addresses import format_address
from kvx.plugins.p2p.affinity import leave_compute_cores
from kvx.plugins.p2p.buffers import RecvBuffer, SendStore
from kvx.plugins.p2p.integrity import verify, with_digests
from kvx.plugins.p2p.messages import (
    MAX_BATCH,
    MAX_CONTROL_BYTES,
    MAX_SEGMENTS,
    REFUSAL_CHARS,
    Geometry,
    Get,
    Hello,
    Put,
    PutBatch,
    Refusal,
    Reply,
    TensorMeta,
    open_request,
    seal_reply,
)
from kvx.plugins.p2p.planes import DataPlane, PlaneError
from kvx.plugins.p2p.tensors import gather, has_heads, meta_problem, physical
from kvx.wire import ReplayGuard, WireError, curve_server, recv_frames

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
POLL_MS = 100
MAX_PAIRS = 4096
"""DEALERs one listener pairs with before it refuses new ones."""
WARN_EVERY_S = 10.0
MAX_FRAMES = 2 + MAX_BATCH * MAX_SEGMENTS
"""Frames of the largest message a peer may send: identity, envelope, a full batch's data."""


class Listener:
    """Binds (host, port) (0: a free port) and serves on a thread until `close`. `recv` takes
    PUTs (D in PUT modes), `store` serves GETs (P in GET mode)."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        context: zmq.Context,
        plane: DataPlane,
        geometry: Geometry,
        *,
        secret: str | None,
        max_tensor_bytes: int,
        recv: RecvBuffer | None,
        store: SendStore | None,
        count: Callable[[str, int], None],
    ) -> None:
        self.plane, self.geometry, self.secret = plane, geometry, secret
        self.max_tensor_bytes, self.recv, self.store, self.count = (
            max_tensor_bytes,
            recv,
            store,
            count,
        )
        self._paired: set[bytes] = set()
        self._replays = ReplayGuard()
        self._stop = threading.Event()
        self._last_warning = 0.0
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, max(max_tensor_bytes, MAX_CONTROL_BYTES) + 64)
        # with a secret, a peer without it fails the ZMQ handshake: libzmq queues nothing of it
        self._auth = curve_server(router, secret) if secret is not None else None
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
            if self._auth is not None:
                self._auth.stop()
            raise OSError(
                f"P2P worker {name}: cannot listen on {address} ({exc}); kv_port + rank "
                "must be free on kv_ip"
            ) from None
        self._router, self.address = router, address
        self.thread = threading.Thread(target=self._serve, name=f"kvx-p2p-{port}", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self._router.close(0)
        if self._auth is not None:
            self._auth.stop()

    def _serve(self) -> None:
        leave_compute_cores()
        router = self._router
        while not self._stop.is_set():
            try:
                if not router.poll(POLL_MS):
                    continue
                frames, count = recv_frames(router, MAX_FRAMES)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            if count > MAX_FRAMES:
                self._refused(f"{count} frames, at most {MAX_FRAMES} allowed")
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
        elif isinstance(message, PutBatch):
            self._on_put_batch(identity, message, data, answer)
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
        why = meta_problem(meta, self.max_tensor_bytes) or self.plane.check(meta, data)
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

    def _on_put_batch(
        self, identity: bytes, batch: PutBatch, data: list[Any], answer: Callable[..., None]
    ) -> None:
        """Check each slice against the header and its own frames, keep those that fit (one
        hand-off to the loader for the whole batch), reply once naming those refused."""
        why = None
        if self.recv is None:
            why = "this worker takes no PUTs (it is not a consumer with send_type PUT*)"
        elif not self.plane.sends_views:
            why = f"a PUT batch carries its bytes as frames; this plane is {self.plane.name!r}"
        elif sum(batch.frames) != len(data):
            why = f"{len(data)} data frames, the batch header announces {sum(batch.frames)}"
        if why is not None:
            self._refused(why)
            answer(Reply(False, why))
            return
        assert self.recv is not None
        refused: list[Refusal] = []
        kept: list[tuple[TensorMeta, list[Any], bool, Any]] = []
        start = 0
        try:
            for index, (meta, count) in enumerate(zip(batch.metas, batch.frames, strict=True)):
                frames, start = data[start : start + count], start + count
                problem = meta_problem(meta, self.max_tensor_bytes) or self.plane.check(
                    meta, frames
                )
                if problem is None:
                    admitted = self.recv.admit(meta)
                    if admitted in (None, "spill"):
                        try:
                            raw, keep = self.plane.collect(identity, meta, frames)
                        except PlaneError:
                            self.recv.unreserve(meta.nbytes, admitted == "spill")
                            raise
                        kept.append((meta, raw, admitted == "spill", keep))
                        continue
                    self.count("refused_puts", 1)
                    problem = admitted
                else:
                    self._refused(f"slice {index} ({meta.request_id}#{meta.layer}): {problem}")
                why = f"slice {index} ({meta.request_id}#{meta.layer}): {problem}"
                # cut in bytes: 256 refusals of any text fit one reply (MAX_CONTROL_BYTES)
                cut = why.encode()[:REFUSAL_CHARS].decode(errors="ignore")
                refused.append(Refusal(index, cut))
            self.recv.put_many(
                [
                    ((m.request_id, m.layer, m.first_head), m, raw, spill, keep)
                    for m, raw, spill, keep in kept
                ]
            )
        except Exception:
            for meta, _, spill, _ in kept:
                self.recv.unreserve(meta.nbytes, spill)
            raise
        answer(Reply(True, refused=refused))
        self.count("received_bytes", sum(meta.nbytes for meta, _, _, _ in kept))

    def _corrupt(self, meta: TensorMeta, tensor: torch.Tensor, layout: Layout) -> str | None:
        """Why P's kept copy no longer matches the digests P made of it, or None."""
        try:
            verify(meta, [physical(tensor, layout)], meta.request_id)
        except kvx.IntegrityError as exc:
            self.count("checksum_failures", 1)
            return str(exc)
        return None

    def _on_get(self, identity: bytes, get: Get, answer: Callable[..., None]) -> None:
        if get.num_heads < 1:
            why = f"{get.request_id}#{get.layer}: num_heads {get.num_heads}; at least 1 is asked"
            self._refused(why)
            answer(Reply(False, why))
            return
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
        subset = has_heads(layout) and asked != held
        if subset:
            problem = self._corrupt(item.meta, tensor, layout)
            if problem is not None:  # P's copy changed since it was digested
                answer(Reply(False, problem))
                return
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
        if subset and meta.digests:  # the heads sent are digested anew (P's copy checked)
            meta = with_digests(msgspec.structs.replace(meta, digests=[]), [wire])
        if self.store is not None:
            self.store.served(get.request_id, get.layer, get.readers)
        answer(Reply(True, meta=meta), self.plane.frames([wire]))
        self.plane.deliver(identity, [wire])
        self.count("served_bytes", wire.numel())
