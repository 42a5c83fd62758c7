"""A FIFO (or a link to one) planted at a value's path in a `file://` store never blocks a load:
the native and the Python readers open values with O_NONBLOCK and read only regular files,
so the load reports the value as unreadable at once instead of hanging the engine."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.fsspec_backend import FsspecBackend

pytestmark = pytest.mark.timeout(60)

KEYS = ["ns/fifo", "ns/link", "ns/good"]
SIZE = 64 + 2 * 64  # the value's header, then 2 regions of 64 bytes


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """`call()` on a thread; fails (instead of hanging the test) if it does not return."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for {seconds} s"
    return out[0]


@pytest.fixture
def planted(tmp_path: Path):
    store = tmp_path / "store"
    backend = FsspecBackend(f"file://{store}", BackendOptions())
    cache = bytearray(range(256)) * 1
    table = [(cache, 0, 64, 128), (cache, 64, 64, 128)]
    for key in KEYS:
        backend.put_blocks_hashed([key], [b""], b"p" * 56, table, [0])
    os.unlink(store / "ns/fifo")
    os.mkfifo(store / "ns/fifo")
    os.mkfifo(tmp_path / "outside-fifo")
    os.unlink(store / "ns/link")
    os.symlink(tmp_path / "outside-fifo", store / "ns/link")
    yield backend, table
    for fifo in (store / "ns/fifo", tmp_path / "outside-fifo"):  # free a reader stuck on one
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_the_native_reader_refuses_special_files_at_once(planted, caplog) -> None:
    caplog.set_level(logging.WARNING)
    backend, table = planted
    dst = bytearray(256)
    dst_table = [(dst, *rest) for _, *rest in table]
    heads = [bytearray(64) for _ in KEYS]
    out = within(
        10,
        lambda: backend.get_blocks_hashed(KEYS, [b""] * 3, (56, 64), heads, dst_table, [0, 1, 0]),
    )
    assert [size for size, _ in out] == [None, None, SIZE]
    assert "not a regular file" in caplog.text


def test_the_python_readers_refuse_special_files_at_once(planted, caplog) -> None:
    caplog.set_level(logging.WARNING)
    backend, _ = planted
    got = within(10, lambda: backend.get_many(KEYS, 1 << 20))
    assert got[:2] == [None, None] and got[2] is not None and len(got[2]) == SIZE
    buffers = [[memoryview(bytearray(SIZE))] for _ in KEYS]
    assert within(10, lambda: backend.get_vectored(KEYS, buffers)) == [None, None, SIZE]
    assert "not a regular file" in caplog.text
