"""`StorageBackend`: the key -> bytes store a storage connector keeps KV blocks in.

A backend implements four plain calls (`put_many`, `get_many`, `exists_many`, `close`); the
calls that move values straight between the store and caller's buffers (`get_into`,
`put_vectored`, `get_vectored`) have defaults built on the plain ones, which a fast backend
overrides to skip the copies. Local-file backends may also claim `hashed_io` and move whole
batches of blocks between files and the KV cache, checksummed in the same pass.

A plugin registers a backend class for URL schemes (`kvx_storage_backends` returning
`StorageBackendSpec`); `open_storage_backend(url, options, registry)` builds the one registered
for a URL's scheme as `cls(url, options)`. See docs/writing-a-storage-backend.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvx.errors import ConfigError, ConfigProblem
from kvx.types import PluginRegistry


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

    hashed_io: bool = False
    """True if the backend implements `put_blocks_hashed` / `get_blocks_hashed` (local files
    in native code); the connector then uses them for blocks that move without conversion."""

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

    def put_blocks_hashed(
        self,
        keys: Sequence[str],
        seeds: Sequence[bytes],
        prefix: bytes,
        regions: StorageRegionTable,
        blocks: Sequence[int],
    ) -> None:
        """Store key i as a header (`prefix`, then XXH3-64 of `seeds[i]` and the payload,
        little-endian) and the payload: the regions of engine block `blocks[i]`, checksummed
        as written. Only where `hashed_io` is True."""
        raise NotImplementedError(f"{type(self).__name__} does not claim hashed_io")

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
        `checksum` False, when nothing is hashed). Only where `hashed_io` is True."""
        raise NotImplementedError(f"{type(self).__name__} does not claim hashed_io")


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
        shown = (
            url if (password := urlsplit(url).password) is None else url.replace(password, "***")
        )
        problem = ConfigProblem(STORAGE_URL_KEY, f"cannot open {shown!r}: {exc}")
        raise ConfigError([problem]) from None
    return backend


STORAGE_URL_KEY = "kv_connector_extra_config.storage_url"
"""Where a store that cannot be opened at start-up is reported."""
