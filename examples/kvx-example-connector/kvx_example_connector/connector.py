"""ExamplePDConnector: prefill/decode hand-off of whole KV blocks through a shared directory."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

import kvx
from kvx import Capability, KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvx.layouts import get_layout
from kvx.userdirs import make_private_dirs
from kvx_example_connector.config import ExamplePDConfig

logger = logging.getLogger(__name__)

MAGIC = b"KVXEX1\n"
MAX_HEADER = 1 << 16


@dataclass
class SaveSpec:
    req_id: str
    block_ids: list[int]


@dataclass
class LoadSpec:
    req_id: str
    local_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[int]


@dataclass
class ExamplePDMetadata(KVConnectorMetadata):
    """This step's work for the workers (plain fields: it may cross processes)."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


class ExamplePDConnector(KVConnectorBase_V1):
    """P holds a finished prompt's blocks until its workers wrote them to files; D loads the
    files asynchronously. Same TP, block size and layout on both sides."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.REMOTE_PREFILL, Capability.ASYNC_LOAD}
    )

    def __init__(
        self, config: kvx.KVTransferConfig, role: KVConnectorRole, ctx: kvx.EngineContext
    ) -> None:
        super().__init__(config, role, ctx)
        self.options = config.extra_config_as(ExamplePDConfig)
        self.root = Path(self.options.directory)
        # scheduler side
        self._saves: list[SaveSpec] = []
        self._loads: list[LoadSpec] = []
        # worker side
        self._caches: dict[str, torch.Tensor] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._saving: dict[str, Future[None]] = {}
        self._loading: dict[str, tuple[Future[None], list[int]]] = {}
        self._errors: set[int] = set()
        self._lock = threading.Lock()
        if role is KVConnectorRole.WORKER:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvx-example")

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        count = max(0, request.num_prompt_tokens - num_computed_tokens)
        return count, count > 0

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # load once, even if called again
        if num_external_tokens == 0:
            return
        self._loads.append(
            LoadSpec(
                request.request_id,
                blocks.get_unhashed_block_ids(),
                params["remote_engine_id"],
                params["remote_request_id"],
                list(params["remote_block_ids"]),
            )
        )

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> ExamplePDMetadata:
        meta = ExamplePDMetadata(self._saves, self._loads)
        self._saves, self._loads = [], []
        return meta

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or request.status not in (
            kvx.RequestStatus.FINISHED_LENGTH_CAPPED,
            kvx.RequestStatus.FINISHED_STOPPED,
        ):
            return False, None
        bs = self.engine_context.cache.block_size
        prompt_blocks = block_ids[: -(-request.num_prompt_tokens // bs)]
        self._saves.append(SaveSpec(request.request_id, prompt_blocks))
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.kv_transfer_config.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": prompt_blocks,
            "remote_num_tokens": request.num_prompt_tokens,
        }

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)

    def _path(self, engine_id: str, req_id: str) -> Path:
        p = self.engine_context.parallel
        return self.root / engine_id / req_id / f"pp{p.pp_rank}_tp{p.tp_rank}.kv"

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExamplePDMetadata) and self._pool is not None
        cache = self.engine_context.cache
        dim = get_layout("MLA" if cache.use_mla else cache.layout).blocks_dim
        for save in meta.saves:
            index = torch.tensor(save.block_ids, dtype=torch.long)
            snapshot = {name: t.index_select(dim, index) for name, t in self._caches.items()}
            path = self._path(str(self.kv_transfer_config.engine_id), save.req_id)
            self._saving[save.req_id] = self._pool.submit(_write_atomic, path, snapshot)
        for load in meta.loads:
            path = self._path(load.remote_engine_id, load.remote_request_id)
            future = self._pool.submit(self._load, path, load, dim)
            self._loading[load.req_id] = (future, load.local_block_ids)

    def _load(self, path: Path, load: LoadSpec, dim: int) -> None:
        deadline = time.monotonic() + self.options.load_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {self.options.load_timeout_s}s")
            time.sleep(0.01)
        blocks = _read(path, self._caches, dim)
        index = torch.tensor(load.local_block_ids, dtype=torch.long)
        for name, data in blocks.items():
            if data.shape[dim] != len(load.remote_block_ids):
                raise ValueError(
                    f"{path}: {data.shape[dim]} blocks, expected {len(load.remote_block_ids)}"
                )
            picked = data.narrow(
                dim, data.shape[dim] - len(load.local_block_ids), len(load.local_block_ids)
            )
            self._caches[name].index_copy_(dim, index, picked)
        path.unlink(missing_ok=True)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: the request is not computed until they finish."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: whole prompts are saved once they are finished."""

    def wait_for_save(self) -> None:
        """Saves copy their blocks out in `start_load_kv`; P holds the blocks until written."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = {rid for rid, f in self._saving.items() if f.done()}
        for rid in sending:
            error = self._saving.pop(rid).exception()
            if error is not None:  # D's load will time out and report the blocks as bad
                logger.error("writing KV of request %s failed: %s", rid, error)
        recving = set()
        for rid, (future, local) in list(self._loading.items()):
            if future.done():
                del self._loading[rid]
                recving.add(rid)
                if future.exception() is not None:
                    self._errors.update(local)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _write_atomic(path: Path, blocks: dict[str, torch.Tensor]) -> None:
    """One file: magic, a JSON header, then each layer's raw bytes; renamed into place."""
    header = {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for name, t in blocks.items()
    }
    raw = json.dumps(header).encode()
    make_private_dirs(str(path.parent))
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(MAGIC + len(raw).to_bytes(4, "little") + raw)
        for t in blocks.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
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
