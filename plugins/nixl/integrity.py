"""Integrity on the wire for NIXL pull (`verify_transfers`): D checks that the bytes it read are
the bytes P computed, per block.

P's worker digests a request's blocks per head (`kvx.cache_block_digests` with `parts`, XXH3-64
over every layer's bytes of each head of a block) when the hand-off reaches it, before it
tells anyone it may free them; the digests go to P's scheduler as worker metadata and its side
channel serves them (`get_digests`, sealed like the handshake): D names the heads of that P
worker it holds (bounded, checked against what P digested) and P merges those heads' digests
into one per block (`kvx.merge_digests`), so the reply is one digest per block whatever the TP
sizes. D fetches P's digests in the background from when it posts a request's READs (P's
`pending` answer is retried until `transfer_timeout_s`) and, once the READs are done, digests
the head range of its blocks each P worker filled, merged the same way (one native call per P
worker); a difference is a load error naming the request and blocks, under
`kv_load_failure_policy`, counted as a checksum failure. Checked where D reads P's blocks as
they are (same layout and block size, no PP), at any TP sizes. Where a layout does not put a
block's heads first, P digests whole blocks and only reads of whole P blocks are checked.
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
from typing import Annotated, Any, NamedTuple

import msgspec
import torch
import zmq

import kvx
from kvx.layouts import Layout, get_layout
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
from kvx.plugins.nixl.regions import heads_outermost_in_block
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


class PartDigests(NamedTuple):
    """P's digests of a request's blocks, `parts` per block (block-major), each over
    `per_part` of the worker's heads."""

    per_part: int
    parts: int
    digests: list[int]

    def merged(self, first_head: int, num_heads: int) -> list[int] | None:
        """One digest per block of heads `first_head`.. (`num_heads` of them, in this worker's
        own head numbering); None when they are not whole parts of what was digested."""
        per, parts = self.per_part, self.parts
        if first_head % per or num_heads % per or first_head + num_heads > per * parts:
            return None
        return kvx.merge_digests(self.digests, parts, first_head // per, num_heads // per)


def heads_per_part(layout: str, heads: int) -> int:
    """How many of a worker's `heads` one part digest covers: one where each head of a block is
    one byte range of every row (any head range can then be checked), else all of them."""
    return 1 if heads_outermost_in_block(get_layout(layout)) else heads


def part_digests(
    tables: list[torch.Tensor], block_ids: list[int], layout: str, heads: int
) -> PartDigests:
    """P at hand-off: the digests of `block_ids`, one per part of the worker's `heads`."""
    per = heads_per_part(layout, heads)
    parts = heads // per
    return PartDigests(per, parts, kvx.cache_block_digests(tables, block_ids, parts))


def head_range_digests(
    tables: list[torch.Tensor], block_ids: list[int], heads: int, first: int, count: int, per: int
) -> list[int]:
    """D: one digest per block of its heads `first`..`first + count - 1` (of its `heads`), in
    parts of `per` heads merged: what P's `PartDigests.merged` gives for the same heads."""
    if count != heads:  # the byte range of these heads in each of D's rows
        per_head = tables[0].shape[-1] // heads
        tables = [t[:, :, first * per_head : (first + count) * per_head] for t in tables]
    return kvx.cache_block_digests(tables, block_ids, count // per, merge=True)


class DigestReply(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    request_id: Annotated[str, msgspec.Meta(max_length=512)]
    digests: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_DIGESTS)
    ]


@dataclass
class NixlWorkerMeta(kvx.KVConnectorWorkerMetadata):
    """P's workers to P's scheduler: the block digests of the requests handed off this step."""

    digests: dict[DigestKey, PartDigests] = field(default_factory=dict)

    def aggregate(self, other: kvx.KVConnectorWorkerMetadata) -> kvx.KVConnectorWorkerMetadata:
        if not isinstance(other, NixlWorkerMeta):
            raise TypeError(f"cannot aggregate {type(other).__name__} into NixlWorkerMeta")
        self.digests.update(other.digests)
        return self


class DigestTable:
    """P's scheduler: the digests its side channel serves, bounded (FIFO), thread-safe."""

    def __init__(self, max_requests: int = MAX_DIGEST_REQUESTS) -> None:
        self._items: OrderedDict[DigestKey, PartDigests] = OrderedDict()
        self._max = max_requests
        self._lock = threading.Lock()

    def put(self, digests: dict[DigestKey, PartDigests]) -> None:
        with self._lock:
            self._items.update(digests)
            while len(self._items) > self._max:
                self._items.popitem(last=False)

    def answer(self, req: DigestRequest, secret: str | None) -> bytes:
        """The side channel's reply to a `get_digests` request (already authenticated): the
        digests of the heads D named, merged per block; refused when they are not heads of
        that worker's, in whole parts of what it digested (an untrusted peer)."""
        with self._lock:
            entry = self._items.get((req.request_id, req.pp_rank, req.tp_rank))
        if entry is None:
            return REPLY_REFUSED + PENDING
        digests = entry.merged(req.first_head, req.num_heads)
        if digests is None:
            last = req.first_head + req.num_heads - 1
            return (
                REPLY_REFUSED
                + (
                    f"get_digests: heads {req.first_head}..{last} of worker tp{req.tp_rank}: it "
                    f"digested heads 0..{entry.per_part * entry.parts - 1} in parts of "
                    f"{entry.per_part}"
                ).encode()
            )
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


class Slice(NamedTuple):
    """The heads of D's blocks one P rank's blocks filled: `heads` heads from D's head `first`,
    from that rank's head `remote_first`, checked in parts of `per` heads."""

    rank: int
    first: int
    heads: int
    remote_first: int
    per: int


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
        """Where D read P's blocks as they are (no PP on either side), at any TP sizes: the
        head range of D's blocks each P rank filled. None when the read is not checked
        (nothing read, a staged read, or a head range P's digests cannot describe: part of
        a P rank's heads where the layout does not put a block's heads first)."""
        remote, local = job.remote, self.parallel
        if job.spec.frees_only or not job.local_block_ids:
            return None
        if not remote.direct or job.spec.remote_pp_size != 1 or local.pp_size != 1:
            return None
        slices = []
        for r in remote.plan.reads:
            per = heads_per_part(
                remote.geometry.layout, len(remote.geometry.heads_of(r.remote_tp_rank))
            )
            if r.remote_head_offset % per or r.num_heads % per:
                return None
            slices.append(
                Slice(r.remote_tp_rank, r.local_head_offset, r.num_heads, r.remote_head_offset, per)
            )
        return slices

    def prefetch(self, job: Any) -> None:
        """Start fetching P's digests of `job` as its READs are posted, so that they are
        usually in by the time the READs end (nothing for a read that is not checked)."""
        slices = self.slices(job)
        if slices is not None:
            self.fetching[job.spec.request_id] = [self._fetch(job, part) for part in slices]

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
        for i, part in enumerate(slices):
            local = head_range_digests(
                self.tables, job.local_block_ids, heads, part.first, part.heads, part.per
            )
            parts.append((local, fetched[i] if fetched else self._fetch(job, part)))
        self.held[job.spec.request_id] = Held(job, parts)
        return True

    def _fetch(self, job: Any, part: Slice) -> Future[list[int]]:
        """P's digests of `job`'s request, from P's TP rank of `part`, of its heads there."""
        return self.submit(
            fetch_digests,
            job.spec.remote_host,
            job.spec.remote_port,
            (job.spec.remote_request_id, 0, part.rank),
            (part.remote_first, part.heads),
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
    heads: tuple[int, int],
    *,
    deadline: float,
    secret: str | None,
    count: int,
    context: zmq.Context,
) -> list[int]:
    """P's digests of `key`, of that worker's `heads` (first, count) merged per block, from its
    side channel; retried while P answers `pending`.
    Raises `HandshakeError` past `deadline`, on a refusal or a bad reply, or when P sends
    another number of digests than `count` (an untrusted peer)."""
    request_id, pp_rank, tp_rank = key
    where = f"side channel tcp://{host}:{port} (digests of {request_id})"
    while True:
        nonce = os.urandom(NONCE_BYTES)
        body = encode(
            DigestRequest(GET_DIGESTS, pp_rank, tp_rank, nonce, time.time(), request_id, *heads)
        )
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
