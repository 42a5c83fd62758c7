"""fsspec backend: `memory://` and any other fsspec protocol (`s3://` with s3fs, `gs://`...);
local files have a backend of their own (`local_files.py`)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator, Sequence

import fsspec

import kvx
from kvx.plugins.storage.backends.base import BackendOptions, StorageBackend, copy_into

logger = logging.getLogger(__name__)

# Object stores and the in-memory filesystem replace a value in one put: no rename is needed
# (and renames there are copies). Everything else is written to a temporary name and renamed.
_ATOMIC_PUT = frozenset({"memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})
# s3fs uploads a value of two parts or more as a multipart upload, the parts in parallel (its
# own default part, 50 MiB, would leave every value under 100 MiB to one PUT)
S3_PART_BYTES = 16 << 20


class FsspecBackend(kvx.SupportsListing, StorageBackend):
    """Values are objects (files) `<root>/<key>` of the URL's fsspec filesystem: put in one
    request where a put is atomic (object stores, memory), else written to a temporary name
    and moved into place. A group of values (`group_bytes`) is one call's worth."""

    def __init__(self, url: str, options: BackendOptions) -> None:
        self.url = url
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **(options.storage_options or {}))
        except (ImportError, ValueError, TypeError) as exc:
            raise ValueError(f"storage_url {url!r}: fsspec cannot open it: {exc}") from None
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.atomic_put = bool(_ATOMIC_PUT.intersection(protocols))
        self._put_kwargs = {"chunksize": S3_PART_BYTES} if {"s3", "s3a"} & set(protocols) else {}
        self._dirs: set[str] = set()

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        self.put_vectored([(key, [value]) for key, value in items])

    def put_vectored(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        """Store each key's value, the concatenation of its buffers: one put where that is
        atomic, else a temporary file moved into place."""
        for key, parts in items:
            path = self._path(key)
            if self.atomic_put:
                self.fs.pipe_file(path, _joined(parts), **self._put_kwargs)
                continue
            self._makedirs(path.rsplit("/", 1)[0])
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            try:
                with self.fs.open(tmp, "wb") as f:
                    for part in parts:
                        f.write(part)
                self.fs.mv(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    self.fs.rm_file(tmp)
                raise

    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        return [self._get(key, max_bytes) for key in keys]

    def _get(self, key: str, max_bytes: int) -> bytes | None:
        path = self._path(key)
        try:
            # one ranged read: a file object would first ask for the size and version, then
            # read, and fail if a writer replaced the value in between (s3fs: ETag changed)
            data: bytes = self.fs.cat_file(path, start=0, end=max_bytes + 1)
            return data
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("kvx storage: cannot read %s: %s", path, exc)
            return None

    def get_vectored(
        self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """Read each value into the concatenation of its buffers when it is exactly that long
        (otherwise they are untouched): per key the stored size (None where absent or
        unreadable; a longer value is read only to the buffers' total + 1 and reported as
        that)."""
        sizes: list[int | None] = []
        for key, parts in zip(keys, buffers, strict=True):
            data = self._get(key, sum(part.nbytes for part in parts))
            if data is not None and len(data) == sum(part.nbytes for part in parts):
                copy_into(parts, data)
            sizes.append(None if data is None else len(data))
        return sizes

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        # TODO: one request per value on object stores (stages x shards per block); one
        # listing of the values' common prefix would answer a block's values at once
        return [bool(self.fs.exists(self._path(key))) for key in keys]

    def _makedirs(self, directory: str) -> None:
        if directory not in self._dirs:
            self.fs.makedirs(directory, exist_ok=True)
            self._dirs.add(directory)

    def list_keys(self, prefix: str = "") -> Iterator[kvx.StoredEntry]:
        """`SupportsListing.list_keys`: the filesystem's `find` under the root."""
        if not self.fs.exists(self.root):
            return
        for path, info in sorted(self.fs.find(self.root, detail=True).items()):
            key = path[len(self.root) + 1 :] if path.startswith(self.root + "/") else path
            if ".tmp-" in key or not key.startswith(prefix):
                continue
            yield kvx.StoredEntry(key, int(info.get("size") or 0), _modified(info))

    def delete_many(self, keys: Sequence[str]) -> int:
        """`SupportsListing.delete_many`: remove each key's object (object stores delete an
        absent key without an error, so each is looked up first)."""
        removed = 0
        for key in keys:
            path = self._path(key)
            if not self.fs.exists(path):
                continue
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)
                removed += 1
        return removed

    def close(self) -> None:
        """Nothing to release: fsspec filesystems hold no per-backend connections here."""


def _joined(parts: Sequence[bytes | memoryview]) -> bytes:
    """One body for a put (fsspec's `pipe_file` takes bytes): a value that is one bytes
    object as it is, else the parts joined."""
    # TODO: a value of several parts (header + KV regions) is copied once here; a body that
    # reads the parts in turn would let s3fs send them as they are (bench_s3.py measures it)
    if len(parts) == 1 and isinstance(parts[0], bytes):
        return parts[0]
    return b"".join(parts)


def _modified(info: dict[str, object]) -> float | None:
    """When a `find` entry was last written (Unix seconds), if its filesystem says."""
    for name in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(name)
        if isinstance(value, int | float):
            return float(value)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
    return None
