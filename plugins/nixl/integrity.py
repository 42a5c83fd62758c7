"""Integrity on the wire for NIXL pull (`verify_transfers`): D checks that the bytes it read are
the bytes P computed, per block.

P's worker digests a request's blocks (`kvx.cache_block_digests`, XXH3-64 over every layer's
block bytes) when the hand-off reaches it, before it tells anyone it may free them; the digests
go to P's scheduler as worker metadata and its side channel serves them (`get_digests`, sealed
like the handshake). D fetches P's digests in the background from when it posts a request's
READs (P's `pending` answer is retried until `transfer_timeout_s`) and, once the READs are
done, digests the blocks that landed (one native call); a difference is a load error naming
the request and blocks, under `kv_load_failure_policy`, counted as a checksum failure. Checked
where D reads whole blocks of P ranks (same layout and block size, D's TP size at most P's, no
PP): with more P ranks, the head range of D's blocks each P rank filled is digested against
that rank's digests. A read of part of a P rank's heads (D's TP size above P's) is not checked:
P digested whole blocks.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import torch
import zmq

import kvx
from kvx.layouts import Layout
from kvx.plugins.nixl.handshake import (
    NONCE_BYTES,
    REPLY_DOMAIN,
    REPLY_OK,
    REPLY_REFUSED,
    REQUEST_DOMAIN,
    DigestRequest,
    HandshakeError,
    rank_bytes,
)
from kvx.wire import WireError, curve_client, decode_sealed, encode, seal

logger = logging.getLogger(__name__)
GET_DIGESTS = "get_digests"
PENDING = b"pending"
MAX_DIGEST_REQUESTS = 4096
"""Requests whose digests P's side channel keeps (oldest dropped first)."""
MAX_DIGESTS = 1 << 20
"""Block digests one reply may carry."""
RETRY_S = 0.02

DigestKey = tuple[str, int, int]  # (P's request id, pp_rank, tp_rank)


class DigestReply(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    request_id: Annotated[str, msgspec.Meta(max_length=512)]
    digests: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_DIGESTS)
    ]


@dataclass
class NixlWorkerMeta(kvx.KVConnectorWorkerMetadata):
    """P's workers to P's scheduler: the block digests of the requests handed off this step."""

    digests: dict[DigestKey, list[int]] = field(default_factory=dict)

    def aggregate(self, other: kvx.KVConnectorWorkerMetadata) -> kvx.KVConnectorWorkerMetadata:
        if not isinstance(other, NixlWorkerMeta):
            raise TypeError(f"cannot aggregate {type(other).__name__} into NixlWorkerMeta")
        self.digests.update(other.digests)
        return self


class DigestTable:
    """P's scheduler: the digests its side channel serves, bounded (FIFO), thread-safe."""

    def __init__(self, max_requests: int = MAX_DIGEST_REQUESTS) -> None:
        self._items: OrderedDict[DigestKey, list[int]] = OrderedDict()
        self._max = max_requests
        self._lock = threading.Lock()

    def put(self, digests: dict[DigestKey, list[int]]) -> None:
        with self._lock:
            self._items.update(digests)
            while len(self._items) > self._max:
                self._items.popitem(last=False)

    def answer(self, req: DigestRequest, secret: str | None) -> bytes:
        """The side channel's reply to a `get_digests` request (already authenticated)."""
        with self._lock:
            digests = self._items.get((req.request_id, req.pp_rank, req.tp_rank))
        if digests is None:
            return REPLY_REFUSED + PENDING
        body = encode(DigestReply(req.request_id, digests))
        return REPLY_OK + seal(
            secret, REPLY_DOMAIN, body, req.nonce, rank_bytes(req.pp_rank, req.tp_rank)
        )


def layer_tables(caches: dict[str, torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    """Each layer's cache as `[outer, blocks, bytes per block]` uint8 views (outer: its K and V
    regions, or 1 for a blocks-first layout): the regions NIXL registers, block by block."""
    tables = []
    for tensor in caches.values():
        phys = tensor.permute(layout.stride_order)
        at = layout.stride_order.index(layout.blocks_dim)
        outer = math.prod(phys.shape[:at])
        tables.append(phys.reshape(outer, phys.shape[at], -1).view(torch.uint8))
    return tables


@dataclass
class Held:
    """A finished read of D waiting for P's digests: per P rank read from, the digests of
    the part of D's blocks it filled, and P's digests being fetched."""

    job: Any  # posting.ReadJob
    parts: list[tuple[list[int], Future[list[int]]]]


Slice = tuple[int, int, int]
"""(P's TP rank, first head, heads): the heads of D's blocks one P rank's blocks filled."""


class Verifier:
    """D: fetches P's digests of each checkable read in the background from when its READs are
    posted, digests the blocks that landed once they are done, and holds the read until P's
    digests are in and compared. The digest runs in the caller's thread: in a background
    thread it would cost as much CPU, plus whatever the caller does while it waits."""

    def __init__(
        self,
        tables: list[torch.Tensor],
        parallel: kvx.ParallelInfo,
        secret: str | None,
        timeout_s: float,
        submit: Callable[..., Future[list[int]]],
    ) -> None:
        self.tables, self.parallel, self.secret = tables, parallel, secret
        self.timeout_s, self.submit = timeout_s, submit
        self.held: dict[str, Held] = {}
        self.fetching: dict[str, list[Future[list[int]]]] = {}  # P's, asked for at post
        self.context = zmq.Context()  # one for every fetch (a context per fetch costs ~40 ms)

    def slices(self, job: Any) -> list[Slice] | None:
        """Where D read whole blocks of P ranks (P digests its own blocks): same TP size, or
        more P ranks than D's, each P rank's heads landing whole in one head range of D's
        blocks (no PP on either side). None when the read is not checked (nothing read, D
        reads part of a P rank's heads, a staged read)."""
        remote, local = job.remote, self.parallel
        if job.spec.frees_only or not job.local_block_ids:
            return None
        if not remote.direct or job.spec.remote_pp_size != 1 or local.pp_size != 1:
            return None
        whole = [
            (r.remote_tp_rank, r.local_head_offset, r.num_heads)
            for r in remote.plan.reads
            if r.num_heads == len(remote.geometry.heads_of(r.remote_tp_rank))
        ]
        return whole if len(whole) == len(remote.plan.reads) else None

    def prefetch(self, job: Any) -> None:
        """Start fetching P's digests of `job` as its READs are posted, so that they are
        usually in by the time the READs end (nothing for a read that is not checked)."""
        slices = self.slices(job)
        if slices is not None:
            self.fetching[job.spec.request_id] = [self._fetch(job, rank) for rank, _, _ in slices]

    def drop(self, request_id: str) -> None:
        """Forget a read that failed before its check (its fetches, if any, are left to end)."""
        self.fetching.pop(request_id, None)

    def hold(self, job: Any) -> bool:
        """Digest the blocks `job` wrote and hold it until P's digests are in; False when it is
        not checked."""
        fetched = self.fetching.pop(job.spec.request_id, None)
        slices = self.slices(job)
        if slices is None:
            return False
        heads = len(job.remote.plan.local_heads)
        parts = []
        for i, (rank, first, count) in enumerate(slices):
            tables = self.tables
            if count != heads:  # the byte range of these heads in each of D's rows
                per_head = tables[0].shape[-1] // heads
                lo, hi = first * per_head, (first + count) * per_head
                tables = [t[:, :, lo:hi] for t in tables]
            local = kvx.cache_block_digests(tables, job.local_block_ids)
            parts.append((local, fetched[i] if fetched else self._fetch(job, rank)))
        self.held[job.spec.request_id] = Held(job, parts)
        return True

    def _fetch(self, job: Any, rank: int) -> Future[list[int]]:
        """P's digests of `job`'s request, from P's TP rank `rank`."""
        return self.submit(
            fetch_digests,
            job.spec.remote_host,
            job.spec.remote_port,
            (job.spec.remote_request_id, 0, rank),
            deadline=time.monotonic() + self.timeout_s,
            secret=self.secret,
            count=len(job.spec.remote_block_ids),
            context=self.context,
        )

    def close(self) -> None:
        """Drop the held reads and the sockets' context (the fetches were cancelled first)."""
        self.held.clear()
        self.fetching.clear()
        self.context.term()

    def finish(self, recved: set[str], errors: set[int], stats: Any) -> None:
        """Report the held reads whose check is over into `recved`; a mismatch (or P's digests
        not to be had) adds the request's blocks to `errors` (load errors) and is counted."""
        for req_id, held in list(self.held.items()):
            if not all(future.done() for _, future in held.parts):
                continue
            del self.held[req_id]
            job = held.job
            try:
                first = job.start_token // job.remote.geometry.block_size
                for local, future in held.parts:
                    theirs = future.result()[first : first + len(local)]
                    kvx.check_block_digests(
                        f"request {req_id} (P's {job.spec.remote_request_id})",
                        theirs,
                        local,
                        job.local_block_ids,
                    )
            except Exception as exc:  # a mismatch, or P's digests could not be had
                logger.error("request %s: %s; its blocks are load errors", req_id, exc)
                integrity = isinstance(exc, kvx.IntegrityError)
                stats.count("num_checksum_failures" if integrity else "num_failed_transfers")
                errors.update(job.local_block_ids)
            recved.add(req_id)


def fetch_digests(
    host: str,
    port: int,
    key: DigestKey,
    *,
    deadline: float,
    secret: str | None,
    count: int,
    context: zmq.Context,
) -> list[int]:
    """P's digests of `key`, from its side channel; retried while P answers `pending`.
    Raises `HandshakeError` past `deadline`, on a refusal or a bad reply, or when P sends
    another number of digests than `count` (an untrusted peer)."""
    request_id, pp_rank, tp_rank = key
    where = f"side channel tcp://{host}:{port} (digests of {request_id})"
    while True:
        nonce = os.urandom(NONCE_BYTES)
        body = encode(DigestRequest(GET_DIGESTS, pp_rank, tp_rank, nonce, time.time(), request_id))
        data = _ask(
            context, host, port, seal(secret, REQUEST_DOMAIN, body), deadline, secret, where
        )
        tag, rest = data[:1], data[1:]
        if tag == REPLY_REFUSED and rest == PENDING and time.monotonic() < deadline:
            time.sleep(RETRY_S)
            continue
        if tag != REPLY_OK:
            shown = rest[:200].decode("utf-8", "replace")
            raise HandshakeError(f"{where}: peer refused: {shown}")
        try:
            reply = decode_sealed(
                rest,
                DigestReply,
                secret,
                REPLY_DOMAIN,
                nonce,
                rank_bytes(pp_rank, tp_rank),
                max_bytes=16 + 9 * MAX_DIGESTS,
            )
        except WireError as exc:
            raise HandshakeError(f"{where}: {exc}") from None
        if reply.request_id != request_id or len(reply.digests) != count:
            raise HandshakeError(
                f"{where}: the reply names {reply.request_id!r} with {len(reply.digests)} "
                f"digests, not {count}"
            )
        return reply.digests


def _ask(
    context: zmq.Context,
    host: str,
    port: int,
    request: bytes,
    deadline: float,
    secret: str | None,
    where: str,
) -> bytes:
    timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
    socket = context.socket(zmq.REQ)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, 32 + 9 * MAX_DIGESTS + 64)
        socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
        socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        if secret is not None:
            curve_client(socket, secret)
        socket.connect(f"tcp://{host}:{port}")
        socket.send(request)
        return bytes(socket.recv())
    except zmq.Again:
        raise HandshakeError(f"{where}: no reply in time") from None
    except zmq.ZMQError as exc:
        raise HandshakeError(f"{where}: {exc}") from None
    finally:
        socket.close(linger=0)
