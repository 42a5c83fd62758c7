"""Worker side: load stored blocks into the paged KV cache, and save computed ones.

A stored value is every layer of this worker's PP stage for one block and head shard, in the
writer's own per-block element order (`blockformat.py`). When the engine's blocks are CPU
memory and the stored block size is the engine's ("direct" IO), nothing is copied in Python:
a value is written from, and read into, the cache's own bytes (one buffer per layer and K/V
region of the block), with the backend's vectored IO (`direct.py`). Otherwise values go
through pooled buffers (`buffers.py`, `values.py`, `scatter.py`): `save_kv_layer` gathers
the layer's blocks into per-block value buffers and loads scatter them back, both with
`kvx.layouts.convert_blocks`, which converts between the engine's layout / block size / TP
shard and the stored form.

Saves (planned without IO: `save_plan.py`): after the stage's last `save_kv_layer` the IO
threads checksum and write the step's values, a group of blocks per backend round trip, while
the forward pass goes on; `wait_for_save` returns when they are durable, so no write reads an
engine block after the step. Loads are synchronous (all in `start_load_kv`): the IO threads
read groups of values and check them a few groups ahead (a lone group is read on this thread;
with one IO thread, direct reads are one group), while this thread scatters the groups that
need converting; which values a load reads and where they land is planned without IO
(`load_plan.py`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import kvx
from kvx import ConnectorWorker, StorageBackend
from kvx.layouts import convert_blocks, get_layout
from kvx.plugins.storage.blockformat import (
    KV_ORDER,
    BlockShape,
    block_order,
    seal,
)
from kvx.plugins.storage.buffers import Budget, BufferPool, row_views
from kvx.plugins.storage.direct import (
    CacheBlocks,
    DirectIO,
    Fetched,
    splits_by_tokens,
)
from kvx.plugins.storage.keys import Geometry, Stage, block_key_of, medium_of
from kvx.plugins.storage.load_plan import (
    Load,
    Unit,
    failed_blocks,
    plan_units,
    targets,
    unit_key,
    valid_tokens,
)
from kvx.plugins.storage.metadata import StorageMetadata, StorageWorkerMeta, StoreSpec
from kvx.plugins.storage.save_plan import Item, SavePlan, buffered_plan, buffered_rows, direct_plan
from kvx.plugins.storage.scatter import fetch_into, scatter
from kvx.plugins.storage.stats import StorageStats, Tally, failure_kind
from kvx.plugins.storage.values import layer_view, token_slice, unify_orders
from kvx.topology import is_primary_holder, physical_head_range

logger = logging.getLogger(__name__)

GROUP_BYTES = 16 << 20  # values written or read per backend round trip, in bytes
READ_BYTES = 64 << 20  # values read per round trip and scattered per convert_blocks call, at most
FIRST_READ_BYTES = 4 << 20  # the first group of a load is this small, each next one twice that
# (up to READ_BYTES): scattering starts after a short read, later groups make few calls


class StorageWorker(ConnectorWorker[StorageMetadata]):
    def __init__(
        self,
        geometry: Geometry,
        backend: StorageBackend,
        ctx: kvx.EngineContext,
        *,
        verify_checksums: bool,
        io_threads: int,
        max_inflight_bytes: int,
        mac_key: bytes | None = None,
    ) -> None:
        self.geo = geometry
        self.backend = backend
        self.verify = verify_checksums or mac_key is not None
        self.mac_key = mac_key  # values carry a keyed MAC instead of a checksum
        self.layout = get_layout("MLA" if geometry.mla else ctx.cache.layout, ctx.registry)
        if self.layout.is_cross_layer:
            raise ValueError(
                f"SharedStorageConnector takes per-layer KV tensors; layout {self.layout.name!r} "
                "is a cross-layer layout"
            )
        self.order, k_order = block_order(self.layout)
        if k_order != self.order and geometry.block_size != geometry.engine_block_size:
            self.order = k_order = KV_ORDER  # a split order is not cut into other block sizes
        self.k_order = "" if k_order == self.order else k_order
        par = ctx.parallel
        self.heads = physical_head_range(geometry.total_heads, par.tp_size, par.tp_rank)
        self.writer = is_primary_holder(geometry.total_heads, par.tp_size, par.tp_rank)
        self.dtype = getattr(torch, geometry.dtype)
        self.caches: dict[str, torch.Tensor] = {}
        self.stage: Stage | None = None
        self._by_index: dict[int, torch.Tensor] = {}  # global layer index -> cache
        # direct IO: values straight from and into the stage's engine blocks
        self.direct = False
        self._pieces = 1
        self._direct_io = DirectIO(backend, [], self.verify, (self.order, self.k_order), mac_key)
        self._foreign: set[tuple[range, bytes, range]] = set()  # (layers, layer set, heads)
        self._io_threads = io_threads
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvx-storage-io")
        self._budget = Budget(max_inflight_bytes)
        self._save_buffers = BufferPool(2 * max_inflight_bytes)
        # reads in flight: io_threads + 1 groups, all within max_inflight_bytes
        self._read_bytes = min(READ_BYTES, max_inflight_bytes // (io_threads + 1))
        self._read_buffers = BufferPool((io_threads + 1) * self._read_bytes)
        self._writing: list[torch.Tensor] = []  # buffers of the writes not yet waited for
        self._plan = SavePlan()  # this step's values to write, until the stage's last layer
        self._saves_meta: StorageMetadata | None = None
        self._saved_layers: set[str] = set()
        self._pending: list[Future[None]] = []
        self._load_errors: set[int] = set()
        self._tally = Tally()

    # -- registration ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, tensor in kv_caches.items():
            sizes = self.layout.sizes_of(tensor)
            want = {"tokens": self.geo.engine_block_size, "head_size": self.geo.head_size}
            if not self.geo.mla:
                want["heads"] = len(self.heads)
            got = {dim: sizes[dim] for dim in want}
            if got != want or tensor.dtype != self.dtype:
                raise ValueError(
                    f"KV cache of layer {name!r} has {got} {tensor.dtype}; the engine context "
                    f"says {want} {self.dtype}"
                )
        self.stage = self.geo.stage_of(list(kv_caches))
        index = {name: i for i, name in enumerate(self.geo.layer_names)}
        self._by_index = {index[name]: tensor for name, tensor in kv_caches.items()}
        self.caches = dict(kv_caches)
        self._direct_io.table = []
        bs, ebs = self.geo.block_size, self.geo.engine_block_size
        self._pieces = ebs // bs if ebs > bs else 1  # stored blocks per engine block
        self.direct = bs == ebs or (
            self._pieces > 1 and not self.k_order and splits_by_tokens(self.layout)
        )
        if self.direct:
            try:
                layers = [
                    CacheBlocks(self._by_index[g], self.layout, self._pieces)
                    for g in self.stage.layers
                ]
            except ValueError:  # a GPU cache, or a strided one: through buffers
                self.direct = False
            else:
                self._direct_io.table = [region for layer in layers for region in layer.regions()]

    # -- loads -----------------------------------------------------------------------------

    def start_load_kv(self, meta: StorageMetadata) -> None:
        loads = [Load(spec) for spec in meta.loads]
        if not loads:
            return
        if self.stage is None:
            raise RuntimeError("start_load_kv with loads before register_kv_caches")
        start = time.perf_counter()
        units = plan_units(loads, self.geo, self.stage, self.heads, self._shape, self._unit_bytes)
        self._load_units(units)
        errors = tokens = 0
        for load in loads:
            failed = failed_blocks(load, self.geo)
            self._load_errors.update(failed)
            errors += len(failed)
            tokens += valid_tokens(load, self.geo.block_size)
        self._tally.add(loaded_tokens=tokens, **({"load_errors": errors} if errors else {}))
        self._tally.timed("load_seconds", time.perf_counter() - start)

    def _unit_bytes(self, unit: Unit, planned: int) -> int:
        """Bytes of values a unit holds at most: direct reads need no scatter to start early
        (big groups; with one IO thread nothing reads in parallel: one unit, read on this
        thread); others start small, each next unit twice as big."""
        if self._is_direct(unit):
            return READ_BYTES if self._io_threads > 1 else sys.maxsize
        return min(self._read_bytes, FIRST_READ_BYTES << planned)

    def _fetch_direct(self, unit: Unit) -> Fetched:
        """Read a unit's values straight into the engine blocks (an IO thread)."""
        return self._direct_io.fetch(
            unit,
            targets(unit, self.geo),
            lambda keys: self.geo.value_keys(keys, unit.stage, unit.heads),
        )

    def _load_units(self, units: list[Unit]) -> None:
        """Units are read and checked (`_fetch`) on the IO threads, a few ahead, while this
        thread applies the finished ones in order (`_apply`)."""
        if len(units) == 1 and self._is_direct(units[0]):  # nothing to overlap: no hand-off
            self._settle(self._fetch_direct(units[0]))
            return
        window = self._io_threads + 1
        fetches: deque[Future[Fetched] | None] = deque()
        try:
            for i in range(len(units)):
                while len(fetches) < window and i + len(fetches) < len(units):
                    ahead = units[i + len(fetches)]
                    # skipped when every load in it already failed before its blocks
                    skip = all(span.first >= span.load.bad for span in ahead.runs)
                    fetch = self._fetch_direct if self._is_direct(ahead) else self._fetch
                    fetches.append(None if skip else self._pool.submit(fetch, ahead))
                future = fetches.popleft()
                if future is not None:
                    self._settle(future.result())
        finally:
            for pending in fetches:  # after an unexpected error: no read outlives the call
                if pending is not None:
                    pending.cancel()
                    with contextlib.suppress(Exception):
                        pending.result()

    def _settle(self, fetched: Fetched) -> None:
        """Apply a fetched unit (read again through a buffer when it was stored by an engine of
        another layout) and give its buffer back."""
        if fetched.foreign:
            self._foreign.add(unit_key(fetched.unit))
            fetched = self._fetch(fetched.unit)
        self._apply(fetched)
        if fetched.flat is not None:
            self._read_buffers.give(fetched.flat)

    def _is_direct(self, unit: Unit) -> bool:
        """Whether the unit's values can be read straight into the engine's blocks: this
        engine's own stage and head shard, not known to be stored in another order."""
        assert self.stage is not None
        return (
            self.direct
            and unit.heads == self.heads
            and unit.stage.layers == self.stage.layers
            and unit.stage.layer_set == self.stage.layer_set
            and unit_key(unit) not in self._foreign
        )

    def _fetch(self, unit: Unit) -> Fetched:
        """Read and check a unit's values into a pooled buffer (an IO thread)."""
        flat = self._read_buffers.take(len(unit.keys) * unit.shape.value_bytes)
        names = self.geo.value_keys(unit.keys, unit.stage, unit.heads)
        per = max(1, GROUP_BYTES // unit.shape.value_bytes)  # big pipelines are slower
        return fetch_into(unit, names, flat, self.backend, per, self.verify, self.mac_key)

    def _apply(self, fetched: Fetched) -> None:
        """Settle each load's first bad block; scatter the good blocks of a buffered unit,
        each load's up to its first bad one."""
        unit = fetched.unit
        if fetched.error is not None:
            logger.warning(
                "kvx storage: reading KV blocks from %s failed: %s: %s",
                self.backend.url,
                type(fetched.error).__name__,
                fetched.error,
            )
            for span in unit.runs:
                span.load.bad = 0  # later units skip it; every block is reported as a load error
            self._tally.add(**{f"load_failed_{failure_kind(fetched.error)}": len(unit.runs)})
            return
        for span in unit.runs if any(fetched.errors) else ():
            for k, row in enumerate(span.rows):
                error = fetched.errors[row]
                if error is not None:
                    self._tally.add(**{f"load_failed_{failure_kind(error)}": 1})
                    req = span.load.spec.req_id
                    logger.warning("kvx storage: load of request %s failed: %s", req, error)
                    span.load.bad = min(span.load.bad, span.first + k)
                    break
        good = [(span, min(len(span.rows), span.load.bad - span.first)) for span in unit.runs]
        good = [(span, n) for span, n in good if n > 0]
        if not good:
            return
        if fetched.values is not None:
            rows = [row for span, n in good for row in span.rows[:n]]
            stored = unify_orders(fetched.values, rows, fetched.shapes, self.dtype)
            assert self.stage is not None
            scatter(
                unit,
                fetched.values,
                good,
                stored,
                self.geo,
                self.stage,
                self.heads,
                self._by_index,
                self.layout,
            )
        blocks = sum(n for _, n in good)
        self._tally.add(loaded_blocks=blocks, loaded_bytes=blocks * unit.shape.payload_bytes)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -----------------------------------------------------------------------------

    def save_kv_layer(self, layer: str, kv_layer: torch.Tensor, meta: StorageMetadata) -> None:
        if not self.writer or not meta.stores:
            return
        if self._saves_meta is not meta:
            self._drop_unfinished_saves()
            self._saves_meta = meta
            self._new_saves(meta.stores)
        assert self.stage is not None
        if self.direct:
            if kv_layer.data_ptr() != self.caches[layer].data_ptr():
                raise ValueError(
                    f"save_kv_layer({layer!r}): the tensor is not the layer's registered KV cache"
                )
        else:
            assert self._plan.values is not None
            position = self.geo.layer_names.index(layer) - self.stage.layers.start
            view = layer_view(self._plan.values, self._own_shape(), position, self.dtype)
            for tokens, src, dst in self._plan.gathers:
                convert_blocks(
                    kv_layer,
                    token_slice(view, self._own_shape(), tokens),
                    src,
                    dst,
                    src_layout=self.layout,
                    dst_layout=self._own_shape().layout,
                )
        self._saved_layers.add(layer)
        if len(self._saved_layers) == len(self.caches):
            self._submit_writes()

    def _new_saves(self, stores: list[StoreSpec]) -> None:
        """Plan the step's values (`save_plan.py`); buffered saves take their value buffer."""
        assert self.stage is not None
        if self.direct:
            self._plan = direct_plan(stores, self.geo, self.stage, self.heads, self._pieces)
            return
        rows, value_bytes = buffered_rows(stores, self.geo), self._own_shape().value_bytes
        self._budget.acquire(rows * value_bytes)
        flat = self._save_buffers.take(rows * value_bytes)
        self._writing.append(flat)
        values = row_views(flat, rows, value_bytes)
        self._plan = buffered_plan(stores, self.geo, self.stage, self.heads, values)

    def _submit_writes(self) -> None:
        """Write the step's complete stored blocks, a group of values per IO-thread job."""
        plan, self._plan, self._saves_meta = self._plan, SavePlan(), None
        values, items = plan.values, plan.items
        self._saved_layers = set()
        shape = self._own_shape()
        per = max(1, GROUP_BYTES // shape.value_bytes)
        if values is None and self._direct_io.hashed_io:
            # a job per IO thread: each is one segment file, and on ext4 a new file's inode
            # can cost milliseconds (the allocator steps over recently deleted inodes)
            per = max(per, -(-len(items) // self._io_threads))
        if values is not None:  # the budget is given back per group as it is written
            self._budget.release(values.numel() - len(items) * shape.value_bytes)
        for at in range(0, len(items), per):
            try:
                future = self._pool.submit(self._write, items[at : at + per], shape)
            except BaseException:
                if values is not None:
                    self._budget.release((len(items) - at) * shape.value_bytes)
                raise
            self._pending.append(future)

    def _write(self, items: list[Item], shape: BlockShape) -> None:
        """Checksum and write a group of values (an IO thread)."""
        direct = bool(items) and isinstance(items[0][1], int)
        start = time.perf_counter()
        try:
            if direct:
                names = [name for name, _ in items]
                blocks = [block for _, block in items if isinstance(block, int)]
                assert len(blocks) == len(items), "direct writes name engine blocks"
                self._direct_io.write(names, blocks, shape)
            else:
                buffers = [(name, value) for name, value in items if isinstance(value, memoryview)]
                for name, value in buffers:
                    seal(name, shape, value, self.mac_key)
                self.backend.put_many(buffers)
            self._tally.add(saved_blocks=len(items), saved_bytes=len(items) * shape.payload_bytes)
            self._tally.timed("save_seconds", time.perf_counter() - start)
        except Exception as exc:
            self._tally.failed([name for name, _ in items], f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if not direct:
                self._budget.release(len(items) * shape.value_bytes)

    def _drop_unfinished_saves(self) -> None:
        """A step whose stage layers were not all saved writes nothing (values are whole)."""
        if self._saves_meta is None:
            return
        missing = sorted(set(self.caches) - self._saved_layers)
        logger.warning("kvx storage: blocks not stored, layers %s were never saved", missing)
        self._tally.add(save_errors=1)
        self._tally.failed([name for name, _ in self._plan.items], f"layers {missing} never saved")
        if self._plan.values is not None:
            self._budget.release(self._plan.values.numel())
        self._plan, self._saves_meta, self._saved_layers = SavePlan(), None, set()
        if not self._pending:  # nothing of it is being written: its buffer is free
            for flat in self._writing:
                self._save_buffers.give(flat)
            self._writing = []

    def wait_for_save(self, meta: StorageMetadata | None = None) -> None:
        """The step's writes (queued by `save_kv_layer`) are done; also at shutdown (None)."""
        self._drop_unfinished_saves()
        pending, self._pending = self._pending, []
        for future in pending:
            try:
                future.result()
            except Exception as exc:
                self._tally.add(save_errors=1)
                logger.warning(
                    "kvx storage: writing KV blocks to %s failed: %s: %s",
                    self.backend.url,
                    type(exc).__name__,
                    exc,
                )
        if self._plan.values is None:  # every write of the buffers has finished: reuse them
            for flat in self._writing:
                self._save_buffers.give(flat)
            self._writing = []

    # -- misc ------------------------------------------------------------------------------

    def take_stats(self) -> StorageStats | None:
        return self._tally.take()

    def take_worker_meta(self) -> StorageWorkerMeta | None:
        """The writes that failed since the last call (their block keys), for the scheduler
        half to report as `BlockStoreFailed` events."""
        medium = medium_of(self.backend.url)
        failed = [
            (list(dict.fromkeys(map(block_key_of, names))), medium, reason)
            for names, reason in self._tally.take_failures()
        ]
        return StorageWorkerMeta(failed) if failed else None

    def shutdown(self) -> None:
        self.wait_for_save()
        self._pool.shutdown(wait=True)
        self.backend.close()

    def _shape(self, stage: Stage, heads: range) -> BlockShape:
        g = self.geo
        return BlockShape(
            g.dtype,
            g.block_size,
            g.kv_parts,
            g.total_heads,
            heads,
            g.head_size,
            mla=g.mla,
            layers=stage.layers,
            total_layers=len(g.layer_names),
            layer_set=stage.layer_set,
            order=self.order,
            k_order=self.k_order,
        )

    def _own_shape(self) -> BlockShape:
        assert self.stage is not None
        return self._shape(self.stage, self.heads)
