"""Loads with `verify_checksums: false` from local files: read in place by the native reader
(one `preadv` per value, nothing hashed), still refusing torn values and foreign headers."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvx.plugins.storage.backends import segments
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.local_files import LocalFileBackend
from kvx.plugins.storage.keys import block_keys, chain_seed

MakeRig = Callable[..., Any]
NAMESPACE = "test-ns"  # the rig's namespace


def _cache(blocks: int, regions: int, size: int) -> tuple[bytearray, list[Any]]:
    """`regions` regions of `size` bytes per block, region k of every block together."""
    cache = bytearray(random.Random(blocks).randbytes(blocks * regions * size))
    return cache, [(cache, k * blocks * size, size, size) for k in range(regions)]


def test_unhashed_reads_land_in_place_and_touch_nothing_else(tmp_path: Path) -> None:
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())
    regions, size = 100, 96  # more regions than one hashed preadv takes (64)
    src, table = _cache(4, regions, size)
    keys = ["ns/a", "ns/b", "ns/c"]
    backend.put_blocks_hashed(keys, [b"", b"", b""], b"p" * 56, table, [3, 0, 2])
    dst = bytearray(len(src))
    dst_table = [(dst, *rest) for _, *rest in table]
    heads = [bytearray(64) for _ in keys]
    out = backend.get_blocks_hashed(keys, [b""] * 3, (56, 64), heads, dst_table, [1, 2, 0], False)
    assert out == [(64 + regions * size, None)] * 3  # nothing hashed
    want = bytearray(len(src))
    for got, stored in ((1, 3), (2, 0), (0, 2)):
        for _, start, _, step in table:
            at, frm = start + got * step, start + stored * step
            want[at : at + size] = src[frm : frm + size]
    assert dst == want  # every byte: each block in place, block 3 untouched
    with open(tmp_path / keys[0], "rb") as f:
        data = f.read()
    assert all(h[:56] == b"p" * 56 for h in heads)  # each value's header, as stored
    # a torn segment (cut inside the last value): that value is not read at all
    dst[:] = bytes(len(dst))
    (tmp_path / keys[0]).write_bytes(data[:-10])
    out = backend.get_blocks_hashed(keys, [b""] * 3, (56, 64), heads, dst_table, [1, 2, 0], False)
    assert out[2][0] != 64 + regions * size and out[2][1] is None
    for _, start, *_ in table:  # block 0 would have received key c
        assert dst[start : start + size] == bytes(size)


def _value_file(root: Path, key: str) -> Path:
    return next(root.rglob(f"{key}.*"))


@pytest.mark.timeout(60)
def test_unverified_loads_go_native_and_refuse_torn_values(
    tmp_path: Path, make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}"
    tokens = [random.Random(3).randrange(1000) for _ in range(50)]
    make_rig(url).prefill("p", tokens)

    def python_path(*args: object) -> None:
        raise AssertionError("unverified local loads read through the native reader")

    monkeypatch.setattr(LocalFileBackend, "get_vectored", python_path)
    consumer = make_rig(url, extra={"verify_checksums": False})
    loaded = consumer.prefill("d", tokens, compute=False)
    assert loaded.num_external == 48 and loaded.errors == [set()]
    consumer.check(tokens, loaded.block_ids, 48)  # every element, and nothing else changed

    # block 1's value torn (its own file, cut short): refused, block 0 still loads
    key = block_keys(tokens, 16, chain_seed(NAMESPACE, 16))[1]
    path = _value_file(tmp_path, key)
    with path.open("rb") as f:
        name = path.relative_to(tmp_path).as_posix()
        size = path.stat().st_size
        where = segments.locate(f.fileno(), size, name) or segments.Located(b"", 0, size)
        value = where.head + f.read()[where.offset : where.offset + where.length]
    path.unlink()  # other keys keep the segment file
    path.write_bytes(value[:-100])
    again = make_rig(url, extra={"verify_checksums": False})
    run = again.prefill("e", tokens, compute=False)
    assert run.errors == [set(run.block_ids[1:3])]
    again.check(tokens, run.block_ids[:1], 16, alone=False)
