"""Segment files (`_segment.c`, `backends/segments.py`): version 2 as written (payloads back to
back from a 2 MiB boundary, headers in the index), version 1 as stored by earlier kvx, unknown
versions refused, torn or flipped segments never served."""

from __future__ import annotations

import gzip
import os
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from kvx.plugins.storage import _fileio
from kvx.plugins.storage.backends import segments
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.local_files import LocalFileBackend
from kvx.plugins.storage.blockformat import (
    CHECKSUM_SPAN,
    HEADER,
    BlockShape,
    checksum_ok,
    checksum_seed,
    header_prefix,
    stored_checksum,
)
from kvx.plugins.storage.direct import check_size

# The shape of the stored version-1 fixture (data/segment-v1.bin.gz: three values of this shape,
# keys ns/v1/a, b, c, blocks 3, 0, 2 of the cache below, written by kvx's version-1 writer).
V1_SHAPE = BlockShape("bfloat16", 4, 2, 2, range(0, 2), 64, layers=range(0, 3), total_layers=3)
V1_KEYS = ["ns/v1/a", "ns/v1/b", "ns/v1/c"]
V1_BLOCKS = [3, 0, 2]
DATA = Path(__file__).parent / "data"


def _cache(layers: int, blocks: int, size: int, fill: bool = True) -> tuple[bytearray, list]:
    """A cache of `layers` regions of `blocks` blocks of `size` bytes each (a pattern, or
    zeros), and its region table: block b of layer l at l * blocks * size + b * size."""
    n = layers * blocks * size
    cache = bytearray((i * 7 + 3) % 251 for i in range(n)) if fill else bytearray(n)
    return cache, [(cache, layer * blocks * size, size, size) for layer in range(layers)]


def _block(cache: bytearray, layers: int, blocks: int, size: int, block: int) -> bytes:
    """The payload of `block`: its region of every layer."""
    return b"".join(
        bytes(cache[layer * blocks * size + block * size :][:size]) for layer in range(layers)
    )


def _v2_store(root: Path, keys: list[str], blocks: list[int]) -> tuple[LocalFileBackend, bytearray]:
    shape = V1_SHAPE
    backend = LocalFileBackend(f"file://{root}", BackendOptions())
    src, table = _cache(3, 4, shape.layer_bytes)
    seeds = [checksum_seed(key, shape) for key in keys]
    backend.put_blocks_hashed(keys, seeds, header_prefix(shape), table, blocks)
    return backend, src


def _read_native(
    backend: LocalFileBackend, keys: list[str], targets: list[int], checksum: bool = True
) -> tuple[list, list[bytearray], bytearray]:
    """Read `keys` into blocks `targets` of a zeroed cache like the writer's."""
    dst, table = _cache(3, 4, V1_SHAPE.layer_bytes, fill=False)
    heads = [bytearray(HEADER.size) for _ in keys]
    seeds = [key.encode() for key in keys]
    out = backend.get_blocks_hashed(
        keys, seeds, CHECKSUM_SPAN, [memoryview(h) for h in heads], table, targets, checksum
    )
    return out, heads, dst


def _check_native_reads(
    backend: LocalFileBackend,
    keys: list[str],
    payloads: list[bytes],
    targets: list[int],
    untouched: int,
) -> list[bytearray]:
    """Read `keys` natively into blocks `targets`, with and without checksums: every byte of
    each payload lands, each header and checksum is the writer's, block `untouched` stays zero.
    Returns the headers read."""
    size, value = V1_SHAPE.layer_bytes, V1_SHAPE.value_bytes
    for checksum in (True, False):
        out, heads, dst = _read_native(backend, keys, targets, checksum)
        assert [o[0] for o in out] == [value] * len(keys)
        for (_, digest), head, key, payload, target in zip(
            out, heads, keys, payloads, targets, strict=True
        ):
            assert bytes(head[: CHECKSUM_SPAN[0]]) == header_prefix(V1_SHAPE)
            assert checksum_ok(key, head, [memoryview(payload)])  # the checksum the writer hashed
            assert digest == (stored_checksum(head) if checksum else None)
            assert _block(dst, 3, 4, size, target) == payload
        assert _block(dst, 3, 4, size, untouched) == bytes(3 * size)  # no value was read into it
    return heads


def test_v2_segments_hold_payloads_back_to_back_and_round_trip_every_byte(tmp_path: Path) -> None:
    keys, blocks = ["ns/a", "ns/b", "ns/c"], [3, 0, 2]
    backend, src = _v2_store(tmp_path, keys, blocks)
    size, value = V1_SHAPE.layer_bytes, V1_SHAPE.value_bytes
    payloads = [_block(src, 3, 4, size, b) for b in blocks]
    data = (tmp_path / keys[0]).read_bytes()
    magic, version, zero, count, _ = segments.FIXED.unpack_from(data)
    *_, head_len, _, payload_len, start = segments.V2_FIXED.unpack_from(data)
    assert (magic, version, zero, count, head_len) == (b"KVXS", 2, 0, 3, HEADER.size)
    assert (payload_len, start) == (V1_SHAPE.payload_bytes, 2 << 20)
    assert data[start:] == b"".join(payloads)  # back to back, nothing between or after
    heads = _check_native_reads(backend, keys, payloads, [1, 2, 0], untouched=3)
    whole = [bytes(h) + p for h, p in zip(heads, payloads, strict=True)]
    assert backend.get_many(keys, value) == whole  # the Python read paths
    rows = [memoryview(bytearray(value)) for _ in keys]
    assert backend.get_into(keys, rows) == [value] * 3 and [bytes(r) for r in rows] == whole
    split = [[memoryview(bytearray(n)) for n in (10, 100, value - 110)] for _ in keys]
    assert backend.get_vectored(keys, split) == [value] * 3  # a header across buffers
    assert [b"".join(bytes(p) for p in parts) for parts in split] == whole


def _v1_store(root: Path) -> None:
    data = gzip.decompress((DATA / "segment-v1.bin.gz").read_bytes())
    assert data[:6] == b"KVXS\x01\x00"  # what the version-1 writer wrote
    (root / "ns/v1").mkdir(parents=True)
    (root / V1_KEYS[0]).write_bytes(data)
    for key in V1_KEYS[1:]:
        os.link(root / V1_KEYS[0], root / key)


def test_stored_version_1_segments_still_load(tmp_path: Path) -> None:
    _v1_store(tmp_path)
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    src, _ = _cache(3, 4, V1_SHAPE.layer_bytes)
    payloads = [_block(src, 3, 4, V1_SHAPE.layer_bytes, b) for b in V1_BLOCKS]
    value = V1_SHAPE.value_bytes
    heads = _check_native_reads(backend, V1_KEYS, payloads, [0, 1, 3], untouched=2)
    whole = [bytes(h) + p for h, p in zip(heads, payloads, strict=True)]
    assert backend.get_many(V1_KEYS, value) == whole


def _set_version(path: Path, version: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 4, version)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("version", [3, 0x0102])
def test_a_segment_of_an_unknown_version_is_refused_by_name(tmp_path: Path, version: int) -> None:
    keys = ["ns/a", "ns/b"]
    backend, _ = _v2_store(tmp_path, keys, [0, 1])
    _set_version(tmp_path / keys[0], version)
    said = re.escape(
        f"{tmp_path}/ns/a: a segment file of version {version}; this kvx reads segment "
        "versions 1 and 2"
    )
    with pytest.raises(ValueError, match=said):
        _read_native(backend, keys, [0, 1])
    with pytest.raises(segments.SegmentVersionError, match=said):
        backend.get_many(keys[:1], V1_SHAPE.value_bytes)
    with pytest.raises(segments.SegmentVersionError, match=said):
        backend.get_into(keys[:1], [memoryview(bytearray(V1_SHAPE.value_bytes))])


@pytest.mark.parametrize("cut", [100, V1_SHAPE.payload_bytes * 3 + 1, (2 << 20) - 4000])
def test_a_torn_v2_segment_is_refused(tmp_path: Path, cut: int) -> None:
    """Cut short (in the last payload, before the first, inside the index): no value is
    read from it, and each is refused as torn."""
    keys = ["ns/a", "ns/b", "ns/c"]
    backend, _ = _v2_store(tmp_path, keys, [0, 1, 2])
    path = tmp_path / keys[0]
    os.truncate(path, path.stat().st_size - cut)
    size = path.stat().st_size
    out, heads, dst = _read_native(backend, keys, [0, 1, 2])
    assert out == [(size, None)] * 3
    assert dst == bytearray(len(dst)) and heads == [bytearray(HEADER.size)] * 3
    for key, (got, _) in zip(keys, out, strict=True):
        with pytest.raises(ValueError, match="torn"):
            check_size(key, got, V1_SHAPE.value_bytes)
    rows = [memoryview(bytearray(V1_SHAPE.value_bytes)) for _ in keys]
    assert backend.get_into(keys, rows) == [size] * 3


def test_a_flipped_payload_bit_fails_its_checksum_only(tmp_path: Path) -> None:
    keys = ["ns/a", "ns/b", "ns/c"]
    backend, _ = _v2_store(tmp_path, keys, [0, 1, 2])
    path = tmp_path / keys[0]
    data = bytearray(path.read_bytes())
    data[(2 << 20) + V1_SHAPE.payload_bytes + 777] ^= 0x10  # one bit of ns/b's payload
    path.write_bytes(bytes(data))
    out, heads, _ = _read_native(backend, keys, [0, 1, 2])
    ok = [digest == stored_checksum(head) for (_, digest), head in zip(out, heads, strict=True)]
    assert ok == [True, False, True]


def test_native_module_refuses_empty_or_oversized_segments(tmp_path: Path) -> None:
    _, table = _cache(1, 1, 64)
    with pytest.raises(ValueError, match="a segment holds 1 to 4096 values"):
        _fileio.write_segment([], [], str(tmp_path / "t"), [], b"p" * 56, table, [])
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(60)
def test_the_connector_reports_an_unknown_segment_version_as_load_errors(
    tmp_path: Path, make_rig: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = [(11 * i) % 1000 for i in range(50)]
    url = f"file://{tmp_path}"
    make_rig(url).prefill("p", tokens)  # 3 blocks: one segment file
    inodes = {p.stat().st_ino: p for p in tmp_path.rglob("*") if p.is_file()}
    assert len(inodes) == 1
    (path,) = inodes.values()
    _set_version(path, 9)
    consumer = make_rig(url)
    loaded = consumer.prefill("d", tokens, compute=False)
    assert loaded.errors == [set(loaded.block_ids[:3])]  # nothing from it is served
    assert "a segment file of version 9; this kvx reads segment versions 1 and 2" in caplog.text
    consumer.check(tokens, [], 0, failed=loaded.block_ids[:3])  # nothing else written
