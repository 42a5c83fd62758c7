"""P2pNcclConnector's worker side: one `P2pEngine` per worker.

P pushes each saved (request, layer) slice to D's workers (PUT: waits for D's acks; PUT_ASYNC:
does not, `wait_for_save` reads them, or on NCCL drains a background sender), on the CPU plane
straight from its blocks (the frames view the cache, which vLLM leaves alone until
`wait_for_save` returns), else as a copy cut out in `save_kv_layer`; or keeps a copy in its
send store (GET). D loads pushed KV from its receive buffer within `start_load_kv` (a
synchronous load, as in vLLM; each slice is written as soon as it is there) or pulls it from P
in the background (GET, asynchronous). Every failure ends in load errors for the request's
blocks, never a hang.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

import kvx
from kvx.layouts import get_layout
from kvx.plugins.p2p.addresses import format_address
from kvx.plugins.p2p.affinity import leave_compute_cores
from kvx.plugins.p2p.buffers import RecvBuffer, RecvKey, SendStore
from kvx.plugins.p2p.config import SECRET_KEY, P2pConfig
from kvx.plugins.p2p.engine import P2pEngine, TransferError
from kvx.plugins.p2p.integrity import verify, with_digests
from kvx.plugins.p2p.messages import Geometry, Get, TensorMeta
from kvx.plugins.p2p.metadata import LoadSpec, P2pMetadata, SaveSpec
from kvx.plugins.p2p.planes import choose_plane
from kvx.plugins.p2p.routes import (
    compatibility_problem,
    kv_geometry,
    readers,
    reads,
    sends,
    stage_of,
    worker_port,
)
from kvx.plugins.p2p.sender import AsyncSender
from kvx.plugins.p2p.stats import P2pKVConnectorStats
from kvx.plugins.p2p.tensors import (
    Segments,
    block_rows,
    block_segments,
    gather,
    has_heads,
    physical,
    scatter,
)
from kvx.topology import KVGeometry, TopologyError

logger = logging.getLogger(__name__)
Fetched = list[tuple[str, Any, TensorMeta, Segments, Any]]


class P2pWorker(kvx.ConnectorWorker[P2pMetadata]):
    def __init__(self, options: P2pConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext):
        self.options, self.config, self.ctx = options, config, ctx
        cache, p = ctx.cache, ctx.parallel
        self.layout = get_layout("MLA" if cache.use_mla else cache.layout, ctx.registry)
        self.geometry = Geometry(
            p.tp_size,
            p.pp_size,
            cache.num_kv_heads,
            cache.head_size,
            cache.block_size,
            self.layout.name,
            cache.dtype,
            cache.use_mla,
            cache.num_layers,
        )
        self.kv = kv_geometry(self.geometry)
        self.heads = self.kv.heads_of(p.tp_rank)
        self.layer_index = {name: i for i, name in enumerate(cache.layer_names)}
        self.port = worker_port(config.kv_port, p.pp_rank, p.tp_size, p.tp_rank)
        if config.kv_port == 0:
            self.port = 0  # every worker on an ephemeral port, advertised to D (GET only)
            if options.send_type != "GET" and config.is_kv_consumer:
                logger.warning(
                    "kv_port 0 with send_type %s: P pushes to kv_port + rank of D, which it "
                    "cannot know; set a kv_port on D",
                    options.send_type,
                )
        self.stats = P2pKVConnectorStats()
        self.engine: P2pEngine | None = None
        self.recv: RecvBuffer | None = None
        self.store: SendStore | None = None
        self._sender: AsyncSender | None = None
        self._unacked = False
        self._plans: dict[Geometry, tuple[str | None, tuple[Any, ...]]] = {}
        self._sent: list[TensorMeta] = []
        """PUTs `send_puts` sent this step, their acks read in `wait_for_save`."""
        self._pool: ThreadPoolExecutor | None = None
        self._caches: dict[str, torch.Tensor] = {}
        self._fetching: dict[str, tuple[LoadSpec, Future[Fetched]]] = {}
        self._recved: set[str] = set()
        self._errors: set[int] = set()
        self._failed_saves: set[str] = set()
        self._outgoing: dict[str, list[tuple[TensorMeta, Segments]]] = {}

    # -- set-up ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.engine is not None:
            raise RuntimeError("register_kv_caches was called twice")
        self._caches = dict(kv_caches)
        device = next(iter(kv_caches.values())).device
        options, config = self.options, self.config
        takes_puts = config.is_kv_consumer and options.send_type != "GET"
        serves_gets = config.is_kv_producer and options.send_type == "GET"
        budget = int(config.kv_buffer_size)
        if takes_puts:
            self.recv = RecvBuffer(
                budget, int(options.mem_pool_size_gb * (1 << 30)), options.buffer_ttl_s
            )
        if config.is_kv_producer:
            self.store = SendStore(budget, options.buffer_ttl_s)
        listen = (config.kv_ip, self.port) if takes_puts or serves_gets else None
        self.engine = P2pEngine(
            f"{config.engine_id}-pp{self.ctx.parallel.pp_rank}-tp{self.ctx.parallel.tp_rank}",
            listen,
            choose_plane(
                options.data_plane,
                device,
                options.nccl_num_channels,
                options.transfer_timeout_s,
            ),
            self.geometry,
            secret=kvx.resolve_secret(options.shared_secret, SECRET_KEY, min_length=8),
            timeout_s=options.transfer_timeout_s,
            max_tensor_bytes=options.max_tensor_bytes,
            recv=self.recv,
            store=self.store if serves_gets else None,
            count=self.stats.count,
        )
        # PUT_ASYNC: where the frames carry the bytes (CPU plane), save_kv_layer hands them to
        # ZMQ without waiting and wait_for_save reads the acks; NCCL delivers after each ack, so
        # a background sender does that.
        self._unacked = config.is_kv_producer and options.send_type == "PUT_ASYNC"
        if self._unacked and not self.engine.plane.sends_views:
            self._unacked = False
            self._sender = AsyncSender(self._put, f"kvx-p2p-send-{self.port}")

    def get_handshake_metadata(self) -> kvx.WorkerAddress:
        """The port this worker listens on (0: it does not listen), for the scheduler half to
        advertise when `kv_port` is 0."""
        address = self.engine.address if self.engine is not None else None
        return kvx.WorkerAddress(int(address.rsplit(":", 1)[1]) if address else 0)

    # -- P: saving ------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, metadata: P2pMetadata) -> None:
        rows = block_rows(kv_layer, self.layout) if metadata.saves else None
        for spec in metadata.saves:
            if spec.request_id in self._failed_saves:
                continue
            try:
                self._save(spec, layer_name, kv_layer, rows)
            except (TransferError, ValueError, kvx.ConfigError) as exc:
                logger.error("request %s: its KV was not sent: %s", spec.request_id, exc)
                self.stats.count("failed_transfers")
                self._failed_saves.add(spec.request_id)
        self._flush()

    def _meta(
        self, spec: SaveSpec, layer: str, first_head: int, num_heads: int, nbytes: int
    ) -> TensorMeta:
        skipped = kvx.skipped_blocks(spec.block_ids)
        return TensorMeta(
            spec.request_id,
            layer,
            self.ctx.parallel.tp_rank,
            first_head,
            num_heads,
            self.geometry.head_size,
            self.geometry.block_size,
            len(spec.block_ids) - skipped,
            spec.num_tokens,
            self.layout.name,
            self.geometry.dtype,
            nbytes,
            skipped,
        )

    def _save(
        self, spec: SaveSpec, layer: str, kv_layer: torch.Tensor, rows: torch.Tensor | None
    ) -> None:
        assert self.engine is not None, "register_kv_caches must run before saves"
        heads = has_heads(self.layout)
        # Leading null entries (outside a sliding window) hold no KV: only the rest is sent,
        # and the slice's meta says which request block it starts at.
        blocks = spec.block_ids[kvx.skipped_blocks(spec.block_ids) :]
        if spec.mode == "GET":
            assert self.store is not None
            local = range(len(self.heads)) if heads else None
            t = gather(kv_layer, self.layout, blocks, local, self.geometry.head_size)
            nbytes = t.numel() * t.element_size()
            meta = self._meta(spec, layer, self.heads.start, len(local or [0]), nbytes)
            if self.options.verify_transfers:
                meta = with_digests(meta, [physical(t, self.layout)])
            self.store.put(meta, t)
            return
        base = format_address(spec.decode_host, spec.decode_port)
        decode = self.engine.geometry_of(base)
        if decode not in self._plans:  # a few D geometries: their plans once, not per slice
            problem = compatibility_problem(self.geometry, decode)
            plan = () if problem else sends(kv_geometry(decode), self.kv, self.ctx.parallel.tp_rank)
            self._plans[decode] = (problem, plan)
        problem, plan = self._plans[decode]
        if problem is not None:
            raise ValueError(f"cannot send to {base}: {problem}")
        stage = stage_of(self.layer_index[layer], self.geometry.num_layers, decode.pp_size)
        for d, read in plan:
            local = range(read.remote_head_offset, read.remote_head_offset + read.num_heads)
            wire = self._wire(kv_layer, blocks, local if heads else None, rows)
            meta = self._meta(
                spec,
                layer,
                read.remote_heads.start if heads else 0,
                read.num_heads if heads else 1,
                sum(s.numel() for s in wire),
            )
            if self.options.verify_transfers:
                meta = with_digests(meta, wire)
            port = worker_port(spec.decode_port, stage, decode.tp_size, d)
            self._outgoing.setdefault(format_address(spec.decode_host, port), []).append(
                (meta, wire)
            )

    def _wire(
        self,
        kv_layer: torch.Tensor,
        block_ids: list[int],
        heads: range | None,
        rows: torch.Tensor | None,
    ) -> Segments:
        """The slice's bytes: views of the blocks when the plane sends views, else a copy
        (`rows`: the layer's `block_rows`, or None)."""
        assert self.engine is not None
        if self.engine.plane.sends_views and rows is not None:
            views = block_segments(kv_layer, self.layout, block_ids, heads, rows)
            if views is not None:
                return views
        t = gather(kv_layer, self.layout, block_ids, heads, self.geometry.head_size)
        return [physical(t, self.layout)]

    def _flush(self) -> None:
        """Send what this layer's saves queued, one pipelined batch per D worker."""
        batches, self._outgoing = self._outgoing, {}
        for address, items in batches.items():
            if self._unacked:
                assert self.engine is not None
                failed = self.engine.send_puts(address, items)
                self._account([], failed, None)
                bad = {id(m) for m, _ in failed}
                self._sent.extend(m for m, _ in items if id(m) not in bad)
            elif self._sender is not None:
                self._sender.submit(address, items)
            else:
                self._put(address, items)

    def _put(self, address: str, items: list[tuple[TensorMeta, Segments]]) -> None:
        assert self.engine is not None
        start = time.perf_counter()
        failed = self.engine.put_many(address, items)
        self._account(items, failed, time.perf_counter() - start)

    def _account(
        self,
        items: list[tuple[TensorMeta, Segments]],
        failed: list[tuple[TensorMeta, str]],
        seconds: float | None,
    ) -> None:
        """Log and count the PUTs that failed, count the others as landed."""
        for meta, why in failed:
            logger.error("request %s: PUT of %s failed: %s", meta.request_id, meta.layer, why)
        self.stats.count("failed_transfers", len(failed))
        landed = len(items) - len(failed)
        if landed:
            if seconds is not None:
                self.stats.record(seconds, "sent")
            self.stats.count("puts", landed)
            bad = {id(m) for m, _ in failed}
            self.stats.count("put_bytes", sum(m.nbytes for m, _ in items if id(m) not in bad))

    def wait_for_save(self, metadata: P2pMetadata) -> None:
        """Returns once no send reads this step's blocks any more (they may be reused): every
        ack of the CPU plane's unacked PUTs is read (each within its deadline; a dead peer's
        connection is dropped with its queued frames); on NCCL, queued sends left after
        `transfer_timeout_s` are dropped (D fails their requests) and the one in flight ends
        within its own deadline."""
        self._failed_saves.clear()
        if self._unacked and self.engine is not None:
            start = time.perf_counter()
            sent, self._sent = self._sent, []
            self._account([(meta, []) for meta in sent], self.engine.settle(), None)
            if sent:
                self.stats.record(time.perf_counter() - start, "sent")
        timeout = self.options.transfer_timeout_s
        if self._sender is not None and not self._sender.drain(timeout):
            dropped = self._sender.cancel()
            self.stats.count("failed_transfers", dropped)
            logger.error(
                "PUT_ASYNC: sends still queued after %.0fs; %d batches dropped", timeout, dropped
            )
            if not self._sender.drain(timeout + 1):
                logger.error("PUT_ASYNC: a send overran its own deadline")

    # -- D: loading -----------------------------------------------------------------------

    def start_load_kv(self, metadata: P2pMetadata) -> None:
        for request_id in metadata.discards:
            if self.recv is not None:
                self.recv.discard(request_id)
            if self.store is not None:
                self.store.discard(request_id)
        for spec in metadata.loads:
            if spec.mode == "GET":
                self._start_fetch(spec)
        self._load_pushed([spec for spec in metadata.loads if spec.mode != "GET"])

    def _prefill_geometry(self, spec: LoadSpec) -> KVGeometry:
        """P's geometry as D sees it: D's own, with P's parallel sizes."""
        return replace(self.kv, tp_size=spec.remote_tp_size, pp_size=spec.remote_pp_size)

    def _load_pushed(self, specs: list[LoadSpec]) -> None:
        """Wait for every pushed slice of `specs`, writing each into its blocks as soon as it
        is here (so D's copy overlaps the slices still on the wire)."""
        pending: dict[RecvKey, tuple[LoadSpec, str, Any]] = {}
        for spec in specs:
            if self.recv is None:
                self._fail(spec, "this worker takes no PUTs (configure send_type PUT or PUT_ASYNC)")
                continue
            try:
                plan = reads(self.kv, self._prefill_geometry(spec), self.ctx.parallel.tp_rank)
            except (TopologyError, ValueError) as exc:
                self._fail(spec, str(exc))
                continue
            heads = has_heads(self.layout)
            for layer in self._caches:
                for r in plan:
                    key = (spec.remote_request_id, layer, r.remote_heads.start if heads else 0)
                    pending[key] = (spec, layer, r)
        if self.recv is None or not pending:
            return
        deadline = time.monotonic() + self.options.transfer_timeout_s
        device = next(iter(self._caches.values())).device
        while pending:
            here, refused = self.recv.wait_any(list(pending), deadline)
            failed = {r: "the receive buffer refused its KV (out of memory)" for r in refused}
            if not here and not refused:
                for rid, _, _ in pending:
                    count = sum(k[0] == rid for k in pending)
                    failed.setdefault(rid, f"{count} KV slices never arrived (transfer timeout)")
            for key in here:
                if key[0] in failed:
                    continue
                spec, layer, read = pending.pop(key)
                try:
                    self._write(spec, [(layer, read, *self.recv.take(key, device), None)])
                except (KeyError, ValueError, RuntimeError) as exc:
                    failed[key[0]] = f"{type(exc).__name__}: {exc}"
            for rid, why in failed.items():
                for key in [k for k in pending if k[0] == rid]:
                    del pending[key]
                self.recv.discard(rid)
                for spec in specs:
                    if spec.remote_request_id == rid:
                        self._fail(spec, why)

    def _start_fetch(self, spec: LoadSpec) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=2, thread_name_prefix="kvx-p2p-get", initializer=leave_compute_cores
            )
        self._fetching[spec.request_id] = (spec, self._pool.submit(self._fetch, spec))

    def _fetch(self, spec: LoadSpec) -> Fetched:
        """Background: GET every slice this worker needs from P's workers."""
        assert self.engine is not None
        prefill = self._prefill_geometry(spec)
        plan = reads(self.kv, prefill, self.ctx.parallel.tp_rank)
        counts = readers(prefill, self.kv)
        deadline = time.monotonic() + self.options.transfer_timeout_s
        heads = has_heads(self.layout)
        got: Fetched = []
        for layer in self._caches:
            stage = stage_of(self.layer_index[layer], self.geometry.num_layers, prefill.pp_size)
            for r in plan:
                index = stage * prefill.tp_size + r.remote_tp_rank
                if spec.remote_ports:
                    port = spec.remote_ports[index]
                else:
                    port = worker_port(spec.prefill_port, stage, prefill.tp_size, r.remote_tp_rank)
                get = Get(
                    spec.remote_request_id,
                    layer,
                    r.remote_heads.start if heads else 0,
                    r.num_heads if heads else 1,
                    max(1, counts.get(r.remote_tp_rank, 1)),
                )
                start = time.perf_counter()
                meta, t, keep = self.engine.get(
                    format_address(spec.prefill_host, port), get, deadline
                )
                self.stats.record(time.perf_counter() - start, "received")
                self.stats.count("gets")
                self.stats.count("get_bytes", meta.nbytes)
                got.append((layer, r, meta, t, keep))
        return got

    def _write(self, spec: LoadSpec, got: Fetched) -> None:
        """Check each slice against what was asked and write it into the blocks."""
        heads = has_heads(self.layout)
        for layer, read, meta, segments, _ in got:
            if (meta.num_heads, meta.head_size, meta.dtype) != (
                read.num_heads if heads else 1,
                self.geometry.head_size,
                self.geometry.dtype,
            ):
                raise ValueError(
                    f"{layer}: the peer sent {meta.num_heads} heads of "
                    f"{meta.head_size} {meta.dtype}, which is not what was asked"
                )
            if self.options.verify_transfers:
                try:
                    verify(meta, segments, spec.request_id)
                except kvx.IntegrityError:
                    self.stats.count("checksum_failures")
                    raise
            dst = range(read.local_head_offset, read.local_head_offset + read.num_heads)
            scatter(
                segments,
                meta,
                self._caches[layer],
                self.layout,
                spec.block_ids,
                spec.start_token,
                spec.num_tokens,
                dst if heads else None,
            )

    def _fail(self, spec: LoadSpec, why: str) -> None:
        blocks = spec.block_ids
        shown = ", ".join(map(str, blocks[:8])) + (", ..." if len(blocks) > 8 else "")
        logger.error(
            "request %s (P's %s, tokens %d..%d, %d blocks [%s]): loading its KV failed: %s; "
            "its blocks are load errors",
            spec.request_id,
            spec.remote_request_id,
            spec.start_token,
            spec.start_token + spec.num_tokens,
            len(blocks),
            shown,
            why,
        )
        self.stats.count("failed_loads")
        self._errors.update(spec.block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for request_id, (spec, future) in list(self._fetching.items()):
            if not future.done():
                continue
            del self._fetching[request_id]
            try:
                self._write(spec, future.result())
            except Exception as exc:  # a dead or hostile peer: fail the request, go on
                self._fail(spec, f"{type(exc).__name__}: {exc}")
            self._recved.add(request_id)
        if self.recv is not None:
            self.recv.expire()
        recved, self._recved = self._recved, set()
        return set(), recved

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_stats(self) -> kvx.KVConnectorStats | None:
        if self.recv is not None and self.recv.spilled_count:
            self.stats.count("spilled", self.recv.spilled_count)
            self.recv.spilled_count = 0
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._fetching.clear()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self._caches.clear()
