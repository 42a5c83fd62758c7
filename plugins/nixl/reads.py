"""D's READs of P's blocks (split out of `worker.py`): each request's transfers made once its
engine is handshaken, posted back to back, polled to their end (done, failed or timed out),
staged blocks converted, and the handles released; the outcome is the requests received
(`recved`), their load errors (`errors`) and, per P worker, the reads to tell it are over
(`done`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvx.layouts import Layout
from kvx.plugins.nixl.integrity import Verifier
from kvx.plugins.nixl.metadata import RemoteRead
from kvx.plugins.nixl.posting import ReadJob, ReadPoster
from kvx.plugins.nixl.remote import RemoteEngine
from kvx.plugins.nixl.staging import convert_staged
from kvx.plugins.nixl.stats import NixlKVConnectorStats

logger = logging.getLogger(__name__)


class Reads:
    """One D worker's READs; `bind` gives it the registered cache before any `start`."""

    def __init__(
        self,
        agent: Any,
        layout: Layout,
        block_size: int,
        timeout_s: float,
        stats: NixlKVConnectorStats,
    ) -> None:
        self.reading: dict[str, ReadJob] = {}
        self.recved: set[str] = set()
        self.errors: set[int] = set()
        self.done: dict[int, tuple[RemoteEngine, list[str]]] = {}  # reads over, P not told yet
        self._unposted: list[ReadJob] = []  # made in this call, posted at its end
        self._leftovers: list[Any] = []  # handles NIXL refused to release (retried at shutdown)
        self._agent, self._layout, self._block_size = agent, layout, block_size
        self._timeout_s, self._stats = timeout_s, stats
        self._poster: ReadPoster | None = None
        self._caches: dict[str, torch.Tensor] = {}
        self._verifier: Verifier | None = None

    def bind(
        self, poster: ReadPoster, caches: dict[str, torch.Tensor], verifier: Verifier | None
    ) -> None:
        """The registered cache: its poster, tensors and (`verify_transfers`) verifier."""
        self._poster, self._caches, self._verifier = poster, caches, verifier

    def start(self, spec: RemoteRead, remote: RemoteEngine) -> None:
        """Make the request's READs (posted by `post`), or end it now if it reads nothing."""
        n = spec.remote_num_tokens
        bd = self._block_size
        needed = -(-n // bd)
        # per group, the blocks D lacks (the last of the prompt's: a sliding group's leading
        # NULL_BLOCKs, like a prefix hit, are not among them) and the first one's index
        tables = [list(local[:needed]) for local, _ in spec.tables()]
        firsts = [needed - len(local) for local in tables]
        local = [b for table in tables for b in table]
        job = ReadJob(spec, remote, local, min(firsts) * bd, time.monotonic())
        job.groups = list(zip(tables, firsts, strict=True))
        if not local:
            self._complete(job)
            return
        try:
            assert self._poster is not None, "register_kv_caches must run before loads"
            for (table, first), (_, theirs) in zip(job.groups, spec.tables(), strict=True):
                # P's blocks outside D's window are not read
                remote.check_block_ids(theirs[first : first + len(table)])
            if len(tables) > 1 and not remote.direct:
                raise ValueError(
                    "several KV-cache groups are read in place only (the same block size and "
                    f"layout on P and D); P has block size {remote.geometry.block_size}, "
                    f"layout {remote.geometry.layout}"
                )
            if remote.direct:
                self._poster.prepare_direct(job)
            else:
                self._poster.prepare_staged(job)
            self._unposted.append(job)
        except Exception as exc:  # a bad peer or a NIXL error: never crash the step
            self._not_started(job, exc)

    def post(self) -> None:
        """Post every READ made in this call, back to back (the copies run in the posts, and
        Python between them runs on evicted caches: see `posting.py`)."""
        jobs, self._unposted = self._unposted, []
        for job in jobs:
            job.started = time.monotonic()
            try:
                assert self._poster is not None
                self._poster.post(job)
                self.reading[job.spec.request_id] = job
                if self._verifier is not None:
                    self._verifier.prefetch(job)
            except Exception as exc:  # a NIXL error: never crash the step
                self._not_started(job, exc)

    def _not_started(self, job: ReadJob, exc: Exception) -> None:
        logger.error("request %s: could not start the read: %s", job.spec.request_id, exc)
        self._abandon(job)
        self._stats.count("num_failed_transfers")
        self.fail(job.spec, job.local_block_ids)

    def poll(self) -> None:
        """End the reads whose transfers are all done, or one failed, or that timed out."""
        now = time.monotonic()
        for req_id, job in list(self.reading.items()):
            states = [self._state(h) for h in job.handles]
            if all(s == "DONE" for s in states):
                del self.reading[req_id]
                self._complete(job)
            elif "ERR" in states or now - job.started > self._timeout_s:
                del self.reading[req_id]
                why = "a transfer failed" if "ERR" in states else "the read timed out"
                logger.error("request %s: %s; its blocks are load errors", req_id, why)
                self._stats.count("num_failed_transfers")
                self._abandon(job)
                self.fail(job.spec, job.local_block_ids)

    def _state(self, handle: Any) -> str:
        try:
            return str(self._agent.check_xfer_state(handle))
        except Exception as exc:  # NIXL raises when the peer is gone
            logger.warning("transfer state unavailable: %s", exc)
            return "ERR"

    def _complete(self, job: ReadJob) -> None:
        done = time.monotonic()
        try:
            if job.staging is not None:
                convert_staged(
                    job.staging,
                    job.remote,
                    self._caches,
                    self._layout,
                    job.local_block_ids,
                    job.spec.remote_num_tokens,
                    job.start_token,
                )
        except Exception as exc:
            logger.error(
                "request %s: converting the received blocks failed: %s", job.spec.request_id, exc
            )
            self._abandon(job)
            self.fail(job.spec, job.local_block_ids)
            return
        moved = bool(job.handles)
        self._release(job)
        if moved:
            self._stats.record_transfer(
                done - job.started, time.monotonic() - done, job.nbytes, job.ndescs
            )
        self.done.setdefault(id(job.remote), (job.remote, []))[1].append(job.spec.remote_request_id)
        if self._verifier is not None and self._verifier.hold(job):
            return  # reported once P's digests are checked (`Verifier.finish`)
        if not job.spec.frees_only:
            self.recved.add(job.spec.request_id)

    def fail(self, spec: RemoteRead, local_block_ids: list[int]) -> None:
        """The read is over without the KV: its blocks are load errors and the request is
        reported received, so the engine applies its failure policy (never for a free-only
        notice: the engine is not waiting on that request)."""
        if self._verifier is not None:
            self._verifier.drop(spec.request_id)
        if spec.frees_only:
            logger.warning("request %s: could not tell P to free its blocks", spec.request_id)
            return
        self.errors.update(local_block_ids)
        self.recved.add(spec.request_id)

    def _release(self, job: ReadJob) -> None:
        for handle in job.handles:
            self._agent.release_xfer_handle(handle)
        job.handles = []
        if job.staging is not None:
            for dlist in job.staging.dlists:
                self._agent.release_dlist_handle(dlist)
            self._agent.deregister_memory(job.staging.registration)
            job.staging = None

    def _abandon(self, job: ReadJob) -> None:
        """Release what a failed read holds; a handle NIXL cannot cancel (and the staging
        memory it may still write into) is kept and retried at shutdown."""
        try:
            self._release(job)
        except Exception as exc:
            logger.warning(
                "request %s: releasing its transfer failed (%s); retrying at shutdown",
                job.spec.request_id,
                exc,
            )
            self._leftovers.append(job)

    def shutdown(self) -> None:
        """Release every read's handles (in flight, unposted, or refused before) and drop the
        agent and cache (the worker frees them)."""
        for job in [*self.reading.values(), *self._unposted, *self._leftovers]:
            try:
                self._release(job)
            except Exception as exc:
                logger.warning("shutdown: a transfer could not be released: %s", exc)
        self.reading.clear()
        self._unposted.clear()
        self._leftovers.clear()
        self._agent, self._poster, self._verifier, self._caches = None, None, None, {}
