"""P's side of push mode: D's workers register their blocks for a request P holds; P fetches
the registering worker's handshake payload from D's side channel (once per D worker, in a
background thread), WRITEs its part of the request's blocks (its heads, its layers) into D's
and answers `Pushed`. A WRITE that cannot be made, posted or completed is answered at once
with the reason, so D fails the request without waiting out a lease.

The heads P rank p writes to D rank d are those d would READ from p in pull mode
(`kvx.topology.plan_reads(D, P, d)`), so hetero TP works as in pull. Block size and layout
must be equal on both sides (what lands is D's block as is; pull mode converts instead).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvx.layouts import get_layout
from kvx.plugins.nixl.handshake import AgentMetadata, HandshakeError, Notification
from kvx.plugins.nixl.integrity import PartDigests
from kvx.plugins.nixl.leases import MAX_EARLY, Leases
from kvx.plugins.nixl.posting import ReadPoster, _ids
from kvx.plugins.nixl.push_wire import Pushed, Register, reason, send_push
from kvx.plugins.nixl.regions import heads_outermost_in_block
from kvx.plugins.nixl.remote import LocalView, fetch_checked
from kvx.plugins.nixl.stats import NixlKVConnectorStats
from kvx.topology import KVGeometry, TopologyError, plan_reads

logger = logging.getLogger(__name__)
TargetKey = tuple[str, str, int, int, int, int]
"""A D worker: engine id, side-channel host and port, pp_rank, tp_rank, tp_size."""


@dataclass
class Write:
    """One WRITE every request makes into one D worker, but its block ids."""

    local_dlist: Any
    remote_dlist: Any
    local_firsts: np.ndarray
    remote_firsts: np.ndarray
    block_bytes: int


@dataclass
class Target:
    """A D worker P has shaken hands with, and the WRITEs it gets (prepared once)."""

    meta: AgentMetadata
    agent: str
    writes: list[Write] | None = None
    dlists: list[Any] = field(default_factory=list)
    block_limit: int = 0
    heads: tuple[int, int] | None = None
    """The heads of this P rank written into D's blocks (first, count), when they are one
    range: what `verify_transfers` digests cover."""


@dataclass
class WriteJob:
    reg: Register
    sender: str
    target: Target
    started: float
    handles: list[Any] = field(default_factory=list)
    nbytes: int = 0
    ndescs: int = 0


def agent_name(name: str | bytes) -> str:
    """NIXL names an added agent in bytes and a notification's sender in str."""
    return name.decode() if isinstance(name, bytes) else name


class PushWriter:
    """Writes held requests' blocks into the D workers that register for them."""

    def __init__(
        self,
        agent: Any,
        poster: ReadPoster,
        view: LocalView,
        leases: Leases,
        stats: NixlKVConnectorStats,
        *,
        secret: str | None,
        handshake_timeout_s: float,
        transfer_timeout_s: float,
        max_handshake_bytes: int,
        enforce_compat: bool,
    ) -> None:
        self.agent = agent
        self.poster = poster
        self.view = view
        self.leases = leases
        self.stats = stats
        self.secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.max_handshake_bytes = max_handshake_bytes
        self.enforce_compat = enforce_compat
        self._blocks: dict[str, list[int]] = {}
        self._sums: dict[str, PartDigests] = {}  # verify_transfers: digests at hand-off
        self._pending: OrderedDict[tuple[str, str], tuple[Register, float]] = OrderedDict()
        self._fetching: dict[TargetKey, Future] = {}
        self._targets: dict[TargetKey, Target | str] = {}  # a target, or why there is none
        self._writing: list[WriteJob] = []
        self._pool: ThreadPoolExecutor | None = None
        self.last_sent = 0.0

    # -- inputs -----------------------------------------------------------------------------

    def hold(self, blocks: dict[str, list[int]], digests: dict[str, PartDigests]) -> None:
        """The prompt blocks of requests P's scheduler just handed off, and (with
        `verify_transfers`) their digests, taken before any WRITE."""
        self._blocks.update(blocks)
        self._sums.update(digests)

    def forget(self, req_ids: set[str]) -> None:
        """Requests P freed (written, released or expired)."""
        for req_id in req_ids:
            self._blocks.pop(req_id, None)
            self._sums.pop(req_id, None)

    def _digests_for(self, reg: Register, target: Target) -> list[int]:
        """The digests of the blocks written for `reg`, of the heads P wrote into D's blocks
        (merged per block), where they describe what landed: one head range of P's into D's
        worker, no PP on either side. Empty otherwise."""
        sums = self._sums.get(reg.request_id)
        if sums is None or target.heads is None or not reg.pp_size == self.view.pp_size == 1:
            return []
        lo, hi = sums.parts * reg.first_block, sums.parts * (reg.first_block + len(reg.block_ids))
        written = PartDigests(sums.per_part, sums.parts, sums.digests[lo:hi])  # block-major
        return written.merged(*target.heads) or []

    def on_register(self, reg: Register, sender: str, now: float) -> None:
        """Queue a registration and start the handshake with its D worker if it is new."""
        key = (reg.engine_id, reg.host, reg.port, reg.pp_rank, reg.tp_rank, reg.tp_size)
        if key not in self._targets and key not in self._fetching:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvx-nixl-push-handshake")
            self._fetching[key] = self._pool.submit(
                fetch_checked,
                self.view,
                reg.engine_id,
                reg.host,
                reg.port,
                reg.tp_size,
                (reg.pp_rank, reg.tp_rank),
                timeout_s=self.handshake_timeout_s,
                max_bytes=self.max_handshake_bytes,
                secret=self.secret,
                enforce_compat=self.enforce_compat,
            )
        self._pending[(reg.request_id, sender)] = (reg, now)
        # D wants the blocks now: a slow handshake with it must not run the lease out
        self.leases.on_notification(Notification("heartbeat", [reg.request_id]), now)
        if len(self._pending) > MAX_EARLY:
            self._pending.popitem(last=False)
            self.stats.count("num_unknown_notifications_dropped")

    # -- per poll ---------------------------------------------------------------------------

    def poll(self, now: float) -> None:
        self._progress_handshakes()
        self._start_writes(now)
        self._poll_writes(now)

    def _progress_handshakes(self) -> None:
        for key, future in list(self._fetching.items()):
            if not future.done():
                continue
            del self._fetching[key]
            try:
                meta = future.result()
                self._targets[key] = Target(
                    meta, agent_name(self.agent.add_remote_agent(meta.agent_metadata))
                )
            except Exception as exc:  # an untrusted peer: whatever went wrong, refuse it
                logger.error("push: handshake with D engine %s failed: %s", key[0], exc)
                self.stats.count("num_failed_handshakes")
                self._targets[key] = f"P could not shake hands with D: {exc}"

    def _start_writes(self, now: float) -> None:
        for (req_id, sender), (reg, seen) in list(self._pending.items()):
            key = (reg.engine_id, reg.host, reg.port, reg.pp_rank, reg.tp_rank, reg.tp_size)
            target = self._targets.get(key)
            if target is None:  # handshake under way: keep the blocks meanwhile
                self.leases.on_notification(Notification("heartbeat", [req_id]), now)
                continue
            if isinstance(target, str):
                del self._pending[(req_id, sender)]
                self._refuse(reg, sender, None, target)
                continue
            if target.agent != sender:
                del self._pending[(req_id, sender)]
                self._refuse(reg, sender, None, f"sender {sender!r} is not D worker {target.agent}")
                continue
            blocks = self._blocks.get(req_id)
            if blocks is None:
                if now - seen > self.leases.lease_s:
                    del self._pending[(req_id, sender)]
                    self._refuse(reg, sender, target, "P does not hold this request (expired?)")
                continue  # P's metadata holding it may come in a later step
            del self._pending[(req_id, sender)]
            job = WriteJob(reg, sender, target, time.monotonic())
            try:
                self._post(job, blocks)
            except Exception as exc:  # a bad registration or a NIXL error: answer, never crash
                logger.error("push: request %s: cannot write to D: %s", req_id, exc)
                self._abandon(job)
                self.stats.count("num_failed_transfers")
                self._finish(job, f"P could not post the WRITE: {exc}")
                continue
            self._writing.append(job)

    def _post(self, job: WriteJob, blocks: list[int]) -> None:
        reg, target = job.reg, job.target
        writes = target.writes if target.writes is not None else self._prepare(target)
        count = len(reg.block_ids)
        mine = blocks[reg.first_block : reg.first_block + count]
        if len(mine) != count:
            raise ValueError(
                f"D registered {count} blocks from block {reg.first_block} of a "
                f"{len(blocks)}-block prompt"
            )
        if max(reg.block_ids) >= target.block_limit:
            raise ValueError(f"block ids {reg.block_ids[:4]}... exceed D's {target.block_limit}")
        local_blocks = np.asarray(mine, dtype=np.int64)
        remote_blocks = np.asarray(reg.block_ids, dtype=np.int64)
        for w in writes:
            local_ids = _ids(w.local_firsts, local_blocks)
            handle = self.agent.make_prepped_xfer(
                "WRITE",
                w.local_dlist,
                local_ids,
                w.remote_dlist,
                _ids(w.remote_firsts, remote_blocks),
            )
            job.handles.append(handle)
            job.nbytes += count * w.block_bytes
            job.ndescs += len(local_ids)
        for handle in job.handles:
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError(f"NIXL refused to post a WRITE to {target.agent}")

    def _prepare(self, target: Target) -> list[Write]:
        """The WRITEs into D worker `target`: the heads it would READ from this rank, every
        layer both hold. Refuses what push cannot write as is (block size, layout)."""
        meta, mine = target.meta, self.view.geometry
        d = KVGeometry(meta.tp_size, meta.num_kv_heads, meta.block_size, meta.layout, meta.is_mla)
        if (d.block_size, d.layout) != (mine.block_size, mine.layout):
            raise HandshakeError(
                f"push mode writes blocks as they are: D has block_size {d.block_size} and "
                f"layout {d.layout}, P {mine.block_size} and {mine.layout} (use "
                'transfer_mode "pull", which converts, or the same on both)'
            )
        try:
            plan = plan_reads(d, mine, meta.tp_rank)
        except TopologyError as exc:
            raise HandshakeError(f"cannot write to D: {exc}") from None
        outermost = heads_outermost_in_block(get_layout(mine.layout))
        d_heads = len(d.heads_of(meta.tp_rank))
        writes = []
        for read in plan.reads:
            if read.remote_tp_rank != self.view.tp_rank:
                continue
            n = read.num_heads
            whole_here, whole_there = n == self.poster.heads, n == d_heads
            if not (outermost or (whole_here and whole_there)):
                raise HandshakeError(f"layout {mine.layout}: a head slice is not one byte range")
            lo, lnh = (0, 0) if whole_here else (read.remote_head_offset, n)
            ro, rnh = (0, 0) if whole_there else (read.local_head_offset, n)
            paired = self.poster._pair_regions(meta, n)
            if not paired:
                continue
            (regions,) = paired  # push mode moves one KV-cache group (`check_groups_supported`)
            remote_dlist = self.poster._make_remote_dlist(target.agent, meta, ro, rnh)
            target.dlists.append(remote_dlist)
            writes.append(
                Write(
                    self.poster._local_dlist(lo, lnh),
                    remote_dlist,
                    regions.local_firsts,
                    regions.remote_firsts,
                    regions.block_bytes,
                )
            )
        target.block_limit = min(r.num_blocks for r in meta.regions)
        heads = [w for w in plan.reads if w.remote_tp_rank == self.view.tp_rank]
        if len(heads) == 1:
            target.heads = (heads[0].remote_head_offset, heads[0].num_heads)
        target.writes = writes
        return writes

    def _poll_writes(self, now: float) -> None:
        for job in list(self._writing):
            states = [self._state(h) for h in job.handles]
            if all(s == "DONE" for s in states):
                self._writing.remove(job)
                self._release(job)
                self.stats.record_transfer(now - job.started, 0.0, job.nbytes, job.ndescs)
                self._finish(job, "", self._digests_for(job.reg, job.target))
            elif "ERR" in states or now - job.started > self.transfer_timeout_s:
                self._writing.remove(job)
                why = "a WRITE failed" if "ERR" in states else "the WRITE timed out"
                logger.error("push: request %s: %s", job.reg.request_id, why)
                self.stats.count("num_failed_transfers")
                self._abandon(job)
                self._finish(job, why)

    def _state(self, handle: Any) -> str:
        try:
            return str(self.agent.check_xfer_state(handle))
        except Exception as exc:  # NIXL raises when the peer is gone
            logger.warning("push: transfer state unavailable: %s", exc)
            return "ERR"

    # -- endings ----------------------------------------------------------------------------

    def _finish(self, job: WriteJob, error: str, digests: list[int] | None = None) -> None:
        """Answer D and count D's worker as done with P's blocks (written or not)."""
        answer = Pushed(job.reg.decode_request_id, reason(error), digests or [])
        self._answer(job.target.agent, answer)
        note = Notification("done", [job.reg.request_id], job.reg.count)
        self.leases.on_notification(note, time.monotonic(), job.sender)

    def _refuse(self, reg: Register, sender: str, target: Target | None, error: str) -> None:
        """A registration P cannot serve: tell D (when its agent is known) and count it done."""
        logger.error("push: request %s: %s", reg.request_id, error)
        if target is not None:
            self._answer(target.agent, Pushed(reg.decode_request_id, reason(error)))
        note = Notification("done", [reg.request_id], reg.count)
        self.leases.on_notification(note, time.monotonic(), sender)

    @property
    def busy(self) -> bool:
        """Whether WRITEs or D handshakes are in flight."""
        return bool(self._writing or self._fetching)

    def _answer(self, agent: str, message: Pushed) -> None:
        self.last_sent = time.monotonic()
        send_push(self.agent, agent, self.secret, message, self.stats)

    def _release(self, job: WriteJob) -> None:
        for handle in job.handles:
            self.agent.release_xfer_handle(handle)
        job.handles = []

    def _abandon(self, job: WriteJob) -> None:
        try:
            self._release(job)
        except Exception as exc:  # NIXL could not cancel it: dropped with the agent at exit
            logger.warning("push: releasing a failed WRITE failed: %s", exc)
            job.handles = []

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for job in self._writing:
            self._abandon(job)
        self._writing.clear()
        for target in self._targets.values():
            if isinstance(target, str):
                continue
            for dlist in target.dlists:
                self.agent.release_dlist_handle(dlist)
            try:
                self.agent.remove_remote_agent(target.agent)
            except Exception as exc:  # a dead peer
                logger.warning("push: removing agent %s failed: %s", target.agent, exc)
        self._targets.clear()
