"""The native one-pass read + checksum of local files (`kvx.plugins.storage._fileio`)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
import xxhash

from kvx.plugins.storage import (
    _fileio,  # not built: this file fails to import, as it should
    blockformat,
)
from kvx.plugins.storage.backends import fsspec_backend
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.fsspec_backend import FsspecBackend
from kvx.plugins.storage.blockformat import BlockShape


def test_the_native_reader_is_built_and_used_for_local_files(tmp_path: Path) -> None:
    # `make` installs libxxhash-dev before building kvx: every install it makes has it.
    assert _fileio.vector() in ("avx2", "baseline")
    assert FsspecBackend(f"file://{tmp_path}", BackendOptions()).hashed_io
    assert not FsspecBackend("memory://kvx-fileio", BackendOptions()).hashed_io


def _expected(seed: bytes, data: bytes, skip: tuple[int, int]) -> int:
    hasher = xxhash.xxh3_64(seed)
    hasher.update(data[: skip[0]])
    hasher.update(data[skip[1] :])
    return int(hasher.intdigest())


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 4097, 300_000, 3_000_001])
@pytest.mark.parametrize("baseline", [False, True])
def test_reads_into_the_buffers_and_hashes_all_but_the_skipped_bytes(
    size: int, baseline: bool, tmp_path: Path
) -> None:
    data = os.urandom(size)
    path = tmp_path / "value"
    path.write_bytes(data)
    cuts = sorted({0, min(size, 64), min(size, 5000), size // 2, size})
    buffers = [bytearray(b - a) for a, b in itertools.pairwise(cuts)]
    buffers.insert(1, bytearray())  # empty buffers are allowed anywhere
    fd = os.open(path, os.O_RDONLY)
    try:
        got, digest = _fileio.read_hashed(fd, b"key", 56, 64, buffers, baseline)
    finally:
        os.close(fd)
    assert got == size and b"".join(buffers) == data
    assert digest == _expected(b"key", data, (56, 64))


def test_a_short_file_fills_what_it_has_and_a_bad_descriptor_raises(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 10)
    buffer = bytearray(b"\0" * 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        got, digest = _fileio.read_hashed(fd, b"", 0, 0, [buffer])
    finally:
        os.close(fd)
    assert (
        got == 10
        and buffer == b"x" * 10 + b"\0" * 10
        and digest == _expected(b"", b"x" * 10, (0, 0))
    )
    with pytest.raises(OSError):
        _fileio.read_hashed(-1, b"", 0, 0, [bytearray(4)])
    with pytest.raises(BufferError):
        _fileio.read_hashed(0, b"", 0, 0, [b"read-only"])


def test_backend_reports_sizes_and_checksums(tmp_path: Path) -> None:
    backend = FsspecBackend(f"file://{tmp_path}", BackendOptions())
    payload = torch.arange(4096, dtype=torch.float32)
    backend.put_vectored([("ns/a", [b"h" * 64, payload.numpy().data])])
    dst = torch.zeros(4096, dtype=torch.float32)
    head = bytearray(64)
    wrong = bytearray(10)
    out = backend.get_vectored_hashed(
        ["ns/a", "ns/missing", "ns/a"],
        [[memoryview(head), dst.numpy().data], [memoryview(bytearray(4))], [memoryview(wrong)]],
        [b"ns/a", b"ns/missing", b"ns/a"],
        (56, 64),
    )
    data = b"h" * 64 + payload.numpy().tobytes()
    assert out == [(len(data), _expected(b"ns/a", data, (56, 64))), (None, None), (len(data), None)]
    assert torch.equal(dst, payload) and head == b"h" * 64
    assert wrong == bytearray(10)  # a value of another size is not read


def test_without_the_native_module_the_backend_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fsspec_backend, "_fileio", None)
    backend = FsspecBackend(f"file://{tmp_path}", BackendOptions())
    assert not backend.hashed_io
    with pytest.raises(RuntimeError, match="one-pass checksummed IO needs local files"):
        backend.get_vectored_hashed(["ns/a"], [[memoryview(bytearray(1))]], [b""], (0, 0))


@pytest.mark.parametrize("size", [0, 1, 4097, 3_000_001])
@pytest.mark.parametrize("baseline", [False, True])
def test_writes_the_buffers_after_the_head_and_hashes_them(
    size: int, baseline: bool, tmp_path: Path
) -> None:
    data = os.urandom(size)
    cuts = sorted({0, min(size, 7), size // 2, size})
    parts = [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)] + [memoryview(b"")]
    path = tmp_path / "value"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        digest = _fileio.write_hashed(fd, b"seed", 64, parts, baseline)
    finally:
        os.close(fd)
    # the head is the caller's to write (an empty payload writes nothing at all)
    assert path.read_bytes() == (b"\0" * 64 + data if size else b"")
    assert digest == _expected(b"seed", data, (0, 0))
    with pytest.raises(OSError):
        _fileio.write_hashed(-1, b"", 0, [b"x"])


def test_backend_writes_head_then_payload_atomically(tmp_path: Path) -> None:
    backend = FsspecBackend(f"file://{tmp_path}", BackendOptions())
    payload = [torch.arange(1000, dtype=torch.float32).numpy().data, memoryview(b"tail")]
    heads: list[tuple[int, int]] = []

    def head(i: int, digest: int) -> bytes:
        heads.append((i, digest))
        return digest.to_bytes(8, "little") * 2

    backend.put_vectored_hashed([("ns/a", b"seed", payload)], 16, head)
    body = bytes(payload[0]) + b"tail"
    digest = _expected(b"seed", body, (0, 0))
    assert heads == [(0, digest)]
    assert (tmp_path / "ns" / "a").read_bytes() == digest.to_bytes(8, "little") * 2 + body
    assert not list((tmp_path / "ns").glob("*.tmp-*"))
    with pytest.raises(ValueError, match="head is 3 bytes, not 16"):
        backend.put_vectored_hashed([("ns/b", b"", payload)], 16, lambda i, d: b"abc")
    assert not (tmp_path / "ns" / "b").exists() and not list((tmp_path / "ns").glob("*.tmp-*"))


def test_hash_buffers_matches_xxhash_and_the_format_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parts = [os.urandom(5000), b"", bytearray(os.urandom(123)), memoryview(os.urandom(99))[3:]]
    assert _fileio.hash_buffers(parts) == _expected(b"".join(parts), b"", (0, 0))
    shape = BlockShape("bfloat16", 16, 2, 8, range(8), 32)
    payload = [memoryview(os.urandom(shape.payload_bytes))]
    native = blockformat.header("ns/k", shape, payload)
    monkeypatch.setattr(blockformat, "_hash_buffers", None)  # the pure-Python path
    assert blockformat.header("ns/k", shape, payload) == native
