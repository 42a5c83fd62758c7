"""Local-file backend: `file://` and `local://` URLs (and bare paths), values as files under
a private directory, moved with plain `os` calls and, for whole blocks, in native code."""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from types import ModuleType
from typing import Any

from fsspec.core import url_to_fs

import kvx
from kvx.plugins.storage.backends.base import BackendOptions, RegionTable, StorageBackend, copy_into
from kvx.plugins.storage.backends.segments import locate
from kvx.plugins.storage.backends.vectored import advance, byte_views, iov_max

_fileio: ModuleType | None
try:  # one-pass read + checksum (built when the system has xxhash.h)
    from kvx.plugins.storage import _fileio
except ImportError:  # pragma: no cover - every `make` install builds it
    _fileio = None

logger = logging.getLogger(__name__)

NOT_REGULAR = "not a regular file (a FIFO, device or socket is never read)"
A_LINK = "a symbolic link (values that are links are never followed)"
LINKED_OUT = "its directory leads out of the store through a symbolic link (never followed)"
SEGMENT_VALUES = 256
"""Values per segment file at most (a write call's batch is split into segments of this many)."""


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file `path`. O_NONBLOCK: opening a FIFO does not
    wait for a writer; anything but a regular file is refused (OSError), so a load never blocks
    on a special file planted in the store. O_NOFOLLOW: a value that is a symbolic link is
    refused (ELOOP), so no value is loaded from outside the store through one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, A_LINK, path) from None
        raise
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        return fd
    os.close(fd)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    raise OSError(errno.EINVAL, NOT_REGULAR, path)


class LocalFileBackend(kvx.SupportsHashedIO, kvx.SupportsListing, StorageBackend):
    """Values are files `<root>/<key>` under a private directory (0700), each written to a
    temporary name and renamed into place (`os.replace`): plain `os` calls, since fsspec's
    file objects cost more than writing a block does. Whole blocks move in native code
    (`_fileio`), checksummed in the same pass, several values to a segment file
    (`segments.py`); without the native module the mixin's Python defaults serve."""

    group_bytes = 1
    """Read one value per vectored call: no round trip to save, and the caller checks each
    value while it is in the CPU's cache."""

    def __init__(self, url: str, options: BackendOptions) -> None:
        self.url = url
        try:  # the path as fsspec reads it from a file:// or local:// URL
            _, root = url_to_fs(url)
        except (ImportError, ValueError, TypeError) as exc:
            raise ValueError(f"storage_url {url!r}: not a local path: {exc}") from None
        self.root = root.rstrip("/")
        self._dirs: set[str] = set()
        self._dirs_lock = threading.Lock()
        self._tmp_tag = uuid.uuid4().hex  # temporary names: unique per backend, then a serial
        self._tmp_serial = itertools.count()
        self.file_mode, self.dir_mode = options.file_mode, options.dir_mode
        kvx.make_private_dirs(self.root, self.dir_mode)
        self._real_root = os.path.realpath(self.root)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        self.put_vectored([(key, [value]) for key, value in items])

    def put_vectored(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        """Store each key's value: the concatenation of its buffers, in one `writev` from
        the buffers (no joined copy)."""
        for key, parts in items:
            self._put(self._path(key), partial(_write_all, parts=parts))

    def _put(self, path: str, write: Callable[[int], None]) -> None:
        """Create the local file `path` atomically: `write(fd)` fills a new temporary file
        beside it, which is then renamed into place (`os.replace`). A directory pruned since
        it was made is made again."""
        directory = path.rsplit("/", 1)[0]
        self._makedirs(directory)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        create = os.O_WRONLY | os.O_CREAT | os.O_EXCL  # a new file, never an existing one
        try:
            try:
                fd = os.open(tmp, create, self.file_mode)
            except FileNotFoundError:  # the directory was pruned since it was made
                with self._dirs_lock:
                    self._dirs.discard(directory)
                self._makedirs(directory)
                fd = os.open(tmp, create, self.file_mode)
            try:
                write(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            self._discard(tmp)
            raise

    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        return [self._get(key, max_bytes) for key in keys]

    def _get(self, key: str, max_bytes: int) -> bytes | None:
        path = self._path(key)
        try:
            self._check_inside(path)
            with open(open_regular(path), "rb", buffering=0) as raw:
                where = locate(raw.fileno(), os.fstat(raw.fileno()).st_size, key, path)
                if where is None:
                    return raw.read(max_bytes + 1)
                want = min(where.size, max_bytes + 1) - len(where.head)
                return where.head + os.pread(raw.fileno(), max(want, 0), where.offset)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("kvx storage: cannot read %s: %s", path, exc)
            return None

    def get_vectored(
        self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """Read each value into the concatenation of its buffers when it is exactly that long
        (otherwise they are untouched), in one `preadv`: per key the stored size (None where
        absent or unreadable)."""
        return [self._get_vectored(key, parts) for key, parts in zip(keys, buffers, strict=True)]

    def _get_vectored(self, key: str, parts: Sequence[memoryview]) -> int | None:
        total = sum(part.nbytes for part in parts)
        path = self._path(key)
        try:
            self._check_inside(path)
            fd = open_regular(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("kvx storage: cannot read %s: %s", path, exc)
            return None
        try:
            size, start, head = os.fstat(fd).st_size, 0, b""
            if size > total and (where := locate(fd, size, key, path)) is not None:
                start, size, head = where.offset, where.size, where.head  # in a segment file
            if size != total:
                return size
            views, i = byte_views(parts), 0
            if head:  # version 2: the value's header came from the segment's index
                copy_into(_cut(views, len(head)), head)
                i = advance(views, 0, len(head))
                start -= len(head)  # file offsets below count the header's bytes too
            got = len(head)
            while i < len(views):
                n = os.preadv(fd, views[i : i + _IOV_MAX], start + got)
                if n == 0:
                    break  # shorter than fstat said: reported as that size
                got += n
                i = advance(views, i, n)
            return got
        finally:
            os.close(fd)

    def put_blocks_hashed(
        self,
        keys: Sequence[str],
        seeds: Sequence[bytes],
        prefix: bytes,
        regions: RegionTable,
        blocks: Sequence[int],
    ) -> None:
        """`SupportsHashedIO.put_blocks_hashed` in native code without the GIL, checksummed as
        written; several values to a segment file."""
        if _fileio is None:  # pragma: no cover - every `make` install builds it
            super().put_blocks_hashed(keys, seeds, prefix, regions, blocks)
            return
        paths = [self._path(key) for key in keys]
        todo = list(range(len(keys)))
        for attempt in range(2):
            directories = {paths[i].rsplit("/", 1)[0] for i in todo}
            if attempt:  # pruned since they were made: made again
                with self._dirs_lock:
                    self._dirs.difference_update(directories)
            for directory in directories:
                self._makedirs(directory)
            errors = self._write_hashed(
                [paths[i] for i in todo],
                [keys[i] for i in todo],
                [seeds[i] for i in todo],
                prefix,
                regions,
                [blocks[i] for i in todo],
            )
            failed = [(i, e) for i, e in zip(todo, errors, strict=True) if e]
            todo = [i for i, e in failed if e == errno.ENOENT]
            if not failed or len(todo) < len(failed) or attempt:
                break
        if failed:
            i, error = failed[0]
            raise OSError(error, f"cannot store {paths[i]}: {os.strerror(error)}")

    def _write_hashed(
        self,
        paths: list[str],
        keys: list[str],
        seeds: list[bytes],
        prefix: bytes,
        regions: RegionTable,
        blocks: list[int],
    ) -> list[int]:
        """Per value 0 or the errno that stopped it. Several values go into segment files
        (one new inode per SEGMENT_VALUES values, not per value: `segments.py`), one alone
        into a file of its own."""
        native: Any = _fileio
        if len(paths) == 1:
            tmp = f"{paths[0]}.tmp-{self._tmp_tag}-{next(self._tmp_serial)}"
            return list(
                native.write_blocks(
                    paths, [tmp], seeds, prefix, regions, blocks, False, self.file_mode
                )
            )
        errors: list[int] = []
        for at in range(0, len(paths), SEGMENT_VALUES):
            part = slice(at, at + SEGMENT_VALUES)
            tmp = f"{paths[at]}.tmp-{self._tmp_tag}-{next(self._tmp_serial)}"
            errors += native.write_segment(
                paths[part],
                [key.encode() for key in keys[part]],
                tmp,
                seeds[part],
                prefix,
                regions,
                blocks[part],
                False,
                self.file_mode,
            )
        return errors

    def get_blocks_hashed(
        self,
        keys: Sequence[str],
        seeds: Sequence[bytes],
        skip: tuple[int, int],
        heads: Sequence[memoryview],
        regions: RegionTable,
        blocks: Sequence[int],
        checksum: bool = True,
    ) -> list[tuple[int | None, int | None]]:
        """`SupportsHashedIO.get_blocks_hashed` in native code without the GIL, checksummed in
        the same pass (without `checksum` a value moves in one `preadv`, nothing hashed)."""
        if _fileio is None:  # pragma: no cover - every `make` install builds it
            return super().get_blocks_hashed(keys, seeds, skip, heads, regions, blocks, checksum)
        native: Any = _fileio
        paths = [self._path(key) for key in keys]
        refused = {i for i, path in enumerate(paths) if self._linked_out(path)}
        if refused:  # read the others; those are misses (logged)
            out: list[tuple[int | None, int | None]] = [(None, None)] * len(keys)
            kept = [i for i in range(len(keys)) if i not in refused]
            got = self.get_blocks_hashed(
                [keys[i] for i in kept],
                [seeds[i] for i in kept],
                skip,
                [heads[i] for i in kept],
                regions,
                [blocks[i] for i in kept],
                checksum,
            )
            for i, result in zip(kept, got, strict=True):
                out[i] = result
            return out
        out = []
        for path, (size, digest, error) in zip(
            paths,
            native.read_blocks(
                paths,
                seeds,
                *skip,
                heads,
                regions,
                blocks,
                False,
                [k.encode() for k in keys],
                checksum,
            ),
            strict=True,
        ):
            if error and error != errno.ENOENT:
                why = {errno.EINVAL: NOT_REGULAR, errno.ELOOP: A_LINK}.get(
                    error, os.strerror(error)
                )
                logger.warning("kvx storage: cannot read %s: %s", path, why)
            out.append((size, digest))
        return out

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self._path(key)) for key in keys]  # a stat, no fsspec path logic

    def _linked_out(self, path: str) -> bool:
        """Whether the directory of value `path` resolves out of the store (logged)."""
        try:
            self._check_inside(path)
        except OSError as exc:
            logger.warning("kvx storage: cannot read %s: %s", path, exc.strerror)
            return True
        return False

    def _check_inside(self, path: str) -> None:
        """Refuse (OSError ELOOP) a value whose directory resolves out of the store's real path
        through a symbolic link: links planted in the store move no KV into it. A directory is
        checked once per backend (saves check theirs the same way)."""
        directory = path.rsplit("/", 1)[0]
        if directory in self._dirs:
            return
        real = os.path.realpath(directory)
        if real != self._real_root and not real.startswith(self._real_root + "/"):
            raise OSError(errno.ELOOP, LINKED_OUT, path)
        if os.path.isdir(real):  # not yet created ones are checked again next time
            with self._dirs_lock:
                self._dirs.add(directory)

    def _makedirs(self, directory: str) -> None:
        if directory in self._dirs:
            return
        kvx.make_private_dirs(directory, self.dir_mode)
        real = os.path.realpath(directory)
        if real != self._real_root and not real.startswith(self._real_root + "/"):
            raise OSError(
                errno.ELOOP,
                f"{directory} leads out of the store (to {real}) through a symbolic link; "
                "the store saves into no directory outside it",
            )
        with self._dirs_lock:
            self._dirs.add(directory)

    def _discard(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)

    def list_keys(self, prefix: str = "") -> Iterator[kvx.StoredEntry]:
        """`SupportsListing.list_keys`: the files under the root (temporary ones and symbolic
        links skipped); a value in a segment file has its own size, not the segment's."""
        for directory, dirs, files in os.walk(self.root):
            dirs.sort()
            for name in sorted(files):
                path = f"{directory}/{name}"
                key = path[len(self.root) + 1 :]
                if ".tmp-" in name or not key.startswith(prefix):
                    continue
                try:
                    with open(open_regular(path), "rb", buffering=0) as raw:
                        info = os.fstat(raw.fileno())
                        where = locate(raw.fileno(), info.st_size, key, path)
                except OSError:  # removed meanwhile, a link, unreadable
                    continue
                size = info.st_size if where is None else where.size
                yield kvx.StoredEntry(key, size, info.st_mtime)

    def delete_many(self, keys: Sequence[str]) -> int:
        """`SupportsListing.delete_many`: unlink each key's file (a segment file's other keys
        stay readable through their own links)."""
        removed = 0
        for key in keys:
            path = self._path(key)
            self._check_inside(path)  # no key removes a file outside the store
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
        return removed

    def close(self) -> None:
        """Nothing to release: no connections or threads."""


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Write the concatenation of `parts` to `fd` (vectored, resuming after short writes)."""
    views, i = byte_views(parts), 0
    while i < len(views):
        i = advance(views, i, os.writev(fd, views[i : i + _IOV_MAX]))


def _cut(views: list[memoryview], n: int) -> list[memoryview]:
    """The views covering the first `n` bytes of their concatenation (the last one cut)."""
    out: list[memoryview] = []
    for view in views:
        if n <= 0:
            break
        out.append(view[:n])
        n -= len(view)
    return out


_IOV_MAX = iov_max()
