"""The side channel: P's scheduler serves each worker's handshake payload over ZMQ, D's
workers fetch them (matches vLLM's ROUTER/REQ exchange, with msgpack and size limits)."""

from __future__ import annotations

import logging
import os
import threading

import zmq

from kvx.plugins.nixl.handshake import (
    MAX_REQUEST_BYTES,
    HandshakeError,
    HandshakePayload,
    HandshakeRequest,
    rank_bytes,
    sign,
    verify,
)
from kvx.wire import WireError, decode, encode

logger = logging.getLogger(__name__)
GET_META = "get_meta_msg"
POLL_MS = 100


class SideChannelServer:
    """A ZMQ ROUTER on `host:port` (port 0: a free one) answering `get_meta_msg` requests
    from a thread; `close()` stops the thread and closes the socket."""

    def __init__(
        self,
        host: str,
        port: int,
        compat_hash: str,
        factors: dict[str, str],
        payloads: dict[tuple[int, int], bytes],
        secret: str | None,
    ) -> None:
        self._hash, self._factors, self._payloads = compat_hash, factors, payloads
        self._secret = secret
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        try:
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
            else:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise HandshakeError(f"cannot bind the side channel to {host}:{port}: {exc}") from None
        self.host, self.port = host, port
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"kvx-nixl-side-channel-{port}", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                logger.warning("side channel: ignoring a message of %d frames", len(frames))
                continue
            reply = self._answer(frames[2])
            self._socket.send_multipart([frames[0], b"", encode(reply)])

    def _answer(self, data: bytes) -> HandshakePayload:
        try:
            req = decode(data, HandshakeRequest, max_bytes=MAX_REQUEST_BYTES)
        except WireError as exc:
            return HandshakePayload(error=f"bad request: {exc}")
        if req.kind != GET_META:
            return HandshakePayload(error=f"unknown request {req.kind!r}")
        rank = rank_bytes(req.pp_rank, req.tp_rank)
        if not verify(self._secret, req.auth, b"request", req.nonce, rank):
            logger.warning("side channel: refused a request without the shared secret")
            return HandshakePayload(error="authentication failed: wrong or missing shared secret")
        payload = self._payloads.get((req.pp_rank, req.tp_rank))
        if payload is None:
            return HandshakePayload(
                error=f"no worker pp_rank={req.pp_rank} tp_rank={req.tp_rank}; "
                f"known: {sorted(self._payloads)}"
            )
        auth = sign(self._secret, b"reply", req.nonce, rank, self._hash.encode(), payload)
        return HandshakePayload(self._hash, self._factors, payload, auth)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()


def fetch_payload(
    host: str,
    port: int,
    pp_rank: int,
    tp_rank: int,
    *,
    timeout_s: float,
    max_bytes: int,
    secret: str | None,
) -> HandshakePayload:
    """Ask P's side channel for one worker's payload; check its size, shape and HMAC.

    Raises `HandshakeError` on timeout, an oversized or malformed reply, an error reply or a
    failed authentication. Only the envelope is decoded here (phase one).
    """
    nonce = os.urandom(16)
    rank = rank_bytes(pp_rank, tp_rank)
    request = HandshakeRequest(
        GET_META, pp_rank, tp_rank, nonce, sign(secret, b"request", nonce, rank)
    )
    where = f"side channel tcp://{host}:{port} (pp_rank={pp_rank}, tp_rank={tp_rank})"
    context = zmq.Context()
    socket = context.socket(zmq.REQ)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, 4 * max_bytes)
        socket.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
        socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        socket.connect(f"tcp://{host}:{port}")
        socket.send(encode(request))
        data = socket.recv()
    except zmq.Again:
        raise HandshakeError(f"{where}: no reply within {timeout_s:g}s") from None
    except zmq.ZMQError as exc:
        raise HandshakeError(f"{where}: {exc}") from None
    finally:
        socket.close(linger=0)
        context.term()
    try:
        reply = decode(data, HandshakePayload, max_bytes=max_bytes)
    except WireError as exc:
        raise HandshakeError(f"{where}: {exc}") from None
    if reply.error:
        raise HandshakeError(f"{where}: peer refused: {reply.error}")
    if not verify(
        secret,
        reply.auth,
        b"reply",
        nonce,
        rank,
        reply.compatibility_hash.encode(),
        reply.agent_metadata_bytes,
    ):
        raise HandshakeError(f"{where}: reply is not signed with the shared secret")
    return reply
