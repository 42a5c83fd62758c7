"""How the native reader opens a batch's files (`_fileread.c`): a segment file is kept open for
its next values only while each value's path still names it, and paths are looked up from the
batch's common directory."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvx.plugins.storage import _fileio
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.local_files import LocalFileBackend

SIZE = 600  # bytes of a block's K (and of its V)
BLOCKS = 48
VALUE = 64 + 2 * SIZE  # a header, then K and V of one block


def _cache(fill: bool) -> tuple[bytearray, list[tuple[bytearray, int, int, int]]]:
    """K of every block, then V of every block (a pattern, or zeros); the table: K then V."""
    n = 2 * BLOCKS * SIZE
    cache = bytearray((i * 7 + 3) % 251 for i in range(n)) if fill else bytearray(n)
    return cache, [(cache, 0, SIZE, SIZE), (cache, BLOCKS * SIZE, SIZE, SIZE)]


def _body(cache: bytearray, block: int) -> bytes:
    return bytes(cache[block * SIZE :][:SIZE] + cache[(BLOCKS + block) * SIZE :][:SIZE])


def _store(backend: LocalFileBackend, keys: list[str], blocks: list[int], prefix: bytes) -> bytes:
    """Write `keys` from `blocks` of the source cache (one segment file, or a plain file for a
    single key), headers starting with `prefix`; the source cache's bytes."""
    src, table = _cache(fill=True)
    seeds = [key.encode() + prefix for key in keys]
    backend.put_blocks_hashed(keys, seeds, prefix, table, blocks)
    return bytes(src)


def _read(backend: LocalFileBackend, keys: list[str]) -> tuple[list, list[bytearray], bytearray]:
    """Read `keys` into blocks 0, 1, ... of a zeroed cache: per key (size, digest), the
    headers, the cache."""
    dst, table = _cache(fill=False)
    heads = [bytearray(64) for _ in keys]
    out = backend.get_blocks_hashed(
        keys, [k.encode() for k in keys], (56, 64), heads, table, list(range(len(keys)))
    )
    return out, heads, dst


def _check(
    read: tuple[list, list[bytearray], bytearray], src: bytes, want: list[tuple[bytes, int] | None]
) -> None:
    """Key i was read whole into block i with the header prefix and source block of want[i]
    (None: not read, its block left zero); every other block is zero."""
    out, heads, dst = read
    for block in range(BLOCKS):
        expected = want[block] if block < len(want) else None
        if expected is None:
            assert _body(dst, block) == bytes(2 * SIZE), block
            continue
        prefix, source = expected
        size, digest = out[block]
        assert size == VALUE and digest == int.from_bytes(heads[block][56:], "little"), block
        assert bytes(heads[block][:56]) == prefix, block
        assert _body(dst, block) == _body(bytearray(src), source), block


def test_a_key_relinked_to_another_segment_is_read_from_that_file(tmp_path: Path) -> None:
    """`ns/b` is listed in the index of the segment its batch neighbours are read from, but
    its path now names a newer segment: it is read from that one (and `ns/c` from the first
    again)."""
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    old, new = b"p" * 56, b"q" * 56
    src = _store(backend, ["ns/a", "ns/b", "ns/c"], [0, 1, 2], old)
    assert _store(backend, ["ns/b", "ns/d"], [3, 4], new) == src
    first = (tmp_path / "ns/a").stat().st_ino
    assert (tmp_path / "ns/c").stat().st_ino == first != (tmp_path / "ns/b").stat().st_ino
    _check(_read(backend, ["ns/a", "ns/b", "ns/c"]), src, [(old, 0), (new, 3), (old, 2)])
    _check(_read(backend, ["ns/b", "ns/a", "ns/d"]), src, [(new, 3), (old, 0), (new, 4)])


def test_a_segment_replaced_between_values_is_not_read_stale(tmp_path: Path) -> None:
    """Keys of one segment, one replaced by a plain value file and one removed: each is read
    from what its path names, and the segment's other values still from the segment."""
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    old, new = b"p" * 56, b"r" * 56
    src = _store(backend, ["ns/a", "ns/b", "ns/c", "ns/d"], [0, 1, 2, 3], old)
    _store(backend, ["ns/b"], [5], new)  # a batch of one: a plain file
    assert (tmp_path / "ns/b").stat().st_size == VALUE
    (tmp_path / "ns/c").unlink()
    read = _read(backend, ["ns/a", "ns/b", "ns/c", "ns/d"])
    assert read[0][2] == (None, None)
    _check(read, src, [(old, 0), (new, 5), None, (old, 3)])
    _store(backend, ["ns/a"], [4], new)
    _check(_read(backend, ["ns/d", "ns/a", "ns/b"]), src, [(old, 3), (new, 4), (new, 5)])


def test_paths_are_found_from_their_common_directory_whatever_they_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names that share text past their last common directory (`x/a/...`, `x/ab/...`),
    doubled slashes, relative paths, and a common directory that does not exist."""
    src, table = _cache(fill=True)
    monkeypatch.chdir(tmp_path)
    names = ["x/a/v", "x/ab/v", "x//ab/w"]
    for name in ("x/a", "x/ab"):
        Path(name).mkdir(parents=True)
    prefix = b"P" * 56
    seeds = [b"s" + prefix] * 3
    blocks = [4, 1, 2]
    tmps = [f"{name}.tmp" for name in ("x/a/v", "x/ab/v", "x/ab/w")]
    assert _fileio.write_blocks(names, tmps, seeds, prefix, table, blocks) == [0, 0, 0]
    for paths in (names, [str(tmp_path / name) for name in names]):
        dst, dst_table = _cache(fill=False)
        heads = [bytearray(64) for _ in paths]
        out = _fileio.read_blocks(paths, [b"s"] * 3, 56, 64, heads, dst_table, [0, 1, 2])
        assert [(size, error) for size, _, error in out] == [(VALUE, 0)] * 3
        for block, (source, head, (_, digest, _)) in enumerate(
            zip(blocks, heads, out, strict=True)
        ):
            assert digest == int.from_bytes(head[56:], "little")
            assert _body(dst, block) == _body(src, source)
    out = _fileio.read_blocks(
        ["nowhere/a", "nowhere/b"], [b"", b""], 0, 0, [bytearray(64)] * 2, table, [0, 1]
    )
    assert out == [(None, None, errno.ENOENT)] * 2


def test_values_past_the_lookahead_of_a_kept_segment_are_each_checked(tmp_path: Path) -> None:
    """A batch of 40 values of one segment (paths are looked up 32 at a time while it is kept
    open): keys re-linked to another segment, or removed, on both sides of the 32nd are read
    from what their paths name."""
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    old, new = b"p" * 56, b"q" * 56
    keys = [f"ns/{i:02d}/v" for i in range(40)]
    src = _store(backend, keys, list(range(40)), old)
    _store(backend, [keys[5], keys[35]], [41, 42], new)
    for gone in (keys[20], keys[32]):
        (tmp_path / gone).unlink()
    want: list[tuple[bytes, int] | None] = [(old, i) for i in range(40)]
    want[5], want[35], want[20], want[32] = (new, 41), (new, 42), None, None
    read = _read(backend, keys)
    assert [read[0][i] for i in (20, 32)] == [(None, None)] * 2
    _check(read, src, want)
