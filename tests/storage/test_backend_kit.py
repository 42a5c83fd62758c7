"""A backend written from docs/writing-a-storage-backend.md (values in SQLite, only the four
plain calls) passes the backend kit, and the kit fails a backend that breaks the API."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvx import StorageBackend, StorageBackendOptions
from kvx.conformance.storage_backend import StorageBackendTests


class SqliteBackend(StorageBackend):
    """Values in one SQLite table, `sqlite:///path/to/file.db`; one connection per thread."""

    def __init__(self, url: str, options: StorageBackendOptions) -> None:
        super().__init__(url, options)
        self.path = url.removeprefix("sqlite://")
        self.timeout_s = options.timeout_s
        self._local = threading.local()
        self._opened: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        db = self._db()
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB NOT NULL)")

    def _db(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self.timeout_s, check_same_thread=False)
            db.isolation_level = None  # autocommit; `put_many` opens its own transaction
            self._local.db = db
            with self._lock:
                self._opened.append(db)
        return db

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(
                "INSERT OR REPLACE INTO kv VALUES (?, ?)", [(k, bytes(v)) for k, v in items]
            )
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        db = self._db()
        query = "SELECT substr(value, 1, ?) FROM kv WHERE key = ?"
        rows = [db.execute(query, (max_bytes + 1, key)).fetchone() for key in keys]
        return [None if row is None else bytes(row[0]) for row in rows]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        db = self._db()
        return [
            db.execute("SELECT 1 FROM kv WHERE key = ?", (k,)).fetchone() is not None for k in keys
        ]

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
        for db in opened:
            db.close()


class TestSqliteBackend(StorageBackendTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[StorageBackend]:
        backend = SqliteBackend(f"sqlite://{tmp_path}/kv.db", StorageBackendOptions())
        yield backend
        backend.close()


class Padded(SqliteBackend):
    """Breaks the API: vectored reads fill buffers even when the value is longer."""

    def get_vectored(
        self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        sizes = []
        for key, parts in zip(keys, buffers, strict=True):
            (data,) = self.get_many([key], 1 << 30)
            at = 0
            for part in parts:
                view = memoryview(part).cast("B")
                view[:] = (data or b"")[at : at + view.nbytes].ljust(view.nbytes, b"\0")
                at += view.nbytes
            sizes.append(None if data is None else len(data))
        return sizes


def test_the_kit_fails_a_backend_that_fills_buffers_of_another_size(tmp_path: Path) -> None:
    kit = StorageBackendTests()
    backend = Padded(f"sqlite://{tmp_path}/kv.db", StorageBackendOptions())
    try:
        with pytest.raises(AssertionError):
            kit.test_vectored_reads_leave_buffers_of_another_total_untouched(backend, "ns")
        with pytest.raises(AssertionError):
            kit.test_get_into_fills_only_buffers_of_the_exact_size(backend, "ns2")
    finally:
        backend.close()
