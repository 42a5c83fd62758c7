"""HeteroTPTransferConfig reproduces vLLM's legacy results (reference section 6.4)."""

from __future__ import annotations

import itertools
import logging

import pytest

from kvx.layouts import get_layout
from kvx.topology import HeteroTPTransferConfig, KVGeometry, TpKVTopology, plan_reads


def cfg(
    d_tp: int,
    p_tp: int,
    k: int,
    d_rank: int,
    *,
    mla: bool = False,
    d_len: int = 4096,
    p_len: int = 4096,
    blocks_first: bool = True,
) -> HeteroTPTransferConfig:
    ratio = d_tp // p_tp if d_tp >= p_tp else -(p_tp // d_tp)
    return HeteroTPTransferConfig(
        tp_ratio=ratio, K=k, d_tp=d_tp, p_tp=p_tp, d_rank=d_rank, use_mla=mla,
        d_block_len=d_len, p_block_len=p_len, is_blocks_first=blocks_first,
    )  # fmt: skip


def test_replicated_p_tp8_d_tp2_k2_mamba() -> None:
    """Example 3's Mamba path: FA from one P rank, SSM state from all four."""
    c = [cfg(2, 8, 2, r, d_len=2048, p_len=512) for r in range(2)]
    assert [x.fa_read_targets for x in c] == [[0], [4]]
    assert [x.transfer_targets for x in c] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (c[0].physical_fa_num_reads, c[0].mamba_num_reads) == (1, 4)
    assert c[0].is_p_replicated and not c[0].is_d_replicated
    assert (c[0].d_physical_heads, c[0].p_physical_heads) == (1, 1)
    assert [c[0].should_skip_fa(p) for p in range(4)] == [False, True, True, True]
    assert [c[0].fa_head_slot(p) for p in range(4)] == [0, 0, 0, 0]
    assert c[0].needs_split_handles
    assert c[0].fa_entry_size == 256
    split = c[0].compute_split_handle_data([(1000, 64, 0), (5000, 128, 0)], 1, 4)
    assert split == [[(1000, 64, 0), (5000 + i * 32, 32, 0)] for i in range(4)]
    local, remote = [[1, 2], [3]], [[4, 5], [6]]
    assert c[0].filter_block_ids_for_rank(1, local, remote, [False, True]) == ([[], [3]], [[], [6]])
    assert c[0].filter_block_ids_for_rank(0, local, remote, [False, True]) == (local, remote)


def test_p_tp4_d_tp2_k8_splits_d_block_into_two_chunks() -> None:
    c = cfg(2, 4, 8, 0, d_len=4096, p_len=2048)
    assert c.fa_read_targets == [0, 1] and c.transfer_targets == [0, 1]
    assert c.mamba_num_reads == 2 and c.needs_split_handles
    assert [c.fa_head_slot(p) for p in (0, 1)] == [0, 1]
    split = c.compute_split_handle_data([(0, 4096, 3)], 1, 2)
    assert split == [[(0, 2048, 3)], [(2048, 2048, 3)]]
    assert c.fa_rank_offset(1024) == 0
    assert c.fa_entry_size == 1024


def test_p_tp2_d_tp4_k8_offsets() -> None:
    c = [cfg(4, 2, 8, r, d_len=1024, p_len=2048, blocks_first=False) for r in range(4)]
    assert [x.fa_read_targets for x in c] == [[0], [0], [1], [1]]
    assert [x.fa_rank_offset(512) for x in c] == [0, 512, 0, 512]
    assert not c[0].needs_split_handles and c[0].fa_entry_size == 1024


def test_replicated_d_offsets_are_relative_to_the_p_rank() -> None:
    """K=4, P TP=2 (2 heads each), D TP=8 (D3 holds head 1 = P0's second head)."""
    c = [cfg(8, 2, 4, r) for r in range(8)]
    assert [x.fa_rank_offset(100) for x in c] == [0, 0, 100, 100, 0, 0, 100, 100]
    assert [cfg(8, 2, 2, r).fa_rank_offset(100) for r in range(8)] == [0] * 8


def test_mla_and_ratio_zero() -> None:
    c = cfg(4, 2, 1, 3, mla=True)
    assert c.fa_read_targets == [0] and c.fa_rank_offset(64) == 0 and not c.needs_split_handles
    c = cfg(2, 8, 1, 1, mla=True)
    assert c.fa_read_targets == [0] and c.transfer_targets == [4, 5, 6, 7]
    assert not c.needs_split_handles
    zero = HeteroTPTransferConfig(0, 4, 2, 2, 1, False, 64, 64, False)
    assert zero.fa_read_targets == [1]


def test_describe_and_validate(caplog: pytest.LogCaptureFixture) -> None:
    c = cfg(2, 4, 8, 1, d_len=4096, p_len=2048)
    assert c.describe() == (
        "HeteroTPTransferConfig(tp_ratio=-2, K=8, d_tp=2, p_tp=4, d_rank=1, "
        "physical_fa_reads=2, mamba_reads=2, fa_targets=[2, 3], transfer_targets=[2, 3], "
        "fa_entry_size=1024, d_block_len=4096, p_block_len=2048)"
    )
    with caplog.at_level(logging.WARNING, logger="kvx.topology.hetero"):
        cfg(2, 4, 8, 0, d_len=4096, p_len=4096)
    assert "FA size mismatch" in caplog.text


def test_fa_targets_match_transfer_plans_and_legacy_offsets() -> None:
    """FA targets are the ranks `plan_reads` picks; FA offsets are its head offsets."""
    for d_tp, p_tp, k in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8, 16)):
        d, p = KVGeometry(d_tp, k, 16), KVGeometry(p_tp, k, 16)
        for rank in range(d_tp):
            c = cfg(d_tp, p_tp, k, rank, blocks_first=False)
            plan = plan_reads(d, p, rank)
            assert c.fa_read_targets == list(plan.remote_ranks), (d_tp, p_tp, k, rank)
            assert set(c.fa_read_targets) <= set(c.transfer_targets)
            if c.tp_ratio > 0:
                share = c.d_physical_heads
                assert c.fa_rank_offset(share) == plan.reads[0].remote_head_offset
                t = TpKVTopology(
                    rank,
                    {"D": d_tp, "P": p_tp},
                    False,
                    k,
                    "D",
                    {"D": 16, "P": 16},
                    get_layout("HND"),
                )
                assert c.fa_read_targets == t.get_target_remote_ranks(p_tp)
