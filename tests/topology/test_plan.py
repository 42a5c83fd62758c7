"""Transfer plans: every element of every D rank, for every TP / heads / MLA / block-size pair,
plus the worked examples of vLLM's topology math and the errors for impossible pairs."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvx.layouts import get_layout
from kvx.topology import (
    BlockSpan,
    HeadRead,
    KVGeometry,
    TopologyError,
    check_compatible,
    plan_reads,
    readers_per_remote_rank,
)

from ._kv import execute, expected, fill, global_kv, rank_cache

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8, 16)
BLOCK_SIZES = (16, 32, 64)
NUM_TOKENS = 100  # a partial last block for every block size
LAYOUT_PAIRS = (("HND", "HND"), ("HND", "NHD"), ("FLASHINFER_NHD", "CPU_PACKED"))


def _blocks(rng: random.Random, num_blocks: int, block_size: int) -> list[int]:
    return rng.sample(range(num_blocks), -(-NUM_TOKENS // block_size))


def _transfer_and_check(p: KVGeometry, d: KVGeometry, rng: random.Random) -> None:
    """Build every P rank's cache from one global tensor, run each D rank's plan, compare each
    D rank's whole cache (received heads, untouched blocks and tails) with what it must hold."""
    kv = global_kv(NUM_TOKENS, p)
    num_blocks = 2 * -(-NUM_TOKENS // 16)
    p_blocks = _blocks(rng, num_blocks, p.block_size)
    p_caches = []
    for rank in range(p.tp_size):
        cache = rank_cache(p, rank, num_blocks)
        fill(p, rank, cache, kv, p_blocks)
        p_caches.append(cache)
    readers = readers_per_remote_rank(p, d)
    seen = dict.fromkeys(range(p.tp_size), 0)
    for rank in range(d.tp_size):
        d_blocks = _blocks(rng, num_blocks, d.block_size)
        plan = plan_reads(d, p, rank)
        covered = [h for r in plan.reads for h in r.local_heads]
        assert covered == list(d.heads_of(rank)), (p, d, rank)
        for p_rank in plan.remote_ranks:
            seen[p_rank] += 1
        cache = rank_cache(d, rank, num_blocks)
        execute(plan, p_caches, cache, p_blocks, d_blocks, NUM_TOKENS)
        want = expected(d, rank, num_blocks, kv, d_blocks)
        assert torch.equal(cache, want), f"P {p} -> D {d}, D rank {rank}"
    assert readers == seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mla", [False, True], ids=["attention", "mla"])
@pytest.mark.parametrize("p_tp", TPS)
def test_every_pair_moves_every_element(p_tp: int, mla: bool) -> None:
    rng = random.Random(p_tp * 2 + mla)
    cases = itertools.product(TPS, HEADS, BLOCK_SIZES, BLOCK_SIZES)
    for i, (d_tp, heads, p_bs, d_bs) in enumerate(cases):
        p_layout, d_layout = ("MLA", "MLA") if mla else LAYOUT_PAIRS[i % len(LAYOUT_PAIRS)]
        p = KVGeometry(p_tp, heads, p_bs, p_layout, is_mla=mla)
        d = KVGeometry(d_tp, heads, d_bs, d_layout, is_mla=mla)
        _transfer_and_check(p, d, rng)


def _reads(p: KVGeometry, d: KVGeometry) -> list[list[tuple[int, range, int, int]]]:
    return [
        [
            (r.remote_tp_rank, r.remote_heads, r.remote_head_offset, r.local_head_offset)
            for r in plan_reads(d, p, rank).reads
        ]
        for rank in range(d.tp_size)
    ]


def test_example_1_p_tp4_d_tp2_k8() -> None:
    """D0 reads P0 and P1 whole (slots 0 and 1 of its block), D1 reads P2 and P3; each P rank
    waits for one reader."""
    p, d = KVGeometry(4, 8, 16), KVGeometry(2, 8, 16)
    assert _reads(p, d) == [
        [(0, range(0, 2), 0, 0), (1, range(2, 4), 0, 2)],
        [(2, range(4, 6), 0, 0), (3, range(6, 8), 0, 2)],
    ]
    assert readers_per_remote_rank(p, d) == {0: 1, 1: 1, 2: 1, 3: 1}
    _transfer_and_check(p, d, random.Random(1))


def test_example_2_p_tp2_d_tp4_k8() -> None:
    """D0, D1 read the halves of P0's heads (offsets 0 and 2), D2, D3 those of P1; each P rank
    waits for two readers."""
    p, d = KVGeometry(2, 8, 16), KVGeometry(4, 8, 16)
    assert _reads(p, d) == [
        [(0, range(0, 2), 0, 0)],
        [(0, range(2, 4), 2, 0)],
        [(1, range(4, 6), 0, 0)],
        [(1, range(6, 8), 2, 0)],
    ]
    assert readers_per_remote_rank(p, d) == {0: 2, 1: 2}
    _transfer_and_check(p, d, random.Random(2))


def test_example_3_replicated_k2() -> None:
    """K=2: P TP=2 -> D TP=8 (D r reads P r//4 whole, P waits for 4); P TP=4 -> D TP=8 (D r
    reads P r//2, offset 0); P TP=8 -> D TP=2 (vLLM rejects; kvx reads head 0 from P0 and head
    1 from P4, the other P ranks are read by nobody); P TP=8 -> D TP=8 (rank i <-> rank i)."""
    k = 2
    p, d = KVGeometry(2, k, 16), KVGeometry(8, k, 16)
    assert _reads(p, d) == [[(r // 4, range(r // 4, r // 4 + 1), 0, 0)] for r in range(8)]
    assert readers_per_remote_rank(p, d) == {0: 4, 1: 4}
    p = KVGeometry(4, k, 16)
    assert _reads(p, d) == [[(r // 2, range(r // 4, r // 4 + 1), 0, 0)] for r in range(8)]
    p, d = KVGeometry(8, k, 16), KVGeometry(2, k, 16)
    assert _reads(p, d) == [[(0, range(0, 1), 0, 0)], [(4, range(1, 2), 0, 0)]]
    assert readers_per_remote_rank(p, d) == {0: 1, 1: 0, 2: 0, 3: 0, 4: 1, 5: 0, 6: 0, 7: 0}
    _transfer_and_check(p, d, random.Random(3))
    d = KVGeometry(8, k, 16)
    assert _reads(p, d) == [[(r, range(r // 4, r // 4 + 1), 0, 0)] for r in range(8)]


def test_example_4_mla_p_tp2_d_tp4() -> None:
    """MLA: no head split; D r reads whole blocks from P r//2."""
    p = KVGeometry(2, 1, 16, "MLA", is_mla=True)
    d = KVGeometry(4, 1, 16, "MLA", is_mla=True)
    assert _reads(p, d) == [[(r // 2, range(1), 0, 0)] for r in range(4)]
    assert readers_per_remote_rank(p, d) == {0: 2, 1: 2}


def _spans(spans: list[BlockSpan]) -> list[tuple[int, int, int, int, int]]:
    return [
        (
            s.remote_block_id,
            s.remote_token_start,
            s.local_block_id,
            s.local_token_start,
            s.num_tokens,
        )
        for s in spans
    ]


def test_example_5_block_sizes_p16_d32_and_reverse() -> None:
    """Each D block of 32 tokens is filled by two P blocks of 16; kvx also does P=32 -> D=16,
    which vLLM does not."""
    p, d = KVGeometry(1, 4, 16), KVGeometry(1, 4, 32)
    plan = plan_reads(d, p, 0)
    spans = _spans(plan.block_pairs([7, 3], [10, 11, 12], 40))
    assert spans == [(10, 0, 7, 0, 16), (11, 0, 7, 16, 16), (12, 0, 3, 0, 8)]
    assert plan.block_size_ratio == 2
    plan = plan_reads(p, d, 0)
    spans = _spans(plan.block_pairs([1, 2, 3], [5, 6], 40))
    assert spans == [(5, 0, 1, 0, 16), (5, 16, 2, 0, 16), (6, 0, 3, 0, 8)]
    assert plan.block_size_ratio == -2
    _transfer_and_check(d, p, random.Random(5))


def test_any_tp_pair_whose_heads_split() -> None:
    """Beyond vLLM: TP sizes that do not divide one another (K=12, P TP=4, D TP=3)."""
    p, d = KVGeometry(4, 12, 16), KVGeometry(3, 12, 32)
    assert plan_reads(d, p, 0).reads == (
        HeadRead(0, range(0, 3), range(0, 3), 0, 0),
        HeadRead(1, range(3, 4), range(3, 4), 0, 3),
    )
    assert readers_per_remote_rank(p, d) == {0: 1, 1: 2, 2: 2, 3: 1}
    _transfer_and_check(p, d, random.Random(6))
    _transfer_and_check(d, p, random.Random(7))


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        (KVGeometry(2, 8, 16), KVGeometry(2, 4, 16), "num_kv_heads differs"),
        (KVGeometry(2, 8, 16), KVGeometry(2, 8, 24), "block sizes must divide"),
        (KVGeometry(2, 8, 16), KVGeometry(2, 1, 16, "MLA", is_mla=True), "is_mla differs"),
    ],
)
def test_impossible_pairs_say_why(local: KVGeometry, remote: KVGeometry, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        plan_reads(local, remote, 0)


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        (KVGeometry(2, 8, 16, "MLA"), KVGeometry(2, 8, 16), "local layout 'MLA' has no heads dim"),
        (
            KVGeometry(2, 1, 16, "HND", is_mla=True),
            KVGeometry(2, 1, 16, "MLA", is_mla=True),
            "local layout 'HND' has a heads dim",
        ),
        (KVGeometry(2, 8, 16), KVGeometry(2, 8, 16, "MLA"), "remote layout 'MLA' has no heads"),
    ],
)
def test_layouts_that_do_not_fit_say_why(local: KVGeometry, remote: KVGeometry, match: str) -> None:
    """Layouts are checked as objects the caller found (topology looks up no names)."""
    layouts = (get_layout(local.layout), get_layout(remote.layout))
    check_compatible(local, remote)  # the shapes alone fit
    with pytest.raises(TopologyError, match=match):
        check_compatible(local, remote, layouts)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_size": 3, "num_kv_heads": 8}, r"tp_size=3 does not divide .*\[1, 2, 4, 8\]"),
        ({"tp_size": 6, "num_kv_heads": 4}, "not a multiple"),
        ({"tp_size": 0, "num_kv_heads": 4}, "tp_size must be an int >= 1"),
        ({"tp_size": 2, "num_kv_heads": 4, "block_size": 0}, "block_size must be"),
        ({"tp_size": 2, "num_kv_heads": 4, "layout": ""}, "layout must be"),
    ],
)
def test_bad_geometry_names_the_field(kwargs: dict, match: str) -> None:
    kwargs = {"block_size": 16, **kwargs}
    with pytest.raises(TopologyError, match=match):
        KVGeometry(**kwargs)


def test_block_pairs_rejects_wrong_block_counts() -> None:
    plan = plan_reads(KVGeometry(1, 1, 16), KVGeometry(1, 1, 32), 0)
    with pytest.raises(TopologyError, match="local_block_ids has 2 blocks but 40 tokens need 3"):
        plan.block_pairs([0, 1], [0, 1], 40)
    with pytest.raises(TopologyError, match="num_tokens"):
        plan.block_pairs([], [], -1)
    assert plan.block_pairs([], [], 0) == []


def test_local_rank_out_of_range() -> None:
    with pytest.raises(TopologyError, match=r"tp_rank must be in \[0, 2\)"):
        plan_reads(KVGeometry(2, 4, 16), KVGeometry(2, 4, 16), 2)
