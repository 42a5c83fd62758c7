"""The small protocol every storage backend implements, and opening one by URL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import kvx


@dataclass(frozen=True)
class BackendOptions:
    """What the connector's config says about IO (backends ignore what does not apply)."""

    ttl_s: int | None = None
    timeout_s: float = 10.0
    file_mode: int = 0o600
    """Mode of new local files and (with the execute bits added) directories."""

    @property
    def dir_mode(self) -> int:
        return self.file_mode | (self.file_mode & 0o444) >> 2


RegionTable = Sequence[tuple[memoryview, int, int, int]]
"""Where engine blocks lie in the KV cache: per region of a block (buffer, start, size, step),
block b's bytes of that region being `buffer[start + b * step:][:size]`; a block's value
payload is its regions in table order."""


class StorageBackend(Protocol):
    """A flat key -> bytes store. Keys are `/`-separated strings of safe characters.

    Every value is written atomically: a reader sees it whole or not at all. Methods may be
    called from several threads at once. A backend may also offer
    `get_into(keys, buffers) -> list[int | None]` (read each value into a preallocated
    buffer when it is exactly that long; per key the stored size, None if absent): the
    connector then reads without an extra copy (the built-in backends do). Vectored IO lets
    the connector move a value straight between the store and the KV cache's blocks:
    `put_vectored(items)` stores each `(key, buffers)` as the concatenation of its buffers,
    `get_vectored(keys, buffers) -> list[int | None]` reads each value into its buffers in
    order when it is exactly their total length (otherwise they stay untouched), and
    `group_bytes` says how many bytes of values are worth one call (a round trip). Local files
    (`hashed_io`) also move whole batches of values between files and engine blocks given by a
    `RegionTable`, checksummed in the same pass (`put_blocks_hashed`, `get_blocks_hashed`).
    """

    url: str

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Store every `(key, value)`; raise on failure (values already written may stay)."""

    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        """The values of `keys` (None where absent or unreadable); a value longer than
        `max_bytes` may come back truncated to `max_bytes + 1` bytes."""

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a value."""

    def close(self) -> None:
        """Release connections and threads."""


def copy_into(parts: Sequence[memoryview], data: bytes | memoryview) -> None:
    """Copy `data` into `parts` in order (vectored reads that had to go through one bytes
    object): the parts' sizes add up to its length."""
    at = 0
    for part in parts:
        part.cast("B")[:] = data[at : at + part.nbytes]
        at += part.nbytes


def open_backend(url: str, options: BackendOptions) -> StorageBackend:
    """The backend registered (`kvx_storage_backends`) for `url`'s scheme, opened on `url`."""
    registry = kvx.get_registry()
    entry = registry.storage_backend_for_url(url)
    cls = registry.load_storage_backend(entry.name)
    try:
        backend: StorageBackend = cls(url, options)
    except (OSError, ValueError, ImportError) as exc:  # unreachable, unwritable, missing extra
        raise kvx.ConfigError(
            [kvx.ConfigProblem(STORAGE_URL_KEY, f"cannot open {_shown(url)}: {exc}")]
        ) from None
    return backend


STORAGE_URL_KEY = "kv_connector_extra_config.storage_url"


def _shown(url: str) -> str:
    """`url` for a message, without a password."""
    parts = urlsplit(url)
    return repr(url if parts.password is None else url.replace(parts.password, "***"))
