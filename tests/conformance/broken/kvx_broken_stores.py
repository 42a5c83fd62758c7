"""Deliberately broken store connectors: each wraps the built-in SharedStorageConnector and
breaks one rule, the way a store connector written from docs/writing-a-connector.md could
(tests/conformance/test_store_teeth.py). Real misbehaviour of a real connector, not mocks of
the suite."""

from __future__ import annotations

import sqlite3
import tempfile
import threading
from dataclasses import replace
from typing import Any

import torch

import kvx
from kvx.contract.planning import ScheduledRequest
from kvx.plugins.storage.connector import SharedStorageConnector
from kvx.plugins.storage.metadata import StorageMetadata, StoreSpec
from kvx.plugins.storage.scheduler import StorageScheduler

LEAKED: list[Any] = []  # what LeaksAtShutdown left open; the test closes it after the run


class NeverFinishesStore(SharedStorageConnector):
    """Holds every finished request's blocks (of every KV-cache group) for a save it never
    reports finished (unless a pure consumer, which saves nothing)."""

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        super().request_finished(request, block_ids)
        return self._kv_transfer_config.is_kv_producer, None

    def request_finished_all_groups(
        self, request: kvx.Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        super().request_finished_all_groups(request, block_ids)
        return self._kv_transfer_config.is_kv_producer, None


class _PlanBreaker(StorageScheduler):
    """The storage scheduler with a `bend` applied to each step's new loads."""

    def plan(self, meta: StorageMetadata, step: ScheduledRequest[Any]) -> None:
        loads = len(meta.loads)
        super().plan(meta, step)
        for i in range(loads, len(meta.loads)):
            meta.loads[i] = replace(meta.loads[i], block_ids=self.bend(meta.loads[i], step))

    def bend(self, load: Any, step: ScheduledRequest[Any]) -> list[int]:
        raise NotImplementedError


class ContiguousScheduler(_PlanBreaker):
    def bend(self, load: Any, step: ScheduledRequest[Any]) -> list[int]:
        first = load.block_ids[0]
        return list(range(first, first + len(load.block_ids)))


class IgnoresLocalHitScheduler(_PlanBreaker):
    def bend(self, load: Any, step: ScheduledRequest[Any]) -> list[int]:
        return step.block_ids[: len(load.block_ids)]


class FixedStagingScheduler(_PlanBreaker):
    """Stages at most 64 blocks per load; the rest keep whatever they held."""

    def bend(self, load: Any, step: ScheduledRequest[Any]) -> list[int]:
        ids = list(load.block_ids)
        return ids if len(ids) <= 64 else ids[:64] + [ids[63]] * (len(ids) - 64)


class SavesAfterFinishScheduler(StorageScheduler):
    """Queues a prompt's saves and issues them only after request_finished (the forward
    that computed the KV has long passed; whoever looks first finds nothing)."""

    def plan(self, meta: StorageMetadata, step: ScheduledRequest[Any]) -> None:
        if not hasattr(self, "late"):
            self.late: dict[str, list[StoreSpec]] = {}
            self.ready: list[StoreSpec] = []
        meta.stores += self.ready
        self.ready = []
        stores = len(meta.stores)
        super().plan(meta, step)
        self.late.setdefault(step.req_id, []).extend(meta.stores[stores:])
        del meta.stores[stores:]

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.ready += getattr(self, "late", {}).pop(request.request_id, [])
        return super().request_finished(request, block_ids)


def _with_scheduler(name: str, scheduler: type[StorageScheduler], doc: str) -> type:
    def build_scheduler(self: SharedStorageConnector) -> StorageScheduler:
        built = SharedStorageConnector.build_scheduler(self)
        built.__class__ = scheduler  # the same state, one method bent
        return built

    attrs = {"build_scheduler": build_scheduler, "__module__": __name__, "__doc__": doc}
    return type(name, (SharedStorageConnector,), attrs)


AssumesContiguousStore = _with_scheduler(
    "AssumesContiguousStore",
    ContiguousScheduler,
    "Loads into range(first, first + n), as if an engine's blocks were contiguous.",
)
IgnoresLocalHitStore = _with_scheduler(
    "IgnoresLocalHitStore",
    IgnoresLocalHitScheduler,
    "Loads into block_ids[:n], ignoring the engine's own prefix-cache hit before them.",
)
FixedStagingStore = _with_scheduler(
    "FixedStagingStore",
    FixedStagingScheduler,
    "Loads at most 64 blocks of a prompt (a fixed staging size) and reports all loaded.",
)
SavesAfterFinishStore = _with_scheduler(
    "SavesAfterFinishStore",
    SavesAfterFinishScheduler,
    "Saves a prompt's KV after request_finished instead of during the forward.",
)


class OffersEveryToken(SharedStorageConnector):
    """Offers a block-aligned prompt's last token too when its last block is stored."""

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        bs = self.engine_context.cache.block_size
        prompt = len(request.prompt_token_ids)
        if n and prompt % bs == 0 and num_computed_tokens + n == prompt - bs:
            return n + bs, load_async
        return n, load_async


class LeaksAtShutdown(SharedStorageConnector):
    """Opens an index database and a flusher thread it never closes nor stops."""

    def shutdown(self) -> None:
        super().shutdown()
        stop = threading.Event()
        LEAKED.append(stop)
        threading.Thread(target=stop.wait, name="store-flusher", daemon=True).start()
        index = tempfile.NamedTemporaryFile(suffix=".db", delete=False)  # noqa: SIM115
        index.close()
        db = sqlite3.connect(index.name, check_same_thread=False)
        db.execute("CREATE TABLE IF NOT EXISTS blocks (key TEXT)")
        LEAKED.append(db)


class NoBfloat16Store(SharedStorageConnector):
    """Keeps NumPy views of the KV caches for its IO: NumPy has no bfloat16."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.views = {name: cache.numpy() for name, cache in kv_caches.items()}
        super().register_kv_caches(kv_caches)


class ConvertsToHalfStore(SharedStorageConnector):
    """Round-trips the KV it loads through float16, whatever the cache's dtype."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.caches = dict(kv_caches)
        super().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._get_connector_metadata()
        if isinstance(meta, StorageMetadata) and meta.loads:
            for cache in self.caches.values():
                cache.copy_(cache.to(torch.float16).to(cache.dtype))


class KeepsLoadErrors(SharedStorageConnector):
    """Never clears the load errors it reported: once a load failed, every later step names
    those blocks again, though no load writes into them any more (vLLM would truncate the
    request that now computes them, again and again)."""

    _reported: frozenset[int] = frozenset()

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._reported |= super().get_block_ids_with_load_errors()
        return set(self._reported)
