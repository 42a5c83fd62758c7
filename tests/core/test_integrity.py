"""kvx's per-block digests: the two helpers agree, and a changed byte names its block."""

from __future__ import annotations

import pytest
import torch

import kvx


def test_cache_digests_are_the_digests_of_each_blocks_bytes_over_every_table() -> None:
    tables = [torch.randint(0, 255, (2, 6, 40), dtype=torch.uint8) for _ in range(3)]
    ids = [4, 0, 5]
    got = kvx.cache_block_digests(tables, ids)
    for b, digest in zip(ids, got, strict=True):
        segments = [t[o, b] for t in tables for o in range(2)]
        assert kvx.block_digests(segments, 1) == [digest]
    tables[2][1, 5, 39] ^= 1  # the last byte of block 5, in the last table's second half
    changed = kvx.cache_block_digests(tables, ids)
    assert [a == b for a, b in zip(got, changed, strict=True)] == [True, True, False]
    with pytest.raises(kvx.IntegrityError) as e:
        kvx.check_block_digests("request q", got, changed, [40, 41, 42])
    assert e.value.blocks == [42]


def test_bytes_that_do_not_split_into_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split into 2 x 3 equal blocks"):
        kvx.block_digests([bytes(13)], 3, outer=2)
    assert kvx.block_digests([], 0) == []
