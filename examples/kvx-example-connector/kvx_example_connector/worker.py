"""The worker half: P's workers write a finished prompt's blocks to one file per rank; D's
workers wait for that file and copy its blocks into the paged cache, both on a background
thread."""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

import kvx
from kvx import ConnectorWorker, KVConnectorStats
from kvx_example_connector.config import ExamplePDConfig
from kvx_example_connector.metadata import ExamplePDMetadata, LoadSpec
from kvx_example_connector.stats import ExamplePDStats

logger = logging.getLogger(__name__)

MAGIC = b"KVXEX1\n"
MAX_HEADER = 1 << 16


class ExamplePDWorker(ConnectorWorker[ExamplePDMetadata]):
    def __init__(
        self, options: ExamplePDConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext
    ) -> None:
        self.root = Path(options.directory)
        self.load_timeout_s = options.load_timeout_s
        self.engine_id = str(config.engine_id)
        self.rank = f"pp{ctx.parallel.pp_rank}_tp{ctx.parallel.tp_rank}"
        cache = ctx.cache
        self.dim = kvx.get_layout("MLA" if cache.use_mla else cache.layout, ctx.registry).blocks_dim
        self._caches: dict[str, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvx-example")
        self._saving: dict[str, Future[None]] = {}
        self._save_blocks: dict[str, int] = {}  # how many blocks each save writes
        self._loading: dict[str, tuple[Future[None], list[int]]] = {}
        self._errors: set[int] = set()
        self._block_bytes = 0  # of one block, every layer: known once caches are registered
        self.stats = ExamplePDStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)
        self._block_bytes = sum(
            t.numel() * t.element_size() // t.shape[self.dim] for t in kv_caches.values()
        )

    def _path(self, engine_id: str, req_id: str) -> Path:
        return self.root / engine_id / req_id / f"{self.rank}.kv"

    def start_load_kv(self, metadata: ExamplePDMetadata) -> None:
        """Saves copy their blocks out now (P holds them until written); loads start."""
        for save in metadata.stores:
            index = torch.tensor(save.block_ids, dtype=torch.long)
            snapshot = {name: t.index_select(self.dim, index) for name, t in self._caches.items()}
            path = self._path(self.engine_id, save.req_id)
            self._saving[save.req_id] = self._pool.submit(_write_atomic, path, snapshot)
            self._save_blocks[save.req_id] = len(save.block_ids)
        for load in metadata.loads:
            path = self._path(load.remote_engine_id, load.remote_request_id)
            future = self._pool.submit(self._load, path, load, self.dim)
            self._loading[load.req_id] = (future, load.local_block_ids)

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        deadline = time.monotonic() + self.load_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {self.load_timeout_s}s")
            time.sleep(0.01)
        blocks = _read(path, self._caches, dim)
        index = torch.tensor(load.local_block_ids, dtype=torch.long)
        saved = len(load.remote_block_ids) - kvx.skipped_blocks(load.remote_block_ids)
        for name, data in blocks.items():
            if data.shape[dim] != saved or len(load.local_block_ids) > saved:
                raise ValueError(
                    f"{path}: {data.shape[dim]} blocks, expected {saved} (P's non-null "
                    f"blocks), at least the {len(load.local_block_ids)} to load"
                )
            picked = data.narrow(
                dim, data.shape[dim] - len(load.local_block_ids), len(load.local_block_ids)
            )
            self._caches[name].index_copy_(dim, index, picked)
        path.unlink(missing_ok=True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Files written (P frees those blocks) and files loaded, failed ones included: a
        failed load reports its blocks as load errors."""
        written = [rid for rid, future in self._saving.items() if future.done()]
        for rid in written:
            error = self._saving.pop(rid).exception()
            self._count("written", self._save_blocks.pop(rid, 0), error)
            if error is not None:  # D's load will time out and report the blocks as bad
                logger.error("writing KV of request %s failed: %s", rid, error)
        loaded = [rid for rid, (future, _) in self._loading.items() if future.done()]
        for rid in loaded:
            future, local = self._loading.pop(rid)
            error = future.exception()
            self._count("loaded", len(local), error)
            if error is not None:  # the engine only sees bad blocks: say why here
                logger.error("loading KV of request %s failed: %s", rid, error)
                self._errors.update(local)
        return set(written), set(loaded)

    def _count(self, done: str, blocks: int, error: BaseException | None) -> None:
        """One file `done` ("written" or "loaded") with `blocks` blocks, or failed."""
        if error is None:
            self.stats.count(f"files_{done}")
            self.stats.count(f"blocks_{done}", blocks)
            self.stats.count(f"bytes_{done}", blocks * self._block_bytes)
        else:
            self.stats.count("files_failed")
            why = "timeout" if isinstance(error, TimeoutError) else "transport"
            self.stats.count(f"failed_{why}")

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_stats(self) -> KVConnectorStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _write_atomic(path: Path, blocks: dict[str, torch.Tensor]) -> None:
    """One file: magic, a JSON header, then each layer's raw bytes; renamed into place. Not
    fsynced: the file hands KV between running engines (it is not storage that must outlive a
    crash), and D waits for it."""
    header = {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for name, t in blocks.items()
    }
    raw = json.dumps(header).encode()
    kvx.make_private_dirs(str(path.parent))
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(MAGIC + len(raw).to_bytes(4, "little") + raw)
        for t in blocks.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)


def _read(path: Path, caches: dict[str, torch.Tensor], dim: int) -> dict[str, torch.Tensor]:
    """Read and check a file written by `_write_atomic` against this worker's caches."""
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not an example-connector file")
    size = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    if size > MAX_HEADER:
        raise ValueError(f"{path}: header of {size} bytes is too large")
    offset = len(MAGIC) + 4
    header = json.loads(data[offset : offset + size])
    offset += size
    out = {}
    for name, cache in caches.items():
        entry = header.get(name)
        expected = list(cache.shape)
        if entry is None or entry["dtype"] != str(cache.dtype).removeprefix("torch."):
            raise ValueError(f"{path}: layer {name} missing or of another dtype")
        expected[dim] = entry["shape"][dim]
        if entry["shape"] != expected:
            raise ValueError(
                f"{path}: layer {name} has shape {entry['shape']}, expected {expected}"
            )
        nbytes = cache.element_size() * int(torch.Size(expected).numel())
        chunk = bytearray(data[offset : offset + nbytes])
        if len(chunk) != nbytes:
            raise ValueError(f"{path}: truncated")
        out[name] = torch.frombuffer(chunk, dtype=cache.dtype).view(expected)
        offset += nbytes
    return out
