"""The worker half: copies the blocks a step loads out of the SQLite file before the forward,
and the blocks it computed into the file after it (one row per block and rank, every layer's
bytes back to back)."""

from __future__ import annotations

import logging
import threading

import torch

import kvx
from kvx import ConnectorWorker, KVConnectorStats
from kvx_example_store.config import ExampleStoreConfig
from kvx_example_store.db import open_store
from kvx_example_store.metadata import BlockRun, ExampleStoreMetadata
from kvx_example_store.stats import ExampleStoreStats

logger = logging.getLogger(__name__)


class ExampleStoreWorker(ConnectorWorker[ExampleStoreMetadata]):
    def __init__(
        self, options: ExampleStoreConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext
    ) -> None:
        self.part = f"pp{ctx.parallel.pp_rank}_tp{ctx.parallel.tp_rank}"
        self.dim = kvx.get_layout(ctx.cache.layout, ctx.registry).blocks_dim
        self._caches: dict[str, torch.Tensor] = {}
        self._block_bytes = 0  # one block of every layer: the size of a row's data
        self._db = open_store(options.directory, options.busy_timeout_s)
        self._lock = threading.Lock()
        self._errors: set[int] = set()
        self.stats = ExampleStoreStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)
        self._block_bytes = sum(
            t.numel() * t.element_size() // t.shape[self.dim] for t in kv_caches.values()
        )

    def _block(self, cache: torch.Tensor, block_id: int) -> torch.Tensor:
        return cache.select(self.dim, block_id)

    def start_load_kv(self, metadata: ExampleStoreMetadata) -> None:
        """Every load of the step, before the forward reads the blocks. A block missing or
        of the wrong size is a load error (the engine recomputes or fails the request, as
        its `kv_load_failure_policy` says); so is every block of the run after it."""
        for load in metadata.loads:
            self._load(load)

    def _load(self, load: BlockRun) -> None:
        for i, (block_id, key) in enumerate(zip(load.block_ids, load.keys, strict=True)):
            with self._lock:
                row = self._db.execute(
                    "SELECT data FROM blocks WHERE key = ? AND part = ?", (key, self.part)
                ).fetchone()
            problem = "missing" if row is None else self._unpack(row[0], block_id)
            if problem is not None:
                logger.error(
                    "request %s: block %d of the store (%s) is %s",
                    load.req_id,
                    i,
                    key,
                    problem,
                )
                failed = load.block_ids[i:]
                self._errors.update(failed)
                what = "blocks_missing" if row is None else "blocks_unreadable"
                self.stats.count(what, len(failed))
                return
            self.stats.count("blocks_loaded")
            self.stats.count("bytes_loaded", self._block_bytes)

    def _unpack(self, data: bytes, block_id: int) -> str | None:
        """Copy one row into engine block `block_id` of every layer, or say why not."""
        if len(data) != self._block_bytes:
            return f"{len(data)} bytes, not {self._block_bytes}"
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset = 0
        for cache in self._caches.values():
            block = self._block(cache, block_id)
            size = block.numel() * block.element_size()
            chunk = raw[offset : offset + size].view(cache.dtype).view(block.shape)
            block.copy_(chunk)
            offset += size
        return None

    def wait_for_save(self, metadata: ExampleStoreMetadata) -> None:
        """Every block the forward completed, committed before the step ends: another engine
        asking for the prompt next finds it (P/D through the store relies on that)."""
        rows = []
        for store in metadata.stores:
            for block_id, key in zip(store.block_ids, store.keys, strict=True):
                parts = [
                    self._block(c, block_id).contiguous().view(torch.uint8).numpy().tobytes()
                    for c in self._caches.values()
                ]
                rows.append((key, self.part, b"".join(parts)))
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT OR IGNORE INTO blocks VALUES (?, ?, ?)", rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self.stats.count("blocks_saved", len(rows))
        self.stats.count("bytes_saved", len(rows) * self._block_bytes)

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_stats(self) -> KVConnectorStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        with self._lock:
            self._db.close()
