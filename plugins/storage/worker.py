"""Worker side: load stored blocks into the paged KV cache, and save computed ones.

A stored value is every layer of this worker's PP stage for one block and head shard, in the
writer's own per-block element order (`blockformat.py`). When the engine's blocks are CPU
memory and the stored block size is the engine's ("direct" IO), nothing is copied in Python:
a value is written from, and read into, the cache's own bytes (one buffer per layer and K/V
region of the block), with vectored IO where the backend offers it (`put_vectored`,
`get_vectored`). Otherwise values go through buffers: `save_kv_layer` gathers the layer's
blocks into per-block value buffers and loads scatter them back, both with
`kvx.layouts.convert_blocks`, which converts between the engine's layout / block size / TP
shard and the stored form.

Saves: after the stage's last `save_kv_layer` the IO threads checksum and write the step's
values, a group of blocks per backend round trip, while the forward pass goes on;
`wait_for_save` returns when they are durable, so no write reads an engine block after the
step. Loads are synchronous (all in `start_load_kv`): the IO threads read groups of values and
check them a few groups ahead, while this thread scatters the groups that need converting.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

import kvx
from kvx import ConnectorWorker, StorageBackend
from kvx.layouts import Layout, convert_blocks, get_layout
from kvx.plugins.storage.blockformat import (
    CHECKSUM_SPAN,
    HEADER,
    KV_ORDER,
    BlockFormatError,
    BlockShape,
    block_order,
    check_value,
    checksum_ok,
    checksum_seed,
    header,
    header_prefix,
    read_header,
    seal,
    stored_checksum,
)
from kvx.plugins.storage.keys import Geometry, Stage, shard_ranges
from kvx.plugins.storage.metadata import LoadSpec, StorageMetadata, StoreSpec
from kvx.plugins.storage.stats import StorageStats, Tally
from kvx.topology import is_primary_holder, physical_head_range

logger = logging.getLogger(__name__)

GROUP_BYTES = 16 << 20  # values written or read per backend round trip, in bytes
READ_BYTES = 64 << 20  # values read per round trip and scattered per convert_blocks call, at most
FIRST_READ_BYTES = 4 << 20  # the first group of a load is this small, each next one twice that
# (up to READ_BYTES): scattering starts after a short read, later groups make few calls


class _Budget:
    """Bytes the writer may hold at once; a save waits for room (one oversized job may run
    alone)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


class _Buffers:
    """Byte buffers kept for reuse (up to `keep` bytes): fresh memory costs a page fault per
    4 KiB page on first touch, about as much as the copy into it."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.free: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least `nbytes` (contents undefined)."""
        with self.lock:
            fits = [b for b in self.free if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self.free = [b for b in self.free if b is not best]
                return best
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.append(buf)
            self.free.sort(key=lambda b: b.numel(), reverse=True)
            while sum(b.numel() for b in self.free) > self.keep:
                self.free.pop()


def _rows(flat: torch.Tensor, rows: int, row_bytes: int, at: int = 0) -> torch.Tensor:
    """`rows` rows of `row_bytes` of a flat buffer, from byte `at`."""
    return flat[at : at + rows * row_bytes].view(rows, row_bytes)


@dataclass
class _Load:
    """One request's load on this rank and its first bad stored block."""

    spec: LoadSpec
    bad: int = field(init=False)

    def __post_init__(self) -> None:
        self.bad = len(self.spec.keys)


@dataclass
class _Segment:
    """Consecutive stored blocks `first ...` of a load, held by `rows` of a unit."""

    load: _Load
    first: int
    rows: range


@dataclass
class _Unit:
    """Values of one writer stage and head shard read and scattered together: segments of
    one or more loads (one convert_blocks call per layer for all of them)."""

    stage: Stage
    heads: range
    shape: BlockShape
    capacity: int  # rows at most
    segments: list[_Segment] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # per row, the stored block's key


class _CacheBlocks:
    """The bytes of one layer's engine blocks, without copying: block `b` is `outer` regions
    of `inner` bytes (K then V for vLLM's layouts), `stride` bytes apart, in the layout's
    memory order (the stored element order of a block written by this engine)."""

    def __init__(self, tensor: torch.Tensor, layout: Layout) -> None:
        sizes = layout.sizes_of(tensor)
        memory = tensor.permute(layout.stride_order)
        if tensor.device.type != "cpu" or not memory.is_contiguous():
            raise ValueError("not dense CPU memory in the layout's order")
        self.outer = math.prod(sizes[d] for d in layout.memory[: layout.memory.index("blocks")])
        self.flat = memory.reshape(-1).view(torch.uint8).numpy().data
        self.stride = len(self.flat) // self.outer
        self.inner = self.stride // sizes["blocks"]
        self.starts = [o * self.stride for o in range(self.outer)]


@dataclass
class _Fetched:
    """A unit's values as read, and per value why it is unusable (or None). Direct reads went
    straight into the engine's blocks (`values` is None); `foreign` rows hold another element
    order than this engine's and must be read again and converted."""

    unit: _Unit
    flat: torch.Tensor | None  # the buffer `values` lives in (back to the pool once applied)
    values: torch.Tensor | None
    errors: list[BlockFormatError | None]
    shapes: list[BlockShape | None] = field(default_factory=list)  # per row, as stored
    error: Exception | None = None  # the read itself failed
    foreign: bool = False


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
    ) -> None:
        self.geo = geometry
        self.backend = backend
        self.verify = verify_checksums
        self.layout = get_layout("MLA" if geometry.mla else ctx.cache.layout)
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
        # direct IO: where an engine block's regions lie, the stage's layers in order
        self._table: list[tuple[memoryview, int, int, int]] = []  # a RegionTable
        self.direct = False
        self._foreign: set[tuple[range, bytes, range]] = set()  # (layers, layer set, heads)
        self._io_threads = io_threads
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvx-storage-io")
        self._budget = _Budget(max_inflight_bytes)
        self._save_buffers = _Buffers(2 * max_inflight_bytes)
        # reads in flight: io_threads + 1 groups, all within max_inflight_bytes
        self._read_bytes = min(READ_BYTES, max_inflight_bytes // (io_threads + 1))
        self._read_buffers = _Buffers((io_threads + 1) * self._read_bytes)
        self._writing: list[torch.Tensor] = []  # buffers of the writes not yet waited for
        # this step's value buffers (one row per stored block), until the stage's last layer
        self._step_values: torch.Tensor | None = None
        self._step_pieces: list[tuple[slice, list[int], list[int]]] = []  # see _new_saves
        self._saves_meta: StorageMetadata | None = None
        self._saved_layers: set[str] = set()
        # this step's values to write: (name, value buffer) or, direct, (name, engine block)
        self._items: list[tuple[str, memoryview | int]] = []
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
        self._table = []
        self.direct = self.geo.block_size == self.geo.engine_block_size
        if self.direct:
            try:
                layers = [_CacheBlocks(self._by_index[g], self.layout) for g in self.stage.layers]
            except ValueError:  # a GPU cache, or a strided one: through buffers
                self.direct = False
            else:
                self._table = [
                    (layer.flat, start, layer.inner, layer.inner)
                    for layer in layers
                    for start in layer.starts
                ]

    def _regions(self, block: int) -> list[memoryview]:
        """Engine block `block` of every layer of the stage: a stored value's payload."""
        return [
            buf[start + block * step : start + block * step + size]
            for buf, start, size, step in self._table
        ]

    # -- loads -----------------------------------------------------------------------------

    def start_load_kv(self, meta: StorageMetadata) -> None:
        loads = [_Load(spec) for spec in meta.loads]
        if not loads:
            return
        if self.stage is None:
            raise RuntimeError("start_load_kv with loads before register_kv_caches")
        self._load_units(self._units(loads))
        for load in loads:
            spec = load.spec
            if load.bad < len(spec.keys):
                bad_token = max(spec.start, (spec.first_block + load.bad) * self.geo.block_size)
                first_bad = (bad_token - spec.start) // self.geo.engine_block_size
                self._load_errors.update(spec.block_ids[first_bad:])
                self._tally.add(load_errors=len(spec.block_ids) - first_bad)
            self._tally.add(loaded_tokens=self._valid_tokens(load))

    def _units(self, loads: list[_Load]) -> list[_Unit]:
        """Every value the loads need, grouped per writer stage and head shard into units of
        up to `_read_bytes` (a segment starts on an engine block when engine blocks hold
        several stored blocks)."""
        assert self.stage is not None
        bs, ebs = self.geo.block_size, self.geo.engine_block_size
        align = ebs // bs if ebs > bs else 1
        units: list[_Unit] = []
        open_units: dict[tuple[range, bytes, range], _Unit] = {}
        for load in loads:
            spec = load.spec
            j = 0
            while j < len(spec.keys):
                if j % align:  # another writer's values begin inside an engine block
                    load.bad = min(load.bad, j - j % align)  # rare: that block is recomputed
                    break
                part = (spec.stages[j], spec.shards[j])
                end = j + 1
                while end < len(spec.keys) and (spec.stages[end], spec.shards[end]) == part:
                    end += 1
                stages = self.geo.stages(part[0])
                shards = shard_ranges(self.geo.total_heads, part[1])
                for stage in [s for s in stages if _overlap(s.layers, self.stage.layers)]:
                    for heads in [h for h in shards if _overlap(h, self.heads)]:
                        at = j
                        while at < end:
                            key = (stage.layers, stage.layer_set, heads)
                            unit = open_units.get(key)
                            room = 0 if unit is None else unit.capacity - len(unit.keys)
                            take = min(end - at, room // align * align)
                            if take <= 0:
                                shape = self._shape(stage, heads)
                                unit = _Unit(stage, heads, shape, 0)
                                # direct reads need no scatter to start early: big groups
                                size = (
                                    READ_BYTES
                                    if self._is_direct(unit)
                                    else min(self._read_bytes, FIRST_READ_BYTES << len(units))
                                )
                                per = max(1, size // shape.value_bytes)
                                unit.capacity = max(align, per // align * align)
                                open_units[key] = unit
                                units.append(unit)
                                continue
                            assert unit is not None
                            rows = range(len(unit.keys), len(unit.keys) + take)
                            unit.segments.append(_Segment(load, at, rows))
                            unit.keys.extend(spec.keys[at : at + take])
                            at += take
                j = end
        return units

    def _load_units(self, units: list[_Unit]) -> None:
        """Units are read and checked (`_fetch`) on the IO threads, a few ahead, while this
        thread applies the finished ones in order (`_apply`)."""
        window = self._io_threads + 1
        fetches: deque[Future[_Fetched] | None] = deque()
        try:
            for i in range(len(units)):
                while len(fetches) < window and i + len(fetches) < len(units):
                    ahead = units[i + len(fetches)]
                    # skipped when every load in it already failed before its blocks
                    skip = all(seg.first >= seg.load.bad for seg in ahead.segments)
                    fetch = self._fetch_direct if self._is_direct(ahead) else self._fetch
                    fetches.append(None if skip else self._pool.submit(fetch, ahead))
                future = fetches.popleft()
                if future is not None:
                    fetched = future.result()
                    if fetched.foreign:  # stored by an engine of another layout: convert
                        self._foreign.add(_unit_key(fetched.unit))
                        fetched = self._fetch(fetched.unit)
                    self._apply(fetched)
                    if fetched.flat is not None:
                        self._read_buffers.give(fetched.flat)
        finally:
            for pending in fetches:  # after an unexpected error: no read outlives the call
                if pending is not None:
                    pending.cancel()
                    with contextlib.suppress(Exception):
                        pending.result()

    def _is_direct(self, unit: _Unit) -> bool:
        """Whether the unit's values can be read straight into the engine's blocks: this
        engine's own stage and head shard, not known to be stored in another order."""
        assert self.stage is not None
        return (
            self.direct
            and unit.heads == self.heads
            and unit.stage.layers == self.stage.layers
            and unit.stage.layer_set == self.stage.layer_set
            and _unit_key(unit) not in self._foreign
        )

    def _fetch(self, unit: _Unit) -> _Fetched:
        """Read and check a unit's values into a buffer (an IO thread); a failed read is
        returned, not raised."""
        shape = unit.shape
        flat = self._read_buffers.take(len(unit.keys) * shape.value_bytes)
        values = _rows(flat, len(unit.keys), shape.value_bytes)
        rows = [memoryview(row.numpy()) for row in values]
        names = [self.geo.value_key(key, unit.stage, unit.heads) for key in unit.keys]
        try:
            per = max(1, GROUP_BYTES // shape.value_bytes)  # big pipelines are slower
            sizes: list[int | None] = []
            for at in range(0, len(names), per):
                sizes.extend(self._read_into(names[at : at + per], rows[at : at + per]))
        except Exception as exc:  # an unreachable store fails these loads, not the engine step
            return _Fetched(unit, flat, values, [], error=exc)
        errors: list[BlockFormatError | None] = []
        shapes: list[BlockShape | None] = []
        for name, row, size in zip(names, rows, sizes, strict=True):
            try:
                _check_size(name, size, len(row))
                stored, _ = check_value(name, row, shape, verify=self.verify)
                errors.append(None)
                shapes.append(stored)
            except BlockFormatError as exc:
                errors.append(exc)
                shapes.append(None)
        return _Fetched(unit, flat, values, errors, shapes)

    def _fetch_direct(self, unit: _Unit) -> _Fetched:
        """Read a unit's values straight into the engine blocks they load into (an IO thread)
        and check them (local files: the whole unit in one native call, checksummed as read);
        rows no block needs are not read."""
        shape = unit.shape
        headers = memoryview(bytearray(HEADER.size * len(unit.keys)))
        names, heads, blocks, rows = [], [], [], []
        for row, (key, block) in enumerate(zip(unit.keys, self._targets(unit), strict=True)):
            if block is not None:
                names.append(self.geo.value_key(key, unit.stage, unit.heads))
                heads.append(headers[row * HEADER.size : (row + 1) * HEADER.size])
                blocks.append(block)
                rows.append(row)
        errors: list[BlockFormatError | None] = [None] * len(unit.keys)
        foreign = False
        if self._native_io():
            per = max(1, len(names))
        else:
            per = max(1, self.backend.group_bytes // shape.value_bytes)
        for at in range(0, len(names), per):
            group = slice(at, at + per)
            try:
                read = self._read_checked(names[group], heads[group], blocks[group])
            except Exception as exc:
                return _Fetched(unit, None, None, [], error=exc)
            for name, head, block, row, (size, digest) in zip(
                names[group], heads[group], blocks[group], rows[group], read, strict=True
            ):
                try:
                    _check_size(name, size, shape.value_bytes)
                    stored = read_header(name, head, shape)
                    if (stored.order, stored.k_order) != (self.order, self.k_order):
                        foreign = True
                    elif self.verify and not (
                        digest == stored_checksum(head)
                        if digest is not None
                        else checksum_ok(name, head, self._regions(block))
                    ):
                        raise BlockFormatError(f"{name}: checksum mismatch (corrupt value)")
                except BlockFormatError as exc:
                    errors[row] = exc
        return _Fetched(unit, None, None, errors, foreign=foreign)

    def _native_io(self) -> bool:
        """Whether direct values move through the backend's native block IO (local files),
        checksummed in the same pass."""
        return self.verify and self.backend.hashed_io

    def _read_checked(
        self, names: list[str], heads: list[memoryview], blocks: list[int]
    ) -> list[tuple[int | None, int | None]]:
        """Read each value into its head and engine block: per value its stored size (None if
        absent) and its checksum when the backend computed it while reading (else None)."""
        if self._native_io():
            read: list[tuple[int | None, int | None]] = self.backend.get_blocks_hashed(
                names, [name.encode() for name in names], CHECKSUM_SPAN, heads, self._table, blocks
            )
            return read
        buffers = [[head, *self._regions(block)] for head, block in zip(heads, blocks, strict=True)]
        return [(size, None) for size in self._read_vectored(names, buffers)]

    def _targets(self, unit: _Unit) -> list[int | None]:
        """Per row of a unit (stored block = engine block), the engine block it loads into,
        or None when it holds no token the load needs."""
        bs, ebs = self.geo.block_size, self.geo.engine_block_size
        targets: list[int | None] = [None] * len(unit.keys)
        for seg in unit.segments:
            spec = seg.load.spec
            t0 = (spec.first_block + seg.first) * bs
            for k, row in enumerate(seg.rows):
                t = t0 + k * bs
                if spec.start <= t < spec.start + spec.num_tokens:
                    targets[row] = spec.block_ids[(t - spec.start) // ebs]
        return targets

    def _read_into(self, names: list[str], rows: list[memoryview]) -> Sequence[int | None]:
        """Read each value into its row: per value its stored size (None if absent)."""
        return self.backend.get_into(names, rows)

    def _read_vectored(
        self, names: list[str], buffers: list[list[memoryview]]
    ) -> Sequence[int | None]:
        """Read each value into its buffers (in order): per value its stored size (None if
        absent)."""
        return self.backend.get_vectored(names, buffers)

    def _apply(self, fetched: _Fetched) -> None:
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
            for seg in unit.segments:
                seg.load.bad = 0  # later units skip it; every block is reported as a load error
            return
        for seg in unit.segments:
            for k, row in enumerate(seg.rows):
                error = fetched.errors[row]
                if error is not None:
                    req = seg.load.spec.req_id
                    logger.warning("kvx storage: load of request %s failed: %s", req, error)
                    seg.load.bad = min(seg.load.bad, seg.first + k)
                    break
        good = [(seg, min(len(seg.rows), seg.load.bad - seg.first)) for seg in unit.segments]
        good = [(seg, n) for seg, n in good if n > 0]
        if not good:
            return
        if fetched.values is not None:
            stored = self._unify_orders(fetched.values, good, fetched.shapes)
            self._scatter(unit, fetched.values, good, stored)
        rows = sum(n for _, n in good)
        self._tally.add(loaded_bytes=rows * unit.shape.value_bytes)

    def _unify_orders(
        self,
        values: torch.Tensor,
        good: list[tuple[_Segment, int]],
        shapes: list[BlockShape | None],
    ) -> BlockShape:
        """The shape of the first good row, after rewriting (in `values`) every good row
        stored in another element order into its order: writers of different layouts may
        have stored one request's blocks."""
        rows = [row for seg, n in good for row in seg.rows[:n]]
        target = shapes[rows[0]]
        assert target is not None
        others: dict[BlockShape, list[int]] = {}
        for row in rows:
            shape = shapes[row]
            assert shape is not None
            if shape != target:
                others.setdefault(shape, []).append(row)
        for shape, moved in others.items():
            for position in range(len(shape.layers)):
                src = self._layer_view(values, shape, position)
                converted = _converted(src, moved, shape, target)
                self._layer_view(values, target, position)[moved] = converted
        return target

    def _scatter(
        self,
        unit: _Unit,
        values: torch.Tensor,
        good: list[tuple[_Segment, int]],
        stored: BlockShape,
    ) -> None:
        """Copy the first `n` rows of each segment (values of the `stored` shape), every layer
        this rank holds, into the cache: one convert_blocks call per layer and
        engine-block-sized piece of a row."""
        assert self.stage is not None
        bs, ebs = self.geo.block_size, self.geo.engine_block_size
        heads: dict[str, range] = {}
        if not self.geo.mla and unit.heads != self.heads:
            lo, hi = max(unit.heads.start, self.heads.start), min(unit.heads.stop, self.heads.stop)
            heads["src_heads"] = range(lo - unit.heads.start, hi - unit.heads.start)
            heads["dst_heads"] = range(lo - self.heads.start, hi - self.heads.start)
        # moves: (tokens of a row, src rows, dst engine blocks, tokens or None for whole blocks)
        moves: dict[object, tuple[slice, list[int], list[int], int | None]] = {}
        for index, (seg, n) in enumerate(good):
            spec = seg.load.spec
            t0 = (spec.first_block + seg.first) * bs  # request position of the segment
            rows = list(seg.rows[:n])
            if ebs > bs:  # rows fill engine blocks in order (a segment starts on one)
                e0 = (t0 - spec.start) // ebs
                dst = spec.block_ids[e0 : e0 - (-(n * bs) // ebs)]
                whole = n * bs % ebs == 0  # whole engine blocks: one call with the others
                key: object = "whole" if whole else ("part", index)
                move = moves.setdefault(key, (slice(None), [], [], None if whole else n * bs))
                move[1].extend(rows)
                move[2].extend(dst)
                continue
            for s in range(bs // ebs):  # piece `s` of a row is one engine block (or outside)
                move = moves.setdefault(s, (slice(s * ebs, (s + 1) * ebs), [], [], None))
                for r, row in enumerate(rows):
                    t = t0 + r * bs + s * ebs
                    if spec.start <= t < spec.start + spec.num_tokens:
                        move[1].append(row)
                        move[2].append(spec.block_ids[(t - spec.start) // ebs])
        layers = range(
            max(unit.stage.layers.start, self.stage.layers.start),
            min(unit.stage.layers.stop, self.stage.layers.stop),
        )
        for g in layers:
            view = self._layer_view(values, stored, g - unit.stage.layers.start)
            shape = stored
            if stored.k_order and bs > ebs:  # K and V orders differ: unsplit, then cut
                shape = replace(stored, order=KV_ORDER, k_order="")
                view = _converted(view, range(view.shape[0]), stored, shape)
            for tokens, src, dst, num_tokens in moves.values():
                if src:
                    convert_blocks(
                        _tokens(view, shape, tokens),
                        self._by_index[g],
                        src,
                        dst,
                        src_layout=shape.layout,
                        dst_layout=self.layout,
                        num_tokens=num_tokens,
                        **heads,
                    )

    def _valid_tokens(self, load: _Load) -> int:
        spec = load.spec
        end = (spec.first_block + load.bad) * self.geo.block_size
        return max(0, min(spec.num_tokens, end - spec.start))

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
            assert self._step_values is not None
            position = self.geo.layer_names.index(layer) - self.stage.layers.start
            view = self._layer_view(self._step_values, self._own_shape(), position)
            for tokens, src, dst in self._step_pieces:
                convert_blocks(
                    kv_layer,
                    _tokens(view, self._own_shape(), tokens),
                    src,
                    dst,
                    src_layout=self.layout,
                    dst_layout=self._own_shape().layout,
                )
        self._saved_layers.add(layer)
        if len(self._saved_layers) == len(self.caches):
            self._submit_writes()

    def _new_saves(self, stores: list[StoreSpec]) -> None:
        """The step's values to write. Direct: per complete stored block its name and engine
        block. Otherwise value buffers (one reused flat buffer, a row per stored block from each
        spec's first engine block on) and the gather plan: per engine-block-sized piece of a
        row, the engine blocks and the rows they go to (all specs in one convert_blocks call
        per layer and piece)."""
        assert self.stage is not None
        bs, ebs = self.geo.block_size, self.geo.engine_block_size
        shape = self._own_shape()
        self._items = []
        if self.direct:  # stored block = engine block
            for spec in stores:
                for r, name in self._complete_rows(spec, len(spec.block_ids)):
                    self._items.append((name, spec.block_ids[r]))
            return
        rows = [-(-len(spec.block_ids) * ebs // bs) for spec in stores]
        self._budget.acquire(sum(rows) * shape.value_bytes)
        flat = self._save_buffers.take(sum(rows) * shape.value_bytes)
        self._writing.append(flat)
        values = _rows(flat, sum(rows), shape.value_bytes)
        k = bs // ebs if bs > ebs else 1  # engine block `r * k + s` is piece `s` of row `r`
        pieces: list[tuple[slice, list[int], list[int]]] = [
            (slice(s * ebs, (s + 1) * ebs) if k > 1 else slice(None), [], []) for s in range(k)
        ]
        first_row = 0
        for spec, n in zip(stores, rows, strict=True):
            for s, (_, src, dst) in enumerate(pieces):
                ids = spec.block_ids[s::k]
                src.extend(ids)
                dst.extend(range(first_row, first_row + len(ids)) if k > 1 else [])
            if k == 1:  # engine blocks fill whole rows in order
                pieces[0][2].extend(range(first_row, first_row + n))
            for r, name in self._complete_rows(spec, n):
                self._items.append((name, values[first_row + r].numpy().data))
            first_row += n
        self._step_values = values
        self._step_pieces = [piece for piece in pieces if piece[1]]

    def _complete_rows(self, spec: StoreSpec, rows: int) -> list[tuple[int, str]]:
        """(row, value name) of each of a store's first `rows` rows (stored blocks from its
        first engine block on) that is a complete stored block of its keys."""
        assert self.stage is not None
        first = spec.block_ids_start // self.geo.block_size - spec.first_block
        return [
            (r, self.geo.value_key(spec.keys[first + r], self.stage, self.heads))
            for r in range(rows)
            if 0 <= first + r < len(spec.keys)
        ]

    def _submit_writes(self) -> None:
        """Write the step's complete stored blocks, a group of values per IO-thread job."""
        values, self._step_values, self._saves_meta = self._step_values, None, None
        items, self._items = self._items, []
        self._saved_layers = set()
        shape = self._own_shape()
        per = max(1, GROUP_BYTES // shape.value_bytes)
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

    def _write(self, items: list[tuple[str, memoryview | int]], shape: BlockShape) -> None:
        """Checksum and write a group of values (an IO thread)."""
        direct = bool(items) and isinstance(items[0][1], int)
        try:
            if direct:
                self._write_direct(items, shape)
            else:
                buffers = [(name, value) for name, value in items if isinstance(value, memoryview)]
                for name, value in buffers:
                    seal(name, shape, value)
                self.backend.put_many(buffers)
            self._tally.add(saved_blocks=len(items), saved_bytes=len(items) * shape.value_bytes)
        finally:
            if not direct:
                self._budget.release(len(items) * shape.value_bytes)

    def _write_direct(self, items: list[tuple[str, memoryview | int]], shape: BlockShape) -> None:
        """Write values straight from the engine's blocks (an IO thread): local files in one
        native call, checksummed as they are written; otherwise as many per call as are worth
        a round trip."""
        names = [name for name, _ in items]
        blocks = [block for _, block in items if isinstance(block, int)]
        assert len(blocks) == len(items), "direct writes name engine blocks"
        if self.backend.hashed_io:
            seeds = [checksum_seed(name, shape) for name in names]
            self.backend.put_blocks_hashed(names, seeds, header_prefix(shape), self._table, blocks)
            return
        per = max(1, self.backend.group_bytes // shape.value_bytes)
        for at in range(0, len(items), per):
            vectors = []
            for name, block in zip(names[at : at + per], blocks[at : at + per], strict=True):
                payload = self._regions(block)
                vectors.append((name, [header(name, shape, payload), *payload]))
            self.backend.put_vectored(vectors)

    def _drop_unfinished_saves(self) -> None:
        """A step whose stage layers were not all saved writes nothing (values are whole)."""
        if self._saves_meta is None:
            return
        missing = sorted(set(self.caches) - self._saved_layers)
        logger.warning("kvx storage: blocks not stored, layers %s were never saved", missing)
        self._tally.add(save_errors=1)
        if self._step_values is not None:
            self._budget.release(self._step_values.numel())
        self._step_values, self._saves_meta, self._saved_layers = None, None, set()
        self._items = []
        if not self._pending:  # nothing of it is being written: its buffer is free
            for flat in self._writing:
                self._save_buffers.give(flat)
            self._writing = []

    def wait_for_save(self) -> None:
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
        if self._step_values is None:  # every write of the buffers has finished: reuse them
            for flat in self._writing:
                self._save_buffers.give(flat)
            self._writing = []

    # -- misc ------------------------------------------------------------------------------

    def take_stats(self) -> StorageStats | None:
        return self._tally.take()

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

    def _layer_view(self, values: torch.Tensor, shape: BlockShape, position: int) -> torch.Tensor:
        """Layer `position` of every value in `values` (uint8 `[n, value_bytes]`) as stored
        blocks of `shape`'s layout: a strided view `[n, *order]`."""
        item = shape.itemsize
        per = shape.layer_bytes // item
        at = HEADER.size // item + position * per
        return values.view(self.dtype)[:, at : at + per].view(-1, *shape.tensor_shape[1:])


def _tokens(view: torch.Tensor, shape: BlockShape, tokens: slice) -> torch.Tensor:
    """The `tokens` of every stored block in a layer view (a piece of an engine block's size;
    the order must not be split)."""
    if tokens == slice(None):
        return view
    index = [slice(None)] * view.dim()
    index[1 + shape.order.index("t")] = tokens
    return view[tuple(index)]


def _converted(
    view: torch.Tensor, rows: Sequence[int], shape: BlockShape, target: BlockShape
) -> torch.Tensor:
    """Stored blocks `rows` of a layer view of `shape`, as new blocks of `target`'s order."""
    out = torch.empty((len(rows), *target.tensor_shape[1:]), dtype=view.dtype)
    convert_blocks(
        view, out, rows, range(len(rows)), src_layout=shape.layout, dst_layout=target.layout
    )
    return out


def _check_size(name: str, size: int | None, expected: int) -> None:
    if size is None:
        raise BlockFormatError(f"{name}: not stored")
    if size != expected:
        raise BlockFormatError(
            f"{name}: value is {size} bytes, expected {expected} (torn, padded or of another "
            "format version)"
        )


def _unit_key(unit: _Unit) -> tuple[range, bytes, range]:
    return (unit.stage.layers, unit.stage.layer_set, unit.heads)


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop
