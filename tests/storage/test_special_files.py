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
from kvx.plugins.storage.backends.local_files import LocalFileBackend

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
    backend = LocalFileBackend(f"file://{store}", BackendOptions())
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


def test_a_value_that_is_a_link_out_of_the_store_is_not_loaded(tmp_path: Path, caplog) -> None:
    """The policy: values that are symbolic links are never followed (native and Python)."""
    caplog.set_level(logging.WARNING)
    store, outside = tmp_path / "store", tmp_path / "outside"
    backend = LocalFileBackend(f"file://{store}", BackendOptions())
    theirs = LocalFileBackend(f"file://{outside}", BackendOptions())
    cache = bytearray(range(256))
    table = [(cache, 0, 64, 128), (cache, 64, 64, 128)]
    theirs.put_blocks_hashed(["ns/secret"], [b""], b"p" * 56, table, [0])
    backend.put_blocks_hashed(["ns/own"], [b""], b"p" * 56, table, [0])
    os.symlink(outside / "ns/secret", store / "ns/linked")
    keys = ["ns/linked", "ns/own"]
    dst = bytearray(256)
    heads = [bytearray(64) for _ in keys]
    out = backend.get_blocks_hashed(
        keys, [b""] * 2, (56, 64), heads, [(dst, *r) for _, *r in table], [0, 1]
    )
    assert [size for size, _ in out] == [None, SIZE]
    assert dst[:64] == bytes(64) and dst[64:128] == bytes(64)  # block 0: nothing read into it
    assert backend.get_many(keys, 1 << 20)[0] is None
    buffers = [[memoryview(bytearray(SIZE))] for _ in keys]
    assert backend.get_vectored(keys, buffers) == [None, SIZE]
    assert caplog.text.count("a symbolic link (values that are links are never followed)") >= 3


def test_a_shard_directory_linked_out_of_the_store_receives_no_save(tmp_path: Path) -> None:
    store, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    store.mkdir()
    os.symlink(outside, store / "ns")
    backend = LocalFileBackend(f"file://{store}", BackendOptions())
    cache = bytearray(range(256))
    table = [(cache, 0, 64, 128), (cache, 64, 64, 128)]
    with pytest.raises(OSError, match=r"leads out of the store .* through a symbolic link"):
        backend.put_blocks_hashed(["ns/a"], [b""], b"p" * 56, table, [0])
    with pytest.raises(OSError, match="leads out of the store"):
        backend.put_many([("ns/b", b"value")])
    assert list(outside.iterdir()) == []  # nothing written there
    (store / "inside").mkdir()
    os.symlink(store / "inside", store / "ns2")  # a link that stays in the store is fine
    backend.put_many([("ns2/c", b"value")])
    assert (store / "inside" / "c").read_bytes() == b"value"


def test_a_shard_directory_linked_out_of_the_store_is_not_read(tmp_path: Path, caplog) -> None:
    """The read side of the policy: a D that never saved into a shard directory planted as a
    link out of the store loads nothing through it (native and Python readers); a directory
    link that stays inside the store is read."""
    caplog.set_level(logging.WARNING)
    store, outside = tmp_path / "store", tmp_path / "outside"
    theirs = LocalFileBackend(f"file://{outside}", BackendOptions())
    cache = bytearray(range(256))
    table = [(cache, 0, 64, 128), (cache, 64, 64, 128)]
    theirs.put_blocks_hashed(["ns/v"], [b""], b"p" * 56, table, [0])
    backend = LocalFileBackend(f"file://{store}", BackendOptions())
    backend.put_blocks_hashed(["own/v"], [b""], b"p" * 56, table, [0])
    os.symlink(outside / "ns", store / "ns")
    os.symlink(store / "own", store / "alias")  # stays inside the store
    keys = ["ns/v", "alias/v"]
    dst = bytearray(256)
    heads = [bytearray(64) for _ in keys]
    out = backend.get_blocks_hashed(
        keys, [b""] * 2, (56, 64), heads, [(dst, *r) for _, *r in table], [0, 1]
    )
    assert [size for size, _ in out] == [None, SIZE]
    assert dst[:128] == bytes(128) and dst[128:] == cache[:128]  # only the inside one read
    assert backend.get_many(keys, 1 << 20)[0] is None
    assert backend.get_many(keys, 1 << 20)[1] is not None
    buffers = [[memoryview(bytearray(SIZE))] for _ in keys]
    assert backend.get_vectored(keys, buffers) == [None, SIZE]
    assert buffers[0][0].tobytes() == bytes(SIZE)
    assert caplog.text.count("leads out of the store through a symbolic link") >= 3
