"""Physical KV heads per TP rank (vLLM's `_physical_head_range`), holders and replication."""

from __future__ import annotations

import pytest

from kvx.topology import (
    TopologyError,
    head_holders,
    is_kv_replicated,
    is_primary_holder,
    num_physical_heads,
    physical_head_range,
)


def test_sharded_and_replicated_ranges() -> None:
    assert [physical_head_range(8, 4, r) for r in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]
    assert [physical_head_range(2, 8, r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [physical_head_range(4, 4, r) for r in range(4)] == [range(r, r + 1) for r in range(4)]
    assert physical_head_range(8, 2, 1, is_mla=True) == range(1)
    assert [num_physical_heads(8, t) for t in (1, 2, 8, 16)] == [8, 4, 1, 1]


def test_holders_and_replication() -> None:
    assert head_holders(8, 4, 5) == range(2, 3)
    assert head_holders(2, 8, 1) == range(4, 8)
    assert head_holders(1, 4, 0, is_mla=True) == range(4)
    assert not is_kv_replicated(4, 4) and is_kv_replicated(4, 8)
    assert is_kv_replicated(1, 2, is_mla=True) and not is_kv_replicated(1, 1, is_mla=True)
    assert [is_primary_holder(2, 8, r) for r in range(8)] == [r % 4 == 0 for r in range(8)]
    assert all(is_primary_holder(8, 4, r) for r in range(4))
    assert [is_primary_holder(1, 2, r, is_mla=True) for r in range(2)] == [True, False]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((8, 3, 0), r"tp_size=3 does not divide num_kv_heads=8.*\[1, 2, 4, 8\]"),
        ((4, 6, 0), "not a multiple of it"),
        ((4, 2, 2), r"tp_rank must be in \[0, 2\)"),
        ((0, 2, 0), "num_kv_heads must be an int >= 1"),
    ],
)
def test_bad_input(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        physical_head_range(*args)
