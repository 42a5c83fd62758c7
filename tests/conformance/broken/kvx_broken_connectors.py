"""Deliberately broken connectors: each wraps a good connector (the example connector, or the
built-in shared-storage connector for store roles) and breaks one rule.

The conformance suite must fail each of them (tests/conformance/test_suite_has_teeth.py). The
faults are real misbehaviour of a real connector, not mocks of the suite.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import kvx
from kvx import (
    ConnectorScheduler,
    ConnectorWorker,
    KVConnectorMetadata,
    KVConnectorRole,
    RoleSplitConnector,
)
from kvx.plugins.storage.connector import SharedStorageConnector
from kvx_example_connector.connector import ExamplePDConnector
from kvx_example_connector.metadata import ExamplePDMetadata, LoadSpec, StoreSpec
from kvx_example_connector.worker import ExamplePDWorker, _read, _write_atomic

LEAKED_THREAD_STOPS: list[threading.Event] = []  # the test stops the leaked threads after it


class DropsBlockWorker(ExamplePDWorker):
    """Loads every block but the last one (whatever was there before stays)."""

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        last = torch.tensor(load.local_block_ids[-1:], dtype=torch.long)
        before = {name: cache.index_select(dim, last) for name, cache in self._caches.items()}
        super()._load(path, load, dim)
        for name, cache in self._caches.items():
            cache.index_copy_(dim, last, before[name])


class SwapsBlocksWorker(ExamplePDWorker):
    """Writes the first two loaded blocks into each other's place."""

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        local = list(load.local_block_ids)
        if len(local) > 1:
            local[0], local[1] = local[1], local[0]
        super()._load(path, replace(load, local_block_ids=local), dim)


class FinishesEarlyWorker(ExamplePDWorker):
    """Reports each load finished in the step it starts, and lands its data a step later: after
    the engine has already computed on the blocks. (Deterministic: a load that raced to the finish
    before the forward pass would let the fault go unseen on a slow machine.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._started: list[LoadSpec] = []  # reported finished at this step's get_finished
        self._late: list[LoadSpec] = []  # land at the next get_finished, after a forward pass

    def start_load_kv(self, metadata: ExamplePDMetadata) -> None:
        super().start_load_kv(replace(metadata, loads=[]))
        self._started.extend(metadata.loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for load in self._late:
            self._load(self._path(load.remote_engine_id, load.remote_request_id), load, self.dim)
        self._late, self._started = self._started, []
        sending, recving = super().get_finished(finished_req_ids)
        return sending, recving | {load.req_id for load in self._late}


class HidesLoadErrorsWorker(ExamplePDWorker):
    """Reports a failed load finished but never its blocks as load errors: the engine takes
    the blocks as loaded and computes on whatever they hold."""

    def take_load_errors(self) -> set[int]:
        super().take_load_errors()
        return set()


class NeverFreesWorker(ExamplePDWorker):
    """Holds a finished prompt's blocks and never reports them sent."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        _, recving = super().get_finished(finished_req_ids)
        return set(), recving


class NeverFinishesWorker(ExamplePDWorker):
    """Never reports a finished send or a finished receive: P holds its blocks and D waits
    for its loads forever."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        super().get_finished(finished_req_ids)
        return set(), set()


class WritesOtherHeadsWorker(ExamplePDWorker):
    """Loads the right blocks but puts each head's KV into the next head's place."""

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        super()._load(path, load, dim)
        index = torch.tensor(load.local_block_ids, dtype=torch.long)
        for cache in self._caches.values():
            blocks = cache.index_select(dim, index)
            cache.index_copy_(dim, index, blocks.roll(1, dims=-2))


class LeaksThreadWorker(ExamplePDWorker):
    """Starts a helper thread that outlives `shutdown()`."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        stop = threading.Event()
        LEAKED_THREAD_STOPS.append(stop)
        threading.Thread(target=stop.wait, name="leaked-by-connector", daemon=True).start()


class SavesAsConsumer(ExamplePDConnector):
    """Ignores its kv_role: offers every finished request's KV, also on a pure consumer (D)."""

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not (request.kv_transfer_params or {}).get("do_remote_decode"):
            request.kv_transfer_params = {
                **(request.kv_transfer_params or {}),
                "do_remote_decode": True,
            }
        return super().request_finished(request, block_ids)


class StoresAsConsumer(SharedStorageConnector):
    """Ignores its kv_role: a pure consumer stores the KV of its own requests."""

    def __init__(self, config: kvx.KVTransferConfig, role: KVConnectorRole, ctx: Any) -> None:
        super().__init__(config, role, ctx)
        if self._scheduler is not None:
            self._scheduler.store = True


class _Group0Tables(kvx.GroupScheduler):
    """Per-group scheduler halves, each handed group 0's block table."""

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        first = blocks.block_ids[0]
        hashed = blocks.num_hashed_blocks
        shared = kvx.KVCacheBlocks(
            tuple(list(first) for _ in blocks.block_ids),
            None if hashed is None else tuple(hashed[0] for _ in hashed),
        )
        super().update_state_after_alloc(request, shared, num_external_tokens)

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> kvx.GroupsMetadata:
        first = kvx.one_group_output(scheduler_output, 0)
        return kvx.GroupsMetadata(tuple(h.build_connector_meta(first) for h in self.halves))

    def request_finished_all_groups(
        self, request: kvx.Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return super().request_finished_all_groups(request, (block_ids[0],) * len(block_ids))


class SharesGroupTables(SharedStorageConnector):
    """Claims HMA but moves every KV-cache group's layers through group 0's block table (a
    connector that reads only `block_ids[0]`)."""

    def build_scheduler(self) -> ConnectorScheduler:
        return kvx.split_by_group(
            self.engine_context, self._scheduler_for, lambda halves, _: _Group0Tables(halves)
        )


class LoadsAsProducer(SharedStorageConnector):
    """Ignores its kv_role: a pure producer loads what is stored."""

    def __init__(self, config: kvx.KVTransferConfig, role: KVConnectorRole, ctx: Any) -> None:
        super().__init__(config, role, ctx)
        if self._scheduler is not None:
            self._scheduler.load = True


class ReportsUnheldSends(ExamplePDConnector):
    """Reports every request it received (D) as finished sending too, which it never held."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        return (sending or set()) | (recving or set()) or None, recving


class ReportsSendsTwice(ExamplePDConnector):
    """Reports each finished send again in the next step."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        again, self._reported = getattr(self, "_reported", set()), set(sending or ())
        return (sending or set()) | again or None, recving


class AssumesContiguousWorker(ExamplePDWorker):
    """Loads into the run of blocks starting at the first one, as if blocks were contiguous."""

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        first = load.local_block_ids[0]
        local = list(range(first, first + len(load.local_block_ids)))
        super()._load(path, replace(load, local_block_ids=local), dim)


class SavesLateWorker(ExamplePDWorker):
    """Reports a save finished as soon as it is queued, and reads the blocks when it flushes
    its queue, at the end of the next step."""

    _queued: list[StoreSpec]

    def start_load_kv(self, metadata: ExamplePDMetadata) -> None:
        saves, metadata.stores = metadata.stores, []
        super().start_load_kv(metadata)  # the loads
        self._flush, self._queued = getattr(self, "_queued", []), saves
        for save in saves:
            self._saving[save.req_id] = _done()

    def wait_for_save(self, metadata: ExamplePDMetadata) -> None:
        for save in self._flush:
            index = torch.tensor(save.block_ids, dtype=torch.long)
            snapshot = {n: t.index_select(self.dim, index) for n, t in self._caches.items()}
            path = self._path(self.engine_id, save.req_id)
            self._pool.submit(_write_atomic, path, snapshot)
        self._flush = []


class WritesNullBlockWorker(ExamplePDWorker):
    """Copies with advanced indexing, which takes a `kvx.NULL_BLOCK` entry (-1) for the cache's
    last block."""

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        deadline = time.monotonic() + self.load_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {self.load_timeout_s}s")
            time.sleep(0.01)
        local = load.local_block_ids
        for name, data in _read(path, self._caches, dim).items():
            picked = data.narrow(dim, data.shape[dim] - len(local), len(local))
            self._caches[name].movedim(dim, 0)[torch.tensor(local)] = picked.movedim(dim, 0)


class WritesNullBlock(ExamplePDConnector):
    """Loads into the request's whole block table, the entries outside a sliding window
    (`kvx.NULL_BLOCK`) included: a connector unaware of sliding windows."""

    worker_type = WritesNullBlockWorker

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        every = kvx.KVCacheBlocks(blocks.block_ids, tuple(0 for _ in blocks.block_ids))
        super().update_state_after_alloc(request, every, num_external_tokens)


class RoundsUpToBlocks(ExamplePDConnector):
    """Offers whole blocks: a prompt's missing tokens rounded up to the block size, past the
    prompt's end."""

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        size = self.scheduler.block_size
        return (-(-count // size) * size if count else count), load_async


class AsyncEvenForNothing(ExamplePDConnector):
    """Answers every request asynchronously, also when it has nothing to load: (0, True)."""

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return count, True


class FailsOnlyInFailed(ExamplePDConnector):
    """Reports every receive in failed_recving alone, not in finished_recving."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> kvx.KVTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        failed = results.finished_recving | results.failed_recving
        return kvx.KVTransferResults(results.finished_sending, set(), failed)


class ClaimsEverythingNeverFinishes(ExamplePDConnector):
    """Claims every capability, so every scenario runs, and holds every finished request's
    blocks (unless a pure consumer) for a send it never reports, as its workers never report
    a receive either. The false claims never matter: each scenario stalls at its first
    finished request or load, before any byte is compared."""

    capabilities = frozenset(kvx.Capability)
    worker_type = NeverFinishesWorker

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        _, params = super().request_finished(request, block_ids)
        return self._kv_transfer_config.is_kv_producer, params


class ClaimsMla(ExamplePDConnector):
    """The example connector claiming MLA: its workers copy whole blocks of whatever layout
    the cache has, the MLA latent included, so it must pass the `mla_*` P/D scenarios (the
    control for `SlicesLatent`)."""

    capabilities = ExamplePDConnector.capabilities | {kvx.Capability.MLA}


class SlicesLatentWorker(ExamplePDWorker):
    """Treats the MLA latent as if TP split it like KV heads: the rank loads only its 1/2 of
    each token's latent (rank 0 of 2: the first half), the rest of the block stays as it was.
    (The latent is whole on every rank; a connector must move all of it.)"""

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        index = torch.tensor(load.local_block_ids, dtype=torch.long)
        before = {name: cache.index_select(dim, index) for name, cache in self._caches.items()}
        super()._load(path, load, dim)
        for name, cache in self._caches.items():
            width = cache.shape[-1]
            kept = before[name].narrow(-1, width // 2, width - width // 2)
            loaded = cache.index_select(dim, index)
            loaded.narrow(-1, width // 2, width - width // 2).copy_(kept)
            cache.index_copy_(dim, index, loaded)


class SlicesLatent(ClaimsMla):
    __doc__ = SlicesLatentWorker.__doc__
    worker_type = SlicesLatentWorker


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


@dataclass
class UnsendableMetadata(KVConnectorMetadata):
    """Carries a live lock to the workers: it cannot cross a process boundary."""

    lock: Any = None


class SendsALock(ExamplePDConnector):
    """Puts an object no serialiser can send into its metadata."""

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> KVConnectorMetadata:
        super().build_connector_meta(scheduler_output)
        return UnsendableMetadata(threading.Lock())


class ClearsMetadata(ExamplePDConnector):
    """Empties the metadata it was given once it started its work. Harmless in a real engine,
    where every worker gets its own copy: it must pass."""

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExamplePDMetadata)
        meta.stores.clear()
        meta.loads.clear()


class DoesNothingScheduler(ConnectorScheduler):
    def __init__(self, options: Any, config: kvx.KVTransferConfig, ctx: kvx.EngineContext) -> None:
        self.block_size = ctx.cache.block_size

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class DoesNothingWorker(ConnectorWorker[KVConnectorMetadata]):
    def __init__(self, options: Any, config: kvx.KVTransferConfig, ctx: kvx.EngineContext) -> None:
        self.options = options

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None: ...


class DoesNothing(RoleSplitConnector[DoesNothingScheduler, DoesNothingWorker]):
    """The skeleton of docs/writing-a-connector.md: claims nothing, moves nothing."""


def _with_worker(worker: type[ExamplePDWorker]) -> type[ExamplePDConnector]:
    """The example connector with `worker` as its worker half, named like the worker without
    `Worker` (`DropsBlockWorker` -> `DropsBlock`)."""
    name = worker.__name__.removesuffix("Worker")
    attrs = {"worker_type": worker, "__module__": __name__, "__doc__": worker.__doc__}
    return type(name, (ExamplePDConnector,), attrs)


BROKEN_WORKERS = (
    DropsBlockWorker,
    SwapsBlocksWorker,
    FinishesEarlyWorker,
    HidesLoadErrorsWorker,
    NeverFreesWorker,
    NeverFinishesWorker,
    WritesOtherHeadsWorker,
    LeaksThreadWorker,
    AssumesContiguousWorker,
    SavesLateWorker,
)
# Each connector is a module attribute, as configs name it (kv_connector_module_path).
globals().update({c.__name__: c for c in map(_with_worker, BROKEN_WORKERS)})
