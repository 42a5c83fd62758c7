"""NixlConnector's worker side: registers the KV cache with NIXL; on D, handshakes with P in
the background, READs P's blocks and notifies P; on P, counts D's notifications and expires
leases. Nothing blocks a step: transfers and notifications are polled (no progress thread).
D's handshakes live in `peers.py`, its READs in `reads.py`.

Matches vLLM's `NixlConnectorWorker` (`kv_connector/v1/nixl_connector.py`): region-major
descriptor ids, lists prepared once with `prep_xfer_dlist` and transfers made with
`make_prepped_xfer`, one READ per (remote rank, head slice), `finished_recving` with load errors
on any failure.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import torch

import kvx
from kvx.layouts import get_layout
from kvx.plugins.nixl.agent import make_agent
from kvx.plugins.nixl.config import (
    MIN_SECRET_LENGTH,
    SECRET_KEY,
    NixlConfig,
    check_groups_supported,
    side_channel_address,
    split_address,
)
from kvx.plugins.nixl.handshake import (
    Notification,
    Region,
    compatibility_factors,
    open_notification,
)
from kvx.plugins.nixl.integrity import (
    NixlWorkerMeta,
    PartDigests,
    Verifier,
    layer_tables,
    part_digests,
)
from kvx.plugins.nixl.leases import Leases
from kvx.plugins.nixl.metadata import NixlMetadata, RemoteRead
from kvx.plugins.nixl.peers import Peers
from kvx.plugins.nixl.posting import ReadPoster
from kvx.plugins.nixl.progress import IdleProgress
from kvx.plugins.nixl.push_side import PushSide
from kvx.plugins.nixl.reads import Reads
from kvx.plugins.nixl.registration import Registered, agent_payload, register_caches
from kvx.plugins.nixl.remote import LocalView, RemoteEngine
from kvx.plugins.nixl.stats import NixlKVConnectorStats
from kvx.topology import KVGeometry
from kvx.wire import WireError

logger = logging.getLogger(__name__)


class NixlWorker(kvx.ConnectorWorker[NixlMetadata]):
    def __init__(self, options: NixlConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext):
        self.options = options
        self.secret = kvx.resolve_secret(
            options.shared_secret, SECRET_KEY, min_length=MIN_SECRET_LENGTH
        )
        self.ctx = ctx
        self.engine_id = str(config.engine_id)
        p = ctx.parallel
        self.name = f"{self.engine_id}-pp{p.pp_rank}-tp{p.tp_rank}-{uuid.uuid4().hex[:8]}"
        self.agent: Any = make_agent(
            self.name, options.backends, options.num_threads, side_channel_address(options).host
        )
        cache = ctx.cache
        check_groups_supported(options, cache.num_groups)
        self.layout = get_layout("MLA" if cache.use_mla else cache.layout, ctx.registry)
        self.geometry = KVGeometry(
            p.tp_size, cache.num_kv_heads, cache.block_size, self.layout.name, cache.use_mla
        )
        self.heads = len(self.geometry.heads_of(p.tp_rank))
        self.stats = NixlKVConnectorStats()
        self._caches: dict[str, torch.Tensor] = {}
        self._regions: list[Region] = []
        self._registration: Any = None
        self._registered: Registered | None = None
        self._mem_type = "DRAM"
        self._device = 0
        self._poster: ReadPoster | None = None
        self._view: LocalView | None = None
        # D side
        self._reads = Reads(
            self.agent,
            self.layout,
            self.geometry.block_size,
            options.transfer_timeout_s,
            self.stats,
        )
        self._next_heartbeat = 0.0
        self._leases = Leases(options.kv_lease_duration, self.stats)  # P side
        self._producer = config.is_kv_producer
        self._consumer = config.is_kv_consumer
        self._push: PushSide | None = None  # push mode
        self._lock = threading.Lock()  # every agent call; shared with the progress thread
        self._progress: IdleProgress | None = None
        self._held_reported = False
        self._tables: list[torch.Tensor] = []  # verify_transfers: the caches block by block
        self._digests: dict[tuple[str, int, int], PartDigests] = {}  # P: to the scheduler
        self._verifier: Verifier | None = None  # D: reads waiting for P's digests
        self._peers = Peers(
            self.agent,
            self._lock,
            options,
            self.secret,
            self.stats,
            self._start_read,
            self._reads.fail,
        )

    # -- registration ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._registration is not None:
            raise RuntimeError("register_kv_caches was called twice")
        registered = register_caches(self.agent, kv_caches, self.layout, self.options.huge_pages)
        self._caches = dict(kv_caches)
        self._registered = registered
        self._regions = regions = registered.regions
        self._registration = registered.handle
        self._mem_type = registered.mem_type
        self._device = registered.device
        cache = self.ctx.cache
        p = self.ctx.parallel
        self._view = LocalView(
            self.engine_id,
            p.tp_rank,
            p.tp_size,
            p.pp_size,
            self.geometry,
            tuple(kv_caches),
            compatibility_factors(self.ctx, self.options.transfer_mode),
            cache.dtype,
            cache.head_size,
            num_blocks=regions[0].num_blocks,
        )
        self._poster = ReadPoster(
            self.agent,
            self._caches,
            regions,
            self.heads,
            cache.block_size,
            cache.head_size,
            self._device,
            self._mem_type,
            dict(zip(cache.layer_names, cache.layer_groups, strict=True))
            if cache.layer_groups
            else {},
        )
        if self.options.verify_transfers:
            self._tables = layer_tables(self._caches, self.layout)
            self._verifier = Verifier(
                self._tables, p, self.secret, self.options.transfer_timeout_s, self._peers.submit
            )
        if self.options.idle_progress and (self._producer or self.options.transfer_mode == "push"):
            self._progress = IdleProgress(self.agent, self._lock)
        if self.options.transfer_mode == "push":
            self._push = PushSide(
                self.agent,
                self.options,
                self.secret,
                self._poster,
                self._view,
                self._leases,
                self.stats,
                (self._producer, self._consumer),
                (self.engine_id, p.pp_rank, p.tp_rank, p.pp_size, p.tp_size),
                lambda spec: self._reads.recved.add(spec.request_id),
                self._reads.fail,
                self._tables if self.options.verify_transfers else None,
            )
        self._reads.bind(self._poster, self._caches, self._verifier)
        preconnect = [] if self._producer else self.options.preconnect
        self._peers.bind(self._view, [split_address(a) for a in preconnect])

    def get_handshake_metadata(self) -> kvx.AgentPayload:
        """This worker's encoded `AgentMetadata` (served by its scheduler's side channel)."""
        assert self._registered is not None, "register_kv_caches must run first"
        return agent_payload(self.engine_id, self.agent, self.ctx, self.layout, self._registered)

    def loads_at_bind(self) -> bool:
        """Start the step's READs when its metadata is bound (`start_reads_at_bind`): only
        for CPU memory, where the engine's block zeroing has finished by then (a GPU's may
        still be queued on its stream)."""
        return self.options.start_reads_at_bind and self._mem_type == "DRAM"

    # -- per step -------------------------------------------------------------------------

    def start_load_kv(self, meta: NixlMetadata) -> None:
        with self._lock:
            self._start_load_kv(meta)
            self._want_progress()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        with self._lock:
            finished = self._get_finished()
            self._want_progress()
            return finished

    def _want_progress(self) -> None:
        if self._progress is None:
            return
        if self._push is None:
            self._progress.set_wanted(self._leases.holding)
        else:
            holding, until = self._push.wants_progress()
            self._progress.set_wanted(self._leases.holding or holding, until)

    def take_stats(self) -> kvx.KVConnectorStats | None:
        """Stats since the last call, with P's held requests as gauges: reported while any is
        held and once more when none is (so a dashboard sees the hold end)."""
        held, oldest = self._leases.held(time.monotonic())
        if held or self._held_reported:
            self.stats.set_held(held, oldest)
        self._held_reported = held > 0
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def _start_load_kv(self, meta: NixlMetadata) -> None:
        now = time.monotonic()
        for req_id, lease in meta.reqs_to_send.items():
            self._leases.hold(req_id, lease, now)
        for req_id in meta.reqs_not_processed:
            self._leases.drop(req_id)
        p = self.ctx.parallel
        digests = {  # before any D is told it may read, or P writes; per head, for any D
            req_id: part_digests(self._tables, blocks, self.layout.name, self.heads)
            for req_id, blocks in meta.send_blocks.items()
        }
        if self._push is not None:  # push: they travel with P's answer to D
            self._push.hold(meta, digests)
        else:  # pull: P's side channel serves them
            for req_id, sums in digests.items():
                self._digests[(req_id, p.pp_rank, p.tp_rank)] = sums
        for spec in meta.reqs_to_recv:
            self._peers.enqueue(spec)
        self._peers.progress()
        self._reads.post()
        for beat in meta.heartbeats:
            key = (
                beat.remote_engine_id,
                beat.remote_host,
                beat.remote_port,
                beat.remote_tp_size,
                beat.remote_pp_size,
            )
            remote = self._peers.remotes.get(key)
            if remote is None:  # before the first handshake there is nobody to tell
                continue
            if self._push is not None:
                self._push.heartbeat(remote, beat.remote_request_ids)
            else:
                self._notify(remote, Notification("heartbeat", beat.remote_request_ids))
        self._send_done()

    def _get_finished(self) -> tuple[set[str], set[str]]:
        self._peers.progress()
        self._reads.post()
        self._reads.poll()
        if self._verifier is not None:  # D: the reads whose check against P's digests ended
            self._verifier.finish(self._reads.recved, self._reads.errors, self.stats)
        self._send_done()
        self._heartbeat()
        self._poll_notifications()
        sent = self._leases.take_finished()
        if self._push is not None:
            self._push.poll(time.monotonic())
            self._push.forget(sent)
        recved, self._reads.recved = self._reads.recved, set()
        return sent, recved

    def take_load_errors(self) -> set[int]:
        errors, self._reads.errors = self._reads.errors, set()
        return errors

    def take_worker_meta(self) -> NixlWorkerMeta | None:
        """P: the block digests made this step, for the scheduler's side channel to serve."""
        if not self._digests:
            return None
        digests, self._digests = self._digests, {}
        return NixlWorkerMeta(digests)

    def _start_read(self, spec: RemoteRead, remote: RemoteEngine) -> None:
        """D: P's engine is handshaken; READ the request's blocks (push mode: register them,
        P writes them)."""
        if self._push is not None:
            self._push.start(spec, remote, self.geometry.block_size)
        else:
            self._reads.start(spec, remote)

    # -- D: notifications -----------------------------------------------------------------

    def _notify(self, remote: RemoteEngine, note: Notification) -> None:
        for agent, message in remote.sealed(note, self.secret):
            try:
                self.agent.send_notif(agent, message)
            except Exception as exc:
                logger.warning("notifying %s failed: %s", agent, exc)
                self.stats.count("num_failed_notifications")

    def _send_done(self) -> None:
        """Tell each P whose reads ended in this call, in one notification per P worker for
        all its requests (one seal and one send instead of one per request)."""
        done, self._reads.done = self._reads.done, {}
        for remote, ids in done.values():
            self._notify(remote, Notification("done", ids))

    def _heartbeat(self) -> None:
        """While reads are in flight, tell P to keep the blocks (vLLM's lease heartbeats)."""
        now = time.monotonic()
        if not self._reads.reading or now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.options.kv_lease_duration / 6
        by_remote: dict[int, tuple[RemoteEngine, list[str]]] = {}
        for job in self._reads.reading.values():
            entry = by_remote.setdefault(id(job.remote), (job.remote, []))
            entry[1].append(job.spec.remote_request_id)
        for remote, ids in by_remote.values():
            self._notify(remote, Notification("heartbeat", ids))

    # -- P: notifications -------------------------------------------------------------------

    def _poll_notifications(self) -> None:
        now = time.monotonic()
        if self._progress is not None:
            notifs = self._progress.take_notifs()
        else:
            notifs = self.agent.get_new_notifs()
        for sender, messages in notifs.items():
            for message in messages:
                if self._push is not None:
                    self._push.on_message(message, str(sender), now)
                    continue
                try:
                    note = open_notification(self.secret, message)
                except WireError as exc:
                    logger.warning("ignoring a notification from %s: %s", sender, exc)
                    self.stats.count("num_refused_notifications")
                    continue
                self._leases.on_notification(note, now, str(sender))
        self._leases.expire(now)

    # -- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._peers.stop_preconnect()  # before the lock: its thread may wait for it
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._push is not None:
            self._push.shutdown()
            self._push = None
        self._peers.stop()
        if self._verifier is not None:
            self._verifier.close()
            self._verifier = None
        self._reads.shutdown()
        self._peers.release()
        if self._poster is not None:
            self._poster.release()
            self._poster = None
        if self._registration is not None:
            self.agent.deregister_memory(self._registration)
            self._registration = None
        self._caches.clear()
        self.agent = None
