"""The SQLite file every engine shares: one row per (stored block, worker rank)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import kvx

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS blocks (key TEXT, part TEXT, data BLOB, PRIMARY KEY (key, part))"
)


def open_store(directory: str, busy_timeout_s: float) -> sqlite3.Connection:
    """The store in `directory` (made private if new), in WAL mode: readers never wait for a
    writer, and a writer waits up to `busy_timeout_s` for another engine's write. The
    connection may be used from any thread, one at a time (the caller locks)."""
    kvx.make_private_dirs(directory)
    db = sqlite3.connect(
        Path(directory) / "kv.sqlite",
        timeout=busy_timeout_s,
        isolation_level=None,  # autocommit: a save is one explicit transaction
        check_same_thread=False,
    )
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(SCHEMA)
    except BaseException:
        db.close()
        raise
    return db
