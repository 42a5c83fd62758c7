"""`StorageBackend`: the key -> bytes store a storage connector keeps KV blocks in.

A backend implements four plain calls (`put_many`, `get_many`, `exists_many`, `close`); the
calls that move values straight between the store and caller's buffers (`get_into`,
`put_vectored`, `get_vectored`) have defaults built on the plain ones, which a fast backend
overrides to skip the copies. A backend may also declare the optional ability
`SupportsHashedIO` (a mixin, as `SupportsHMA` is for connectors): it moves whole batches of
engine blocks between the store and the KV cache, checksummed in the same pass; the mixin's
defaults do it on the vectored calls, and a fast backend (local files, in native code)
overrides them.

A plugin registers a backend class for URL schemes (`kvx_storage_backends` returning
`StorageBackendSpec`); `open_storage_backend(url, options, registry)` builds the one registered
for a URL's scheme as `cls(url, options)`. See docs/writing-a-storage-backend.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvx.config.secrets import redact_url
from kvx.contract.types import PluginRegistry
from kvx.errors import ConfigError, ConfigProblem


@dataclass(frozen=True)
class StorageBackendOptions:
    """What the connector's config says about IO (backends ignore what does not apply):
    `ttl_s`, seconds a stored value lives (None: until removed); `timeout_s`, how long one
    call may wait on the store; `redis_client`, the Redis backend's client for values
    ("resp", kvx's own, or "redis-py"); `file_mode`, of new local files (0600: the owner's);
    `storage_options`, fsspec's keyword arguments for the URL's filesystem; `password`, the
    store's password when it is not in the URL (already resolved: see `resolve_secret`)."""

    ttl_s: int | None = None
    timeout_s: float = 10.0
    redis_client: str = "resp"
    file_mode: int = 0o600
    """Mode of new local files; directories get it with the execute bits added (0700)."""
    storage_options: Mapping[str, Any] | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def dir_mode(self) -> int:
        return self.file_mode | (self.file_mode & 0o444) >> 2


StorageRegionTable = Sequence[tuple[memoryview, int, int, int]]
"""Where engine blocks lie in the KV cache: per region of a block (buffer, start, size, step),
block b's bytes of that region being `buffer[start + b * step:][:size]`; a block's value
payload is its regions in table order."""


class StorageBackend(ABC):
    """A flat key -> bytes store. Keys are `/`-separated strings of letters, digits and
    `._-`; values are never empty.

    Every value is written atomically: a reader sees it whole or not at all. Methods may be
    called from several threads at once. Built as `cls(url, options)`; `url` is kept as the
    attribute of that name (messages name it).
    """

    url: str

    group_bytes: int = 16 << 20
    """How many bytes of values are worth one vectored call (one round trip to the store)."""

    def __init__(self, url: str, options: StorageBackendOptions) -> None:
        self.url = url

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Store every `(key, value)`; raise on failure (values already written may stay)."""

    @abstractmethod
    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        """The values of `keys` (None where absent or unreadable); a value longer than
        `max_bytes` may come back truncated to `max_bytes + 1` bytes."""

    @abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a value."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads."""

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """Read each value into its buffer when it is exactly that long (otherwise the buffer
        is untouched): per key the stored size (None where absent; a longer value may be
        reported as the buffer's length + 1). Default: `get_many`, then a copy."""
        return self.get_vectored(keys, [[buf] for buf in buffers])

    def put_vectored(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        """Store each key as the concatenation of its buffers. Default: joins them and calls
        `put_many`; override to send from the buffers."""
        self.put_many([(key, b"".join(parts)) for key, parts in items])

    def get_vectored(
        self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """Read each value into its buffers, in order, when it is exactly their total length
        (otherwise they are untouched): per key the stored size as `get_into` says. Default:
        `get_many`, then a copy; override to read into the buffers."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffer lists; one per key")
        if not keys:
            return []
        totals = [sum(memoryview(b).nbytes for b in parts) for parts in buffers]
        sizes: list[int | None] = []
        for parts, total, data in zip(
            buffers, totals, self.get_many(keys, max(totals)), strict=True
        ):
            if data is not None and len(data) == total:
                copy_into(parts, data)
            sizes.append(None if data is None else len(data))
        return sizes


class SupportsHashedIO:
    """The optional ability to move whole batches of engine blocks between the store and the
    KV cache, checksummed in the same pass: a `StorageBackend` that declares it (mixed in
    before `StorageBackend`) has the storage connector use these two calls for blocks that
    move without conversion. The defaults work on any backend through its vectored calls,
    hashing in Python; a fast backend overrides them (local files: native code, no GIL)."""

    def put_blocks_hashed(
        self,
        keys: Sequence[str],
        seeds: Sequence[bytes],
        prefix: bytes,
        regions: StorageRegionTable,
        blocks: Sequence[int],
    ) -> None:
        """Store key i as a header (`prefix`, then XXH3-64 of `seeds[i]` and the payload,
        little-endian) and the payload: the regions of engine block `blocks[i]`. Atomic per
        key, as `put_many`."""
        items: list[tuple[str, Sequence[bytes | memoryview]]] = []
        for key, seed, block in zip(keys, seeds, blocks, strict=True):
            payload = _block_regions(regions, block)
            digest = xxhash.xxh3_64(seed)
            for part in payload:
                digest.update(part)
            items.append((key, [prefix + digest.intdigest().to_bytes(8, "little"), *payload]))
        _backend(self).put_vectored(items)

    def get_blocks_hashed(
        self,
        keys: Sequence[str],
        seeds: Sequence[bytes],
        skip: tuple[int, int],
        heads: Sequence[memoryview],
        regions: StorageRegionTable,
        blocks: Sequence[int],
        checksum: bool = True,
    ) -> list[tuple[int | None, int | None]]:
        """Read values written by `put_blocks_hashed`: key i into `heads[i]` and the regions
        of engine block `blocks[i]` when it has exactly their size (otherwise nothing is
        read). Per key its stored size (None if absent) and, when read, XXH3-64 of `seeds[i]`
        then its bytes except the `skip` (start, stop) span (else None; always None with
        `checksum` False, when nothing is hashed)."""
        payloads = [_block_regions(regions, block) for block in blocks]
        buffers = [[head, *payload] for head, payload in zip(heads, payloads, strict=True)]
        sizes = _backend(self).get_vectored(keys, buffers)
        out: list[tuple[int | None, int | None]] = []
        for seed, parts, size in zip(seeds, buffers, sizes, strict=True):
            total = sum(memoryview(part).nbytes for part in parts)
            if not checksum or size != total:
                out.append((size, None))
                continue
            head = bytes(parts[0])
            digest = xxhash.xxh3_64(seed)
            digest.update(head[: skip[0]] + head[skip[1] :])
            for part in parts[1:]:
                digest.update(part)
            out.append((size, digest.intdigest()))
        return out


def supports_hashed_io(backend: Any) -> bool:
    """True if `backend` (a class or an instance) declares `SupportsHashedIO`."""
    cls = backend if isinstance(backend, type) else type(backend)
    return issubclass(cls, SupportsHashedIO)


def _block_regions(regions: StorageRegionTable, block: int) -> list[memoryview]:
    """Engine block `block`'s bytes of every region of `regions`, in table order."""
    return [
        buf[start + block * step : start + block * step + size]
        for buf, start, size, step in regions
    ]


def _backend(obj: SupportsHashedIO) -> StorageBackend:
    if not isinstance(obj, StorageBackend):
        raise TypeError(f"{type(obj).__name__} mixes in SupportsHashedIO but is no StorageBackend")
    return obj


def copy_into(parts: Sequence[memoryview], data: bytes | memoryview) -> None:
    """Copy `data` into `parts` in order (vectored reads that had to go through one bytes
    object): the parts' sizes add up to its length."""
    at = 0
    for part in parts:
        view = memoryview(part).cast("B")
        view[:] = data[at : at + view.nbytes]
        at += view.nbytes


def open_backend(
    url: str, options: StorageBackendOptions, registry: PluginRegistry
) -> StorageBackend:
    """The backend registered (`kvx_storage_backends`) in `registry` for `url`'s scheme, opened
    on `url` (`kvx.open_storage_backend` is this with the registry defaulted)."""
    entry = registry.storage_backend_for_url(url)
    cls = registry.load_storage_backend(entry.name)
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise TypeError(
            f"storage backend {entry.name!r} ({entry.spec.target}) is not a subclass of "
            "kvx.StorageBackend; see docs/writing-a-storage-backend.md"
        )
    try:
        backend: StorageBackend = cls(url, options)
    except Exception as exc:  # unreachable, unwritable, missing extra, a URL fsspec chokes on
        problem = ConfigProblem(STORAGE_URL_KEY, f"cannot open {redact_url(url)!r}: {exc}")
        raise ConfigError([problem]) from None
    return backend


STORAGE_URL_KEY = "kv_connector_extra_config.storage_url"
"""Where a store that cannot be opened at start-up is reported."""
