"""The native one-pass write / read + checksum of local files (`kvx.plugins.storage._fileio`)."""

from __future__ import annotations

import errno
import itertools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import xxhash

import kvx
from kvx.plugins.storage import (
    _fileio,  # not built: this file fails to import, as it should
    blockformat,
)
from kvx.plugins.storage.backends import local_files, segments
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.fsspec_backend import FsspecBackend
from kvx.plugins.storage.backends.local_files import LocalFileBackend
from kvx.plugins.storage.blockformat import BlockShape


def test_the_native_reader_is_built_and_used_for_local_files(tmp_path: Path) -> None:
    # The module builds against the vendored xxhash.h: every install with a C compiler has it.
    assert _fileio.vector() in ("avx2", "baseline")
    assert kvx.supports_hashed_io(LocalFileBackend(f"file://{tmp_path}", BackendOptions()))
    assert not kvx.supports_hashed_io(FsspecBackend("memory://kvx-fileio", BackendOptions()))


def _expected(seed: bytes, data: bytes, skip: tuple[int, int]) -> int:
    hasher = xxhash.xxh3_64(seed)
    hasher.update(data[: skip[0]])
    hasher.update(data[skip[1] :])
    return int(hasher.intdigest())


def _pieces(size: int, cut: int) -> tuple[bytearray, list[tuple[bytearray, int, int, int]]]:
    """A head of up to `cut` bytes and a region table (block 0 only) of buffers whose sizes
    add up to `size`, with empty regions among them."""
    cuts = sorted({0, min(size, cut), min(size, 5000), size // 2, size})
    head = bytearray(cuts[1] if len(cuts) > 1 else 0)
    table = [(bytearray(b - a), 0, b - a, 0) for a, b in itertools.pairwise(cuts[1:])]
    table.insert(0, (bytearray(), 0, 0, 0))
    return head, table


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 4097, 300_000, 3_000_001])
@pytest.mark.parametrize("baseline", [False, True])
def test_reads_into_head_and_regions_and_hashes_all_but_the_skipped_bytes(
    size: int, baseline: bool, tmp_path: Path
) -> None:
    data = os.urandom(size)
    path = tmp_path / "value"
    path.write_bytes(data)
    head, table = _pieces(size, 64)
    out = _fileio.read_blocks([str(path)], [b"key"], 56, 64, [head], table, [0], baseline)
    assert out == [(size, _expected(b"key", data, (56, 64)), 0)]
    assert bytes(head) + b"".join(bytes(buf) for buf, *_ in table) == data


def _cache(blocks: int, size: int) -> tuple[bytearray, list[tuple[bytearray, int, int, int]]]:
    """A cache of `blocks` blocks laid out K of every block, then V of every block (`size`
    bytes each), filled with a pattern; its table: K then V of a block."""
    cache = bytearray(bytes(range(256)) * (2 * blocks * size // 256 + 1))[: 2 * blocks * size]
    return cache, [(cache, 0, size, size), (cache, blocks * size, size, size)]


def test_block_addressing_touches_only_the_blocks_given(tmp_path: Path) -> None:
    src, table = _cache(6, 1000)
    paths = [str(tmp_path / name) for name in ("a", "b")]
    tmps = [f"{path}.tmp" for path in paths]
    seeds = [b"s1" + b"P" * 8, b"s2" + b"P" * 8]  # as the format's: key, then the prefix
    assert _fileio.write_blocks(paths, tmps, seeds, b"P" * 8, table, [4, 1]) == [0, 0]
    for path, block, seed in zip(paths, [4, 1], seeds, strict=True):
        body = src[block * 1000 : (block + 1) * 1000] + src[(6 + block) * 1000 :][:1000]
        digest = _expected(seed, bytes(body), (0, 0))
        assert Path(path).read_bytes() == b"P" * 8 + digest.to_bytes(8, "little") + body
    assert not list(tmp_path.glob("*.tmp"))
    dst, dst_table = _cache(6, 1000)
    dst[:] = b"\xee" * len(dst)
    heads = [bytearray(16), bytearray(16)]
    out = _fileio.read_blocks(paths, [b"s1", b"s2"], 8, 16, heads, dst_table, [0, 5])
    assert [(size, error) for size, _, error in out] == [(2016, 0), (2016, 0)]
    for (_, digest, _), head in zip(out, heads, strict=True):
        assert digest == int.from_bytes(head[8:], "little")  # the stored checksum
    for block in range(6):  # blocks 0 and 5 hold what blocks 4 and 1 held; the rest untouched
        for half in (0, 6):
            got = dst[(half + block) * 1000 :][:1000]
            want = {0: 4, 5: 1}.get(block)
            expected = src[(half + want) * 1000 :][:1000] if want is not None else b"\xee" * 1000
            assert got == expected, (block, half)


def test_values_of_another_size_are_not_read_and_failures_are_reported(tmp_path: Path) -> None:
    (tmp_path / "short").write_bytes(b"x" * 10)
    head, region = bytearray(4), bytearray(b"\0" * 20)
    table = [(region, 0, 20, 0)]
    out = _fileio.read_blocks(
        [str(tmp_path / "short"), str(tmp_path / "missing")],
        [b"", b""],
        0,
        0,
        [head, bytearray(4)],
        table,
        [0, 0],
    )
    assert out == [(10, None, 0), (None, None, errno.ENOENT)]
    assert region == b"\0" * 20 and head == bytearray(4)  # nothing read
    with pytest.raises(BufferError):
        _fileio.read_blocks(["x"], [b""], 0, 0, [b"head"], table, [0])
    with pytest.raises(BufferError):
        _fileio.read_blocks(["x"], [b""], 0, 0, [bytearray(4)], [(b"read-only", 0, 1, 0)], [0])
    with pytest.raises(ValueError, match="block 3 is outside region 0"):
        _fileio.read_blocks(["x"], [b""], 0, 0, [bytearray(4)], [(region, 0, 10, 5)], [3])
    with pytest.raises(ValueError, match="block -1 is outside"):
        _fileio.write_blocks(["x"], ["x.tmp"], [b""], b"", [(region, 0, 10, 5)], [-1])
    with pytest.raises(ValueError, match="argument 3 has 2 items, not 1"):
        _fileio.write_blocks(["x"], ["x.tmp"], [b"", b""], b"", table, [0])
    with pytest.raises(TypeError, match="a region is"):
        _fileio.write_blocks(["x"], ["x.tmp"], [b""], b"", [(region, 0)], [0])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("size", [0, 1, 4097, 3_000_001])
@pytest.mark.parametrize("baseline", [False, True])
def test_writes_prefix_checksum_then_regions_and_renames(
    size: int, baseline: bool, tmp_path: Path
) -> None:
    _, table = _pieces(size, 7)  # regions of all but the first 7 bytes
    for buf, *_ in table:
        buf[:] = os.urandom(len(buf))
    data = b"".join(bytes(buf) for buf, *_ in table)
    path, tmp = tmp_path / "value", tmp_path / "value.tmp-1"
    assert _fileio.write_blocks(
        [str(path)], [str(tmp)], [b"seed"], b"HDR", table, [0], baseline
    ) == [0]
    digest = _expected(b"seed", data, (0, 0))
    assert path.read_bytes() == b"HDR" + digest.to_bytes(8, "little") + data
    assert not tmp.exists()


def test_a_write_that_cannot_start_reports_its_errno_and_leaves_no_file(tmp_path: Path) -> None:
    table = [(bytearray(b"payload"), 0, 7, 0)]
    taken = tmp_path / "taken.tmp"
    taken.write_bytes(b"someone else's")
    out = _fileio.write_blocks(
        [str(tmp_path / "a"), str(tmp_path / "gone" / "b"), str(tmp_path / "c")],
        [str(taken), str(tmp_path / "gone" / "b.tmp"), str(tmp_path / "c.tmp")],
        [b"", b"", b""],
        b"",
        table,
        [0, 0, 0],
    )
    assert out == [errno.EEXIST, errno.ENOENT, 0]  # the others are still written
    assert taken.read_bytes() == b"someone else's" and not (tmp_path / "a").exists()
    assert (tmp_path / "c").read_bytes()[8:] == b"payload"


def test_backend_round_trip_sizes_and_checksums(tmp_path: Path) -> None:
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    src, table = _cache(3, 4096)
    seeds = [b"ns/a" + b"p" * 56, b"ns/b" + b"p" * 56]
    backend.put_blocks_hashed(["ns/a", "ns/b"], seeds, b"p" * 56, table, [2, 0])
    assert not list((tmp_path / "ns").glob("*.tmp-*"))
    dst, dst_table = _cache(3, 4096)
    dst[:] = bytes(len(dst))
    heads = [bytearray(64) for _ in range(3)]
    (tmp_path / "ns" / "short").write_bytes(b"x")
    out = backend.get_blocks_hashed(
        ["ns/a", "ns/missing", "ns/short"],
        [b"ns/a", b"", b""],
        (56, 64),
        heads,
        dst_table,
        [1, 0, 2],
    )
    body = src[2 * 4096 :][:4096] + src[5 * 4096 :][:4096]
    assert out == [
        (64 + 8192, _expected(b"ns/a", b"p" * 56 + bytes(8) + body, (56, 64))),
        (None, None),
        (1, None),
    ]
    assert out[0][1] == int.from_bytes(heads[0][56:], "little")
    assert (
        dst[4096:8192] == src[2 * 4096 :][:4096]
        and dst[4 * 4096 :][:4096] == src[5 * 4096 :][:4096]
    )
    assert dst[:4096] == bytes(4096) and dst[2 * 4096 : 4 * 4096] == bytes(8192)


def test_backend_remakes_a_pruned_directory_and_raises_other_errors(tmp_path: Path) -> None:
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    table = [(bytearray(b"data"), 0, 4, 0)]
    backend.put_blocks_hashed(["ns/x/a"], [b""], b"", table, [0])
    shutil.rmtree(tmp_path / "ns")  # pruned by someone else: made again
    backend.put_blocks_hashed(["ns/x/b"], [b""], b"", table, [0])
    assert (tmp_path / "ns" / "x" / "b").read_bytes()[8:] == b"data"
    (tmp_path / "ns" / "x" / "c").mkdir()  # a directory where the value goes: rename fails
    with pytest.raises(OSError, match=r"cannot store .*ns/x/c: Is a directory"):
        backend.put_blocks_hashed(["ns/x/c"], [b""], b"", table, [0])
    assert not list((tmp_path / "ns" / "x").glob("*.tmp-*"))  # its temporary file removed


def test_without_the_native_module_the_mixin_defaults_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without `_fileio` local files still move whole blocks (`kvx.SupportsHashedIO`'s Python
    defaults on the vectored calls), in the same value format the native reader reads."""
    table = [(memoryview(bytearray(range(256)) * 2), 0, 128, 128)]  # four blocks of 128 bytes
    monkeypatch.setattr(local_files, "_fileio", None)
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    seeds = [b"s1" + b"p" * 8, b"s2" + b"p" * 8]  # a reader's seed, then the header's prefix
    backend.put_blocks_hashed(["ns/a", "ns/b"], seeds, b"p" * 8, table, [1, 2])
    monkeypatch.setattr(local_files, "_fileio", _fileio)
    dst = bytearray(4 * 128)
    heads = [memoryview(bytearray(16)) for _ in range(2)]
    out = backend.get_blocks_hashed(
        ["ns/a", "ns/b"], [b"s1", b"s2"], (8, 16), heads, [(memoryview(dst), 0, 128, 128)], [3, 0]
    )
    src = bytes(table[0][0])
    assert [size for size, _ in out] == [16 + 128] * 2
    assert dst == src[256:384] + bytes(256) + src[128:256]  # block 3 <- 1, block 0 <- 2
    for head, (_, digest), seed, block in zip(heads, out, [b"s1", b"s2"], [1, 2], strict=True):
        want = xxhash.xxh3_64_intdigest(seed + b"p" * 8 + src[block * 128 : block * 128 + 128])
        assert digest == want == int.from_bytes(head[8:], "little")


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("native_writer", [True, False])
def test_native_and_python_paths_load_each_others_values(
    native_writer: bool, tmp_path: Path, make_rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = [(7 * i) % 1000 for i in range(50)]
    url = f"file://{tmp_path}"
    monkeypatch.setattr(local_files, "_fileio", _fileio if native_writer else None)
    producer = make_rig(url)
    producer.prefill("p", tokens)
    monkeypatch.setattr(local_files, "_fileio", None if native_writer else _fileio)
    consumer = make_rig(url)
    for rig in (producer, consumer):
        worker = rig.workers[0][0].worker
        assert worker.direct and worker._direct_io.hashed_io  # native or the mixin's defaults
    loaded = consumer.prefill("d", tokens, compute=False)
    assert loaded.num_external == 48 and loaded.errors == [set()]
    consumer.check(tokens, loaded.block_ids, 48)


def test_a_batch_shares_one_segment_file_and_every_read_path_finds_its_value(
    tmp_path: Path,
) -> None:
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    src, table = _cache(5, 3000)
    keys = ["ns/x/a", "ns/y/b", "ns/x/c"]
    seeds = [k.encode() + b"p" * 56 for k in keys]  # as the format: key, then the prefix
    backend.put_blocks_hashed(keys, seeds, b"p" * 56, table, [4, 0, 2])
    stats = [(tmp_path / key).stat() for key in keys]
    assert len({st.st_ino for st in stats}) == 1 and stats[0].st_nlink == 3  # one inode
    assert not list((tmp_path / "ns").rglob("*.tmp-*"))
    value = 64 + 6000
    with open(tmp_path / keys[0], "rb") as f:
        where = [segments.locate(f.fileno(), stats[0].st_size, key) for key in keys]
    # version 2: payloads back to back from 2 MiB, in batch order; headers in the index
    assert [(w.offset, w.length) for w in where] == [((2 << 20) + i * 6000, 6000) for i in range(3)]
    assert stats[0].st_size == (2 << 20) + 3 * 6000
    dst, dst_table = _cache(5, 3000)
    dst[:] = bytes(len(dst))
    heads = [bytearray(64) for _ in keys]
    out = backend.get_blocks_hashed(
        keys, [k.encode() for k in keys], (56, 64), heads, dst_table, [0, 1, 3]
    )
    for (size, digest), head in zip(out, heads, strict=True):
        assert size == value and digest == int.from_bytes(head[56:], "little")
    for got, want in ((0, 4), (1, 0), (3, 2)):
        for half in (0, 5):
            assert dst[(half + got) * 3000 :][:3000] == src[(half + want) * 3000 :][:3000]
    for untouched in (2, 4):  # blocks no value was read into
        for half in (0, 5):
            assert dst[(half + untouched) * 3000 :][:3000] == bytes(3000)
    # the Python read paths (values read into buffers, get_many) find the same values
    plain = backend.get_many(keys, value)
    rows = [memoryview(bytearray(value)) for _ in keys]
    assert backend.get_into(keys, rows) == [value] * 3
    for data, row, head, block in zip(plain, rows, heads, [4, 0, 2], strict=True):
        body = src[block * 3000 :][:3000] + src[(5 + block) * 3000 :][:3000]
        assert data == bytes(row) == bytes(head) + body
    assert backend.get_into(["ns/x/a"], [memoryview(bytearray(value - 1))]) == [value]
    # rewriting a key replaces it (a new segment); a segment without a key does not serve it
    backend.put_blocks_hashed(["ns/x/a", "ns/x/d"], [b"", b""], b"q" * 56, table, [1, 1])
    assert backend.get_many(["ns/x/a"], value)[0][:56] == b"q" * 56  # type: ignore[index]
    assert backend.get_many(["ns/x/c"], value)[0][:56] == b"p" * 56  # type: ignore[index]
    os.link(tmp_path / "ns/x/c", tmp_path / "ns/x/e")  # a name its segment does not index
    out = backend.get_blocks_hashed(["ns/x/e"], [b""], (0, 0), [bytearray(64)], dst_table, [0])
    assert out == [(None, None)]


def test_segments_written_back_to_back_still_load(tmp_path: Path) -> None:
    """Version-1 segments from before page-aligned payloads (values back to back after the
    index) are found through their index and read whole, by the native and the Python read
    paths."""
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    src, table = _cache(3, 3000)
    keys = ["ns/a", "ns/b", "ns/c"]
    seeds = [k.encode() + b"p" * 56 for k in keys]
    backend.put_blocks_hashed(keys, seeds, b"p" * 56, table, [2, 0, 1])
    value = 64 + 6000
    values = backend.get_many(keys, value)  # whole values: header, then payload
    hlen = segments.header_len(3)
    index = segments.FIXED.pack(segments.MAGIC, 1, 0, 3, hlen) + b"".join(
        segments.ENTRY.pack(xxhash.xxh3_64_intdigest(key.encode()), hlen + i * value, value)
        for i, key in enumerate(keys)
    )
    old = index + xxhash.xxh3_64_intdigest(index).to_bytes(8, "little")
    old = old.ljust(hlen, b"\0") + b"".join(v or b"" for v in values)
    for key in keys:  # one old segment, linked under every key
        (tmp_path / key).unlink()
    (tmp_path / keys[0]).write_bytes(old)
    for key in keys[1:]:
        os.link(tmp_path / keys[0], tmp_path / key)
    dst, dst_table = _cache(3, 3000)
    dst[:] = bytes(len(dst))
    heads = [bytearray(64) for _ in keys]
    out = backend.get_blocks_hashed(
        keys, [k.encode() for k in keys], (56, 64), heads, dst_table, [0, 1, 2]
    )
    assert [size for size, _ in out] == [value] * 3
    assert [digest for _, digest in out] == [int.from_bytes(h[56:], "little") for h in heads]
    for got, want in ((0, 2), (1, 0), (2, 1)):
        for half in (0, 3):
            assert dst[(half + got) * 3000 :][:3000] == src[(half + want) * 3000 :][:3000]
    assert backend.get_many(keys, value) == values


def test_damaged_segment_headers_are_not_trusted(tmp_path: Path) -> None:
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    _, table = _cache(2, 4096)
    keys = ["ns/a", "ns/b"]
    backend.put_blocks_hashed(keys, [b"", b""], b"p" * 56, table, [0, 1])
    path = tmp_path / "ns/a"
    data = bytearray(path.read_bytes())
    data[16 + 8] ^= 1  # an index entry's offset: the header checksum no longer matches
    path.write_bytes(bytes(data))
    heads = [bytearray(64), bytearray(64)]
    out = backend.get_blocks_hashed(keys, [b"", b""], (0, 0), heads, table, [0, 1])
    assert out == [(len(data), None), (len(data), None)]  # read as a value of another size
    # the Python path reads the file as one value: never one of the right size
    assert [len(v or b"") for v in backend.get_many(keys, 64 + 8192)] == [64 + 8193] * 2
