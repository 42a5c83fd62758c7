"""D's side of push mode: after the handshake with P (the same as pull's), each D worker
registers the blocks a request needs with every P worker it would READ from (`Register`),
tells the P workers it reads nothing from to free (`Release`), then waits for every
registered worker's `Pushed`. The request is reported received when all wrote, and its blocks
are load errors at once when one answers with an error, or when the WRITEs do not arrive
within `transfer_timeout_s`. While it waits D sends heartbeats, as a pull read does, but
every `LIVENESS_S` at least: NIXL refuses a notification to a peer whose process is gone at
once (NIXL_ERR_REMOTE_DISCONNECT), so a dead P fails its requests within that, not at the
transfer timeout (D has no transfer of its own in flight that would fail instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kvx
from kvx.plugins.nixl.handshake import MAX_IDS_PER_NOTIFICATION
from kvx.plugins.nixl.integrity import head_range_digests, heads_per_part
from kvx.plugins.nixl.metadata import RemoteRead
from kvx.plugins.nixl.push_wire import (
    Heartbeat,
    Pushed,
    PushMessage,
    Register,
    Release,
    send_push,
)
from kvx.plugins.nixl.push_writer import agent_name
from kvx.plugins.nixl.remote import RankKey, RemoteEngine
from kvx.plugins.nixl.stats import NixlKVConnectorStats

logger = logging.getLogger(__name__)
LIVENESS_S = 0.5
"""Longest wait between two heartbeats to a P worker D waits on."""


@dataclass
class WaitJob:
    spec: RemoteRead
    remote: RemoteEngine
    local_block_ids: list[int]
    started: float
    waiting: set[str] = field(default_factory=set)
    """Agents of the P workers whose `Pushed` has not come yet."""


class PushReceiver:
    """Registers D's blocks with P and waits for P's WRITEs."""

    def __init__(
        self,
        agent: Any,
        identity: tuple[str, int, int, int, int],
        stats: NixlKVConnectorStats,
        *,
        secret: str | None,
        lease_s: float,
        transfer_timeout_s: float,
        complete: Callable[[RemoteRead], None],
        fail: Callable[[RemoteRead, list[int]], None],
        tables: list[Any] | None = None,
    ) -> None:
        """`tables` (`verify_transfers`): the cache block by block, digested once P wrote."""
        self.agent = agent
        self.tables = tables
        self.engine_id, self.pp_rank, self.tp_rank, self.pp_size, self.tp_size = identity
        self.stats = stats
        self.secret = secret
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s
        self._complete = complete
        self._fail = fail
        self.side_channel: tuple[str, int] | None = None
        self._waiting: dict[str, WaitJob] = {}
        self._next_heartbeat = 0.0
        self.last_sent = 0.0

    def start(self, spec: RemoteRead, remote: RemoteEngine, block_size: int) -> None:
        """Register `spec`'s blocks with P (the handshake with `remote` is done)."""
        needed = -(-spec.remote_num_tokens // block_size)
        local = list(spec.local_block_ids[:needed])
        registered: set[RankKey] = set()
        problem = self._problem(remote, block_size) if local else None
        if problem is not None:  # P is told to free below: nothing is registered with it
            logger.error("push: request %s: %s", spec.request_id, problem)
            self.stats.count("num_failed_transfers")
            self._fail(spec, local)
        elif local:
            assert self.side_channel is not None
            host, port = self.side_channel
            first = needed - len(local)
            stages = sorted({stage for stage, _ in remote.metas})
            registered = {(s, p) for p in remote.plan.remote_ranks for s in stages}
            job = WaitJob(spec, remote, local, time.monotonic())
            self._waiting[spec.request_id] = job
            for key in sorted(registered):
                message = Register(
                    spec.remote_request_id,
                    spec.request_id,
                    local,
                    first,
                    self.engine_id,
                    host,
                    port,
                    self.pp_rank,
                    self.tp_rank,
                    self.pp_size,
                    self.tp_size,
                    remote.notify.get(key, 1),
                )
                job.waiting.add(agent_name(remote.agents[key]))
                if not self._send(remote.agents[key], message):
                    self._drop(job)
                    return
        for key, count in remote.notify.items():
            if key not in registered:
                self._send(remote.agents[key], Release([spec.remote_request_id], count))
        if not local and not spec.frees_only:
            self._complete(spec)

    def _problem(self, remote: RemoteEngine, block_size: int) -> str | None:
        """Why D cannot register with `remote` (None: it can)."""
        if self.side_channel is None:
            return "D serves no side channel for P to fetch its blocks from"
        if remote.geometry.block_size != block_size:
            return (
                f"P's block size {remote.geometry.block_size} differs from D's {block_size} "
                '(push writes blocks as they are; use transfer_mode "pull", which converts)'
            )
        return None

    def on_pushed(self, message: Pushed, sender: str) -> None:
        job = self._waiting.get(message.decode_request_id)
        if job is None or sender not in job.waiting:
            logger.warning("push: ignoring a Pushed from %s for %s", sender, "an unknown request")
            self.stats.count("num_refused_notifications")
            return
        if message.error:
            logger.error(
                "push: request %s: P could not write its blocks (%s); they are load errors",
                job.spec.request_id,
                message.error,
            )
            # TODO: with several P workers (hetero TP, PP), the others may still be writing
            # into these blocks after the engine frees them; tell them to cancel and wait for
            # their answers (bounded) before reporting.
            self.stats.count("num_failed_transfers")
            del self._waiting[job.spec.request_id]
            self._fail(job.spec, job.local_block_ids)
            return
        job.waiting.discard(sender)
        problem = self._check(job, sender, message.digests)
        if problem is not None:
            logger.error("push: request %s: %s; its blocks are load errors", *problem[:2])
            self.stats.count(problem[2])
            del self._waiting[job.spec.request_id]
            self._fail(job.spec, job.local_block_ids)
            return
        if not job.waiting:
            del self._waiting[job.spec.request_id]
            self._complete(job.spec)

    def _check(self, job: WaitJob, sender: str, digests: list[int]) -> tuple[str, str, str] | None:
        """With `verify_transfers`, where P worker `sender` wrote one head range of its blocks
        into one of D's (any TP sizes, no PP): compare its digests with that range of the
        blocks that landed. None when they agree or the write is not checked; else
        (request, reason, the counter to bump)."""
        spec, remote = job.spec, job.remote
        if self.tables is None or self.pp_size != 1 or spec.remote_pp_size != 1:
            return None
        ranks = [key[1] for key, name in remote.agents.items() if agent_name(name) == sender]
        reads = [r for r in remote.plan.reads if ranks and r.remote_tp_rank == ranks[0]]
        if len(reads) != 1:
            return None
        read = reads[0]
        per = heads_per_part(remote.geometry.layout, len(remote.geometry.heads_of(ranks[0])))
        if read.remote_head_offset % per or read.num_heads % per:
            return None  # P digested whole blocks (see `heads_per_part`)
        if not digests:
            why = "P sent no block digests (set verify_transfers on P too)"
            return spec.request_id, why, "num_failed_transfers"
        landed = head_range_digests(
            self.tables,
            job.local_block_ids,
            len(remote.plan.local_heads),
            read.local_head_offset,
            read.num_heads,
            per,
        )
        what = f"request {spec.request_id} (P's {spec.remote_request_id})"
        try:
            kvx.check_block_digests(what, digests, landed, job.local_block_ids)
        except kvx.IntegrityError as exc:
            return spec.request_id, str(exc), "num_checksum_failures"
        return None

    def poll(self, now: float) -> None:
        """Fail registrations P did not answer in time, or whose P is gone; send heartbeats
        while waiting."""
        for req_id, job in list(self._waiting.items()):
            if now - job.started > self.transfer_timeout_s:
                logger.error("push: request %s: P's WRITEs did not come in time", req_id)
                self._drop(job)
        if not self._waiting or now < self._next_heartbeat:
            return
        self._next_heartbeat = now + min(self.lease_s / 6, LIVENESS_S)
        by_remote: dict[int, tuple[RemoteEngine, list[str]]] = {}
        for job in self._waiting.values():
            by_remote.setdefault(id(job.remote), (job.remote, []))[1].append(
                job.spec.remote_request_id
            )
        for remote, ids in by_remote.values():
            gone = self.heartbeat(remote, ids)
            for job in list(self._waiting.values()):
                if job.waiting & gone:
                    logger.error("push: request %s: P is unreachable", job.spec.request_id)
                    self._drop(job)

    def heartbeat(self, remote: RemoteEngine, request_ids: list[str]) -> set[str]:
        """Tell every worker of `remote` to keep `request_ids`; the agents that could not be
        told (their process is gone)."""
        gone = set()
        for key in remote.notify:
            for i in range(0, len(request_ids), MAX_IDS_PER_NOTIFICATION):
                piece = request_ids[i : i + MAX_IDS_PER_NOTIFICATION]
                if not self._send(remote.agents[key], Heartbeat(piece)):
                    gone.add(agent_name(remote.agents[key]))
        return gone

    def _drop(self, job: WaitJob) -> None:
        """End a waiting request without its KV: its blocks are load errors."""
        self.stats.count("num_failed_transfers")
        del self._waiting[job.spec.request_id]
        self._fail(job.spec, job.local_block_ids)

    def _send(self, agent: str, message: PushMessage) -> bool:
        self.last_sent = time.monotonic()
        return send_push(self.agent, agent, self.secret, message, self.stats)

    @property
    def busy(self) -> bool:
        """Whether a request waits for P's WRITEs."""
        return bool(self._waiting)
