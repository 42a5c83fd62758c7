"""The native per-block digests (`kvx.contract._digest`) and the `xxhash` path give the digests
of each block's bytes in place: strided tables, segments cut anywhere, one changed byte in
any region named by its block, and bad regions or block ids refused."""

from __future__ import annotations

import itertools

import pytest
import torch
import xxhash

import kvx
from kvx.contract import integrity


@pytest.fixture(params=["native", "xxhash"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "xxhash":
        monkeypatch.setattr(integrity, "_native", None)
    return str(request.param)


def test_the_native_module_is_built() -> None:
    # optional in setup.py; here it must be there, or the tests below test one path twice
    assert integrity._native is not None
    assert integrity._native.vector() in ("avx512", "avx2", "baseline")


def reference(tables: list[torch.Tensor], ids: list[int]) -> list[int]:
    """XXH3-64 of each block's bytes, gathered with copies (what the digests must equal)."""
    return [
        xxhash.xxh3_64_intdigest(
            b"".join(
                t[o, b].contiguous().numpy().tobytes() for t in tables for o in range(t.shape[0])
            )
        )
        for b in ids
    ]


def tables_of(*shapes: tuple[int, int, int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, s, dtype=torch.uint8, generator=gen) for s in shapes]


def test_cache_digests_of_contiguous_and_strided_tables_equal_the_bytes_digests(
    path: str,
) -> None:
    tables = tables_of((2, 9, 64), (1, 9, 1000))
    # a blocks-first cache viewed [outer, blocks, bytes]: rows interleave, blocks are strided
    tables.append(tables_of((9, 2, 48))[0].permute(1, 0, 2))
    # an offset view into a bigger tensor
    tables.append(tables_of((3, 12, 40))[0][1:, 2:11])
    ids = [8, 0, 3, 3, 5]
    assert kvx.cache_block_digests(tables, ids) == reference(tables, ids)


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_changed_byte_in_any_region_changes_only_its_blocks_digest(path: str, where: str) -> None:
    tables = tables_of((2, 6, 96), (2, 6, 96), (1, 6, 32))
    ids = list(range(6))
    before = kvx.cache_block_digests(tables, ids)
    for t in tables:
        for o in range(t.shape[0]):
            byte = 0 if where == "first" else t.shape[2] - 1
            t[o, 4, byte] ^= 0x10
            after = kvx.cache_block_digests(tables, ids)
            changed = [a != b for a, b in zip(before, after, strict=True)]
            assert changed == [b == 4 for b in ids], (o, byte)
            with pytest.raises(kvx.IntegrityError) as e:
                kvx.check_block_digests("request q", before, after, [10, 11, 12, 13, 14, 15])
            assert e.value.blocks == [14]
            t[o, 4, byte] ^= 0x10
    assert kvx.cache_block_digests(tables, ids) == before


def test_segments_cut_anywhere_give_the_digests_of_the_whole(path: str) -> None:
    outer, blocks, per = 3, 4, 50
    whole = tables_of((outer, blocks, per))[0]
    expected = reference([whole], list(range(blocks)))
    flat = whole.reshape(-1)
    for cuts in ([], [1], [49, 50, 51], [7, 300, 301, 599]):
        edges = [0, *cuts, flat.numel()]
        segments = [flat[a:b] for a, b in itertools.pairwise(edges)]
        assert kvx.block_digests(segments, blocks, outer) == expected, cuts
    changed = flat.clone()
    changed[per * blocks + 2 * per + 7] ^= 1  # outer index 1, block 2
    got = kvx.block_digests([changed[:333], changed[333:]], blocks, outer)
    assert [a != b for a, b in zip(expected, got, strict=True)] == [False, False, True, False]


def test_block_ids_and_tables_out_of_bounds_are_refused(path: str) -> None:
    tables = tables_of((2, 5, 16))
    with pytest.raises(ValueError, match=r"block ids 0\.\.5: a table has blocks 0\.\.4"):
        kvx.cache_block_digests(tables, [0, 5])
    with pytest.raises(ValueError, match=r"block ids -1\.\.2"):
        kvx.cache_block_digests(tables, [2, -1])
    with pytest.raises(ValueError, match="uint8 \\[outer, blocks, bytes per block\\]"):
        kvx.cache_block_digests([torch.zeros(2, 5, 4, dtype=torch.float16)], [0])
    assert kvx.cache_block_digests(tables, []) == []


def test_native_regions_outside_their_buffer_are_refused() -> None:
    native = integrity._native
    assert native is not None
    buf = bytes(100)
    assert native.region_digests([(buf, 0, 10, 10)], [9]) == [xxhash.xxh3_64_intdigest(bytes(10))]
    with pytest.raises(ValueError, match=r"block 10: region 0 .* outside its buffer of 100"):
        native.region_digests([(buf, 0, 10, 10)], [10])
    with pytest.raises(ValueError, match="block 0: region 1"):
        native.region_digests([(buf, 0, 10, 10), (buf, 95, 10, 0)], [0])
    with pytest.raises(ValueError, match="must be >= 0"):
        native.region_digests([(buf, -1, 10, 10)], [0])
    with pytest.raises(ValueError, match="block -1"):
        native.region_digests([(buf, 0, 10, 10)], [-1])
    with pytest.raises(ValueError, match="do not split into 3 x 2"):
        native.chunk_digests([buf], 2, 3)


def test_part_digests_digest_each_head_range_and_merge_into_any_sub_range(path: str) -> None:
    """A block cut into parts (its heads) digests each part over every table; a range of parts
    merges into what the same range sliced out of the rows digests to, merged: so P, holding
    all its heads, and D, holding a head range of them, agree on that range."""
    tables = tables_of((2, 6, 96), (1, 6, 48))
    ids = [5, 0, 3]
    parts = kvx.cache_block_digests(tables, ids, 4)
    assert len(parts) == 12
    for p in range(4):  # part p of every row, gathered with copies
        sliced = [t[:, :, p * t.shape[2] // 4 : (p + 1) * t.shape[2] // 4] for t in tables]
        assert parts[p::4] == reference(sliced, ids)
    for first, count in [(0, 4), (1, 2), (3, 1)]:
        sliced = [
            t[:, :, first * t.shape[2] // 4 : (first + count) * t.shape[2] // 4] for t in tables
        ]
        merged = kvx.merge_digests(parts, 4, first, count)
        assert kvx.cache_block_digests(sliced, ids, count, merge=True) == merged
        words = [
            b"".join(d.to_bytes(8, "little") for d in parts[at + first : at + first + count])
            for at in (0, 4, 8)
        ]
        assert merged == [xxhash.xxh3_64_intdigest(w) for w in words]
    tables[0][1, 3, 30] ^= 0x10  # block 3, part 1 of the first table's second row
    changed = kvx.cache_block_digests(tables, ids, 4)
    assert [a != b for a, b in zip(parts, changed, strict=True)] == [i == 9 for i in range(12)]
    with pytest.raises(ValueError, match="do not split into 5 parts"):
        kvx.cache_block_digests(tables, ids, 5)
    for first, count in [(3, 2), (-1, 1), (0, 0)]:
        with pytest.raises(ValueError, match=f"cannot merge {count} parts from part {first}"):
            kvx.merge_digests(parts, 4, first, count)
    with pytest.raises(ValueError, match="whole groups"):
        kvx.merge_digests(parts[:-1], 4, 0, 4)
