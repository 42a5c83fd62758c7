"""The side channel: P's scheduler serves each worker's handshake payload over ZMQ, D's
workers fetch them (matches vLLM's ROUTER/REQ exchange, with msgpack and size limits)."""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from kvx import ConfigError, ConfigProblem
from kvx.plugins.nixl.handshake import (
    MAX_REQUEST_BYTES,
    NONCE_BYTES,
    REPLY_DOMAIN,
    REPLY_OK,
    REPLY_REFUSED,
    REQUEST_DOMAIN,
    DigestRequest,
    HandshakeError,
    HandshakePayload,
    HandshakeRequest,
    rank_bytes,
)
from kvx.plugins.nixl.integrity import GET_DIGESTS, DigestTable
from kvx.wire import (
    ReplayGuard,
    WireError,
    curve_client,
    curve_server,
    decode_sealed,
    encode,
    recv_frames,
    seal,
)

logger = logging.getLogger(__name__)
GET_META = "get_meta_msg"
POLL_MS = 100
WARN_EVERY_S = 10.0
"""Refused requests are logged at most this often."""
REFUSAL_MAX = 512
"""Longest refusal text a reply carries (and D shows)."""
HANDSHAKE_HINT = (
    " (is P up, and does it have the same shared_secret, or none if D has none? A peer with "
    "another secret cannot complete the ZMQ handshake, which looks like no reply)"
)


class SideChannelServer:
    """A ZMQ ROUTER on `host:port` (port 0: a free one) answering `get_meta_msg` requests
    from a thread; `close()` stops the thread and closes the socket. Whatever a peer sends,
    the thread keeps serving: a bad request gets a refusal, a bad frame is dropped."""

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
        self._replays = ReplayGuard()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # with a secret, a peer without it fails the ZMQ handshake: libzmq queues nothing of
        # it; libzmq checks the size of a CURVE message's box (33 bytes more than its content)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES + (64 if secret else 0))
        self._auth = curve_server(self._socket, secret) if secret is not None else None
        try:
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
            else:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._socket.close()
            if self._auth is not None:
                self._auth.stop()
            self._context.term()
            where = "side_channel_port" if port else "side_channel_host"
            raise ConfigError(
                [
                    ConfigProblem(
                        f"kv_connector_extra_config.{where}",
                        f"cannot listen on {host}:{port}: {exc}",
                    )
                ]
            ) from None
        self.host, self.port = host, port
        self.digests = DigestTable()  # block digests of handed-off requests (verify_transfers)
        self.served = self.refused = 0
        self._quiet_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"kvx-nixl-side-channel-{port}", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(POLL_MS):
                    continue
                frames, count = recv_frames(self._socket, 3)
                if count != 3 or frames[1].bytes != b"":
                    self._dropped(f"a message of {count} frames (a REQ's three expected)")
                    continue
                answer = self._answer(frames[2].bytes)
                self._socket.send_multipart([frames[0].bytes, b"", answer])
            except zmq.ContextTerminated:
                return
            except Exception as exc:  # an untrusted peer must never stop the server
                self._dropped(f"{type(exc).__name__}: {exc}")

    def _dropped(self, why: str) -> None:
        """A message that gets no reply, logged at most every WARN_EVERY_S as refusals are."""
        self.refused += 1
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + WARN_EVERY_S
            logger.warning("side channel: dropped %s (%d refused so far)", why, self.refused)

    def _answer(self, data: bytes) -> bytes:
        """The reply to one request: `REPLY_OK` + the sealed payload, or `REPLY_REFUSED` +
        why (plain text; D shows it but trusts nothing in it)."""
        req: HandshakeRequest
        try:
            req = decode_sealed(
                data, HandshakeRequest, self._secret, REQUEST_DOMAIN, max_bytes=MAX_REQUEST_BYTES
            )
        except WireError as exc:
            try:  # verify_transfers: the one other request, with P's request id
                req = decode_sealed(
                    data, DigestRequest, self._secret, REQUEST_DOMAIN, max_bytes=MAX_REQUEST_BYTES
                )
            except WireError:
                return self._refuse(f"bad request: {exc}")
        if self._secret is not None:
            stale = self._replays.check(req.nonce, req.timestamp)
            if stale is not None:
                return self._refuse(stale)
        if isinstance(req, DigestRequest) and req.kind == GET_DIGESTS:
            return self.digests.answer(req, self._secret)
        if req.kind != GET_META:
            return self._refuse(f"unknown request {req.kind[:64]!r}")
        payload = self._payloads.get((req.pp_rank, req.tp_rank))
        if payload is None:
            return self._refuse(
                f"no worker pp_rank={req.pp_rank} tp_rank={req.tp_rank}; "
                f"known: {sorted(self._payloads)[:16]}"
            )
        body = encode(HandshakePayload(self._hash, self._factors, payload))
        self.served += 1
        rank = rank_bytes(req.pp_rank, req.tp_rank)
        return REPLY_OK + seal(self._secret, REPLY_DOMAIN, body, req.nonce, rank)

    def _refuse(self, why: str) -> bytes:
        self.refused += 1
        now = time.monotonic()
        if now >= self._quiet_until:  # a flood of garbage is not a flood of log lines
            self._quiet_until = now + WARN_EVERY_S
            logger.warning("side channel: refused a request (%d so far): %s", self.refused, why)
        return REPLY_REFUSED + why.encode("utf-8", "replace")[:REFUSAL_MAX]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()


def make_request(pp_rank: int, tp_rank: int, secret: str | None) -> tuple[bytes, bytes]:
    """A fresh sealed `get_meta_msg` request and its nonce."""
    nonce = os.urandom(NONCE_BYTES)
    body = encode(HandshakeRequest(GET_META, pp_rank, tp_rank, nonce, time.time()))
    return seal(secret, REQUEST_DOMAIN, body), nonce


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
    """Ask P's side channel for one worker's payload; check its size and (with a secret) its
    seal before decoding the envelope (phase one).

    Raises `HandshakeError` on timeout, an oversized, malformed or unauthenticated reply, or a
    refusal.
    """
    request, nonce = make_request(pp_rank, tp_rank, secret)
    where = f"side channel tcp://{host}:{port} (pp_rank={pp_rank}, tp_rank={tp_rank})"
    context = zmq.Context()
    socket = context.socket(zmq.REQ)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, max_bytes + 64)
        socket.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
        socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        if secret is not None:
            curve_client(socket, secret)
        socket.connect(f"tcp://{host}:{port}")
        socket.send(request)
        data = socket.recv()
    except zmq.Again:
        raise HandshakeError(f"{where}: no reply within {timeout_s:g}s{HANDSHAKE_HINT}") from None
    except zmq.ZMQError as exc:
        raise HandshakeError(f"{where}: {exc}") from None
    finally:
        socket.close(linger=0)
        context.term()
    return open_reply(
        data, nonce, pp_rank, tp_rank, where=where, max_bytes=max_bytes, secret=secret
    )


def open_reply(
    data: bytes,
    nonce: bytes,
    pp_rank: int,
    tp_rank: int,
    *,
    where: str,
    max_bytes: int,
    secret: str | None,
) -> HandshakePayload:
    """Check and decode one side-channel reply to the request with `nonce`."""
    if len(data) > max_bytes:
        raise HandshakeError(
            f"{where}: reply of {len(data)} bytes exceeds the limit of {max_bytes} bytes"
        )
    tag, body = data[:1], data[1:]
    if tag == REPLY_REFUSED:
        text = body[:REFUSAL_MAX].decode("utf-8", "replace")
        shown = "".join(c if c.isprintable() else "?" for c in text)
        raise HandshakeError(f"{where}: peer refused: {shown}")
    if tag != REPLY_OK:
        raise HandshakeError(f"{where}: malformed reply (it starts with {tag!r}, not {REPLY_OK!r})")
    try:
        return decode_sealed(
            body,
            HandshakePayload,
            secret,
            REPLY_DOMAIN,
            nonce,
            rank_bytes(pp_rank, tp_rank),
            max_bytes=max_bytes,
        )
    except WireError as exc:
        if str(exc).startswith("authentication failed"):
            raise HandshakeError(f"{where}: reply is not signed with the shared secret") from None
        raise HandshakeError(f"{where}: {exc}") from None
