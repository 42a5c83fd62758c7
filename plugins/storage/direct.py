"""Direct IO: values moved straight between the store and the engine's CPU blocks, when the
stored block is the engine block and the cache is dense CPU memory (no conversion).

A value's payload is one region per layer and K/V part of an engine block (a region table,
`kvx.StorageRegionTable`). A backend that declares `kvx.SupportsHashedIO` moves whole batches,
checksummed in the same pass (local files: in native code); other backends use vectored IO, a
group of values per round trip (`StorageBackend.group_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import kvx
from kvx import StorageBackend
from kvx.layouts import Layout
from kvx.plugins.storage.blockformat import (
    CHECKSUM_SPAN,
    HEADER,
    BlockFormatError,
    BlockShape,
    NotStoredError,
    checksum_ok,
    checksum_seed,
    header,
    header_prefix,
    mismatch,
    read_header,
    stored_checksum,
)
from kvx.plugins.storage.load_plan import Unit

Region = tuple[memoryview, int, int, int]  # a row of a region table


class CacheBlocks:
    """The bytes of one layer's engine blocks, without copying: block `b` is `outer` regions
    of `inner` bytes (K then V for vLLM's layouts), `stride` bytes apart, in the layout's
    memory order (the stored element order of a block written by this engine)."""

    def __init__(self, tensor: torch.Tensor, layout: Layout, pieces: int = 1) -> None:
        """`pieces` > 1: address each engine block as that many stored blocks (block `b`'s
        piece `s` is block `b * pieces + s`), which needs tokens right inside `blocks` in
        memory (each piece of a region then is a contiguous run of its tokens)."""
        sizes = layout.sizes_of(tensor)
        if pieces > 1 and not splits_by_tokens(layout):
            raise ValueError("engine blocks are not token-major: pieces are not contiguous")
        memory = tensor.permute(layout.stride_order)
        if tensor.device.type != "cpu" or not memory.is_contiguous():
            raise ValueError("not dense CPU memory in the layout's order")
        self.outer = math.prod(sizes[d] for d in layout.memory[: layout.memory.index("blocks")])
        self.flat = memory.reshape(-1).view(torch.uint8).numpy().data
        self.stride = len(self.flat) // self.outer
        self.inner = self.stride // sizes["blocks"] // pieces
        self.starts = [o * self.stride for o in range(self.outer)]

    def regions(self) -> list[Region]:
        return [(self.flat, start, self.inner, self.inner) for start in self.starts]


def splits_by_tokens(layout: Layout) -> bool:
    """Whether a block of `layout` is token-major in memory (K and V alike), so a run of its
    tokens is one contiguous piece of each of its regions."""
    memory = layout.memory
    return (not layout.k_memory or layout.k_memory == memory) and memory.index(
        "tokens"
    ) == memory.index("blocks") + 1


@dataclass
class Fetched:
    """A unit's values as read, and per value why it is unusable (or None). Direct reads went
    straight into the engine's blocks (`values` is None); `foreign` rows hold another element
    order than this engine's and must be read again and converted."""

    unit: Unit
    flat: torch.Tensor | None  # the buffer `values` lives in (back to the pool once applied)
    values: torch.Tensor | None
    errors: list[BlockFormatError | None]
    shapes: list[BlockShape | None] = field(default_factory=list)  # per row, as stored
    error: Exception | None = None  # the read itself failed
    foreign: bool = False


def check_size(name: str, size: int | None, expected: int) -> None:
    if size is None:
        raise NotStoredError(f"{name}: not stored")
    if size != expected:
        raise BlockFormatError(
            f"{name}: value is {size} bytes, expected {expected} (torn, padded or of another "
            "format version)"
        )


class DirectIO:
    """Reads and writes values of this engine's own stage and head shard straight from and
    into its blocks (`table`: the stage's layers in order), stored in element order `order`
    (order, K order)."""

    def __init__(
        self,
        backend: StorageBackend,
        table: list[Region],
        verify: bool,
        order: tuple[str, str],
        mac_key: bytes | None = None,
    ) -> None:
        self.backend = backend
        self.table = table
        self.verify = verify
        self.order = order
        self.mac_key = mac_key  # values are MACed, not checksummed: no native hashing

    def regions(self, block: int) -> list[memoryview]:
        """Engine block `block` of every layer of the stage: a stored value's payload."""
        return [
            buf[start + block * step : start + block * step + size]
            for buf, start, size, step in self.table
        ]

    @property
    def hashed_io(self) -> bool:
        """Whether values move through the backend's hashed block IO (`kvx.SupportsHashedIO`;
        read checksummed in the same pass when `verify`, else with a length and header check
        only)."""
        return kvx.supports_hashed_io(self.backend) and self.mac_key is None

    @property
    def _hashed_backend(self) -> kvx.SupportsHashedIO:
        assert isinstance(self.backend, kvx.SupportsHashedIO)  # `hashed_io` said so
        return self.backend

    def fetch(
        self, unit: Unit, targets: list[int | None], names_of: Callable[[list[str]], list[str]]
    ) -> Fetched:
        """Read a unit's values straight into the engine blocks they load into (`targets`, per
        row) and check them (an IO thread); rows no block needs are not read. `names_of` gives
        stored blocks' value names from their keys."""
        blocks = [block for block in targets if block is not None]
        rows: Sequence[int] = range(len(targets))
        keys = unit.keys
        if len(blocks) < len(targets):
            rows = [row for row, block in enumerate(targets) if block is not None]
            keys = [keys[row] for row in rows]
        names = names_of(keys)
        size, (span, _), shape = HEADER.size, CHECKSUM_SPAN, unit.shape
        raw = bytearray(size * len(rows))  # the values' headers, back to back
        headers = memoryview(raw)
        heads = [headers[at : at + size] for at in range(0, len(raw), size)]
        errors: list[BlockFormatError | None] = [None] * len(unit.keys)
        foreign = False
        # a value holding the header this engine writes for the unit, byte for byte, is of the
        # unit's shape: nothing to parse, only its checksum to compare
        own = header_prefix(shape) if (shape.order, shape.k_order) == self.order else None
        value_bytes = shape.value_bytes
        per = max(1, len(names) if self.hashed_io else self.backend.group_bytes // value_bytes)
        for at in range(0, len(names), per):
            group = slice(at, at + per)
            try:
                read = self._read(names[group], heads[group], blocks[group])
            except Exception as exc:  # an unreachable store fails these loads, not the step
                return Fetched(unit, None, None, [], error=exc)
            for i, (got, digest) in enumerate(read, at):
                if (
                    own is not None
                    and got == value_bytes
                    and raw.startswith(own, i * size)
                    and (
                        not self.verify
                        or digest == int.from_bytes(raw[i * size + span : (i + 1) * size], "little")
                    )
                ):
                    continue
                try:
                    foreign |= self._check(names[i], got, digest, heads[i], blocks[i], unit.shape)
                except BlockFormatError as exc:
                    errors[rows[i]] = exc
        return Fetched(unit, None, None, errors, foreign=foreign)

    def _check(
        self,
        name: str,
        size: int | None,
        digest: int | None,
        head: memoryview,
        block: int,
        shape: BlockShape,
    ) -> bool:
        """Check a value read into `head` and engine block `block` (`size` as stored, `digest`
        its checksum when computed while reading): whether it is stored in another element
        order (to be read again and converted), or raise `BlockFormatError`."""
        check_size(name, size, shape.value_bytes)
        same = head[: CHECKSUM_SPAN[0]] == header_prefix(shape)
        stored = shape if same else read_header(name, head, shape)
        if (stored.order, stored.k_order) != self.order:
            return True
        if self.verify and not (
            digest == stored_checksum(head)
            if digest is not None
            else checksum_ok(name, head, self.regions(block), self.mac_key)
        ):
            raise BlockFormatError(mismatch(name, self.mac_key))
        return False

    def _read(
        self, names: list[str], heads: list[memoryview], blocks: list[int]
    ) -> list[tuple[int | None, int | None]]:
        """Read each value into its head and engine block: per value its stored size (None if
        absent) and its checksum when the backend computed it while reading (else None)."""
        if self.hashed_io:
            # without checksums the seeds are not hashed
            seeds = [name.encode() for name in names] if self.verify else [b""] * len(names)
            return self._hashed_backend.get_blocks_hashed(
                names, seeds, CHECKSUM_SPAN, heads, self.table, blocks, self.verify
            )
        buffers = [[head, *self.regions(block)] for head, block in zip(heads, blocks, strict=True)]
        return [(size, None) for size in self.backend.get_vectored(names, buffers)]

    def write(self, names: list[str], blocks: list[int], shape: BlockShape) -> None:
        """Write values straight from the engine's blocks (an IO thread): local files in one
        native call, checksummed as they are written; otherwise as many per call as are worth
        a round trip."""
        if self.hashed_io:  # several values: one segment file
            seeds = [checksum_seed(name, shape) for name in names]
            self._hashed_backend.put_blocks_hashed(
                names, seeds, header_prefix(shape), self.table, blocks
            )
            return
        per = max(1, self.backend.group_bytes // shape.value_bytes)
        for at in range(0, len(names), per):
            vectors: list[tuple[str, list[bytes | memoryview]]] = []
            for name, block in zip(names[at : at + per], blocks[at : at + per], strict=True):
                payload = self.regions(block)
                vectors.append((name, [header(name, shape, payload, self.mac_key), *payload]))
            self.backend.put_vectored(vectors)
