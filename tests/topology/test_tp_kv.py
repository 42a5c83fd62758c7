"""TpKVTopology reproduces vLLM's legacy results on the cases of the reference (section 6)."""

from __future__ import annotations

import itertools

import pytest

from kvx.layouts import get_layout
from kvx.topology import KVGeometry, TopologyError, TpKVTopology, plan_reads


def topo(
    d_tp: int, p_tp: int, k: int, rank: int = 0, *, mla: bool = False, **kw: object
) -> TpKVTopology:
    block = kw.pop("block_sizes", (16, 16))
    assert isinstance(block, tuple)
    return TpKVTopology(
        tp_rank=rank,
        remote_tp_size={"D": d_tp, "P": p_tp},
        is_mla=mla,
        total_num_kv_heads=k,
        engine_id="D",
        remote_block_size={"D": block[0], "P": block[1]},
        layout=get_layout(str(kw.pop("layout", "MLA" if mla else "HND"))),
        is_mamba=bool(kw.pop("is_mamba", False)),
    )


def test_example_1_p_tp4_d_tp2() -> None:
    t = [topo(2, 4, 8, r) for r in range(2)]
    assert t[0].tp_ratio(4) == -2 and t[0].tp_ratio_from_engine_id("P") == -2
    assert [x.get_target_remote_ranks(4) for x in t] == [[0, 1], [2, 3]]
    assert not t[0].is_kv_replicated("P") and not t[0].replicates_kv_cache("P")
    assert t[0].local_consumers(4) == 1
    assert [x.head_offset(4) for x in t] == [0, 0]


def test_example_2_p_tp2_d_tp4() -> None:
    t = [topo(4, 2, 8, r) for r in range(4)]
    assert t[0].tp_ratio(2) == 2
    assert [x.get_target_remote_ranks_from_engine_id("P") for x in t] == [[0], [0], [1], [1]]
    assert [x.head_offset(2) for x in t] == [0, 1, 0, 1]
    assert [x.physical_head_range() for x in t] == [range(2 * r, 2 * r + 2) for r in range(4)]
    assert t[0].physical_head_range("P", 1) == range(4, 8)
    assert t[0].local_consumers(2) == 2


def test_example_3_replication_k2() -> None:
    t = [topo(8, 2, 2, r) for r in range(8)]
    assert t[0].tp_ratio(2) == 4
    assert [x.get_target_remote_ranks(2) for x in t] == [[r // 4] for r in range(8)]
    assert [x.head_offset(2) for x in t] == [0] * 8
    assert t[0].is_kv_replicated("D") and not t[0].is_kv_replicated("P")  # 2 == K: not
    assert [x.physical_head_range() for x in t] == [range(r // 4, r // 4 + 1) for r in range(8)]
    assert t[0].local_consumers(2) == 4
    t = [topo(8, 4, 2, r) for r in range(8)]
    assert [x.get_target_remote_ranks(4) for x in t] == [[r // 2] for r in range(8)]
    assert [x.head_offset(4) for x in t] == [0] * 8
    t = [topo(2, 8, 2, r) for r in range(2)]
    assert t[0].tp_ratio(8) == -4 and t[0].is_kv_replicated("P")
    assert [x.get_target_remote_ranks(8) for x in t] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [topo(8, 8, 2, r).get_target_remote_ranks(8) for r in range(8)] == [
        [r] for r in range(8)
    ]


def test_example_4_mla() -> None:
    t = [topo(4, 2, 1, r, mla=True) for r in range(4)]
    assert [x.get_target_remote_ranks(2) for x in t] == [[0], [0], [1], [1]]
    assert t[0].replicates_kv_cache("P") and t[0].physical_head_range() == range(1)
    assert [x.head_offset(2) for x in t] == [0] * 4
    assert not t[0].split_k_and_v and not t[0].is_kv_layout_blocks_first


def test_example_5_block_size_ratio() -> None:
    assert topo(1, 1, 4, block_sizes=(32, 16)).block_size_ratio(16) == 2
    assert topo(1, 1, 4, block_sizes=(32, 16)).block_size_ratio_from_engine_id("P") == 2
    with pytest.raises(TopologyError, match="not a multiple of remote block size 32"):
        topo(1, 1, 4, block_sizes=(16, 32)).block_size_ratio_from_engine_id("P")


def test_head_offset_into_a_multi_head_remote_block() -> None:
    """K=4, P TP=1, D TP=8 (D replicated): D5 holds head 2, P0 holds heads 0-3."""
    assert topo(8, 1, 4, 5).head_offset(1) == 2


@pytest.mark.parametrize(
    ("layout", "mla", "mamba", "blocks_first", "split", "cross"),
    [
        ("HND", False, False, False, True, False),
        ("NHD", False, False, False, True, False),
        ("FLASHINFER_HND", False, False, True, False, False),
        ("CPU_PACKED", False, False, True, False, False),
        ("CROSS_HND", False, False, False, False, True),
        ("MLA", True, False, False, False, False),
        ("HND", False, True, True, False, False),
    ],
)
def test_region_flags(
    layout: str, mla: bool, mamba: bool, blocks_first: bool, split: bool, cross: bool
) -> None:
    t = topo(2, 2, 1 if mla else 4, mla=mla, layout=layout, is_mamba=mamba)
    assert (t.is_kv_layout_blocks_first, t.split_k_and_v, t.cross_layers_blocks) == (
        blocks_first,
        split,
        cross,
    )


def test_bad_input_says_why() -> None:
    with pytest.raises(TopologyError, match="TP size 4 and remote TP size 3 must divide"):
        topo(4, 3, 12).tp_ratio(3)
    with pytest.raises(TopologyError, match="must include the local engine"):
        TpKVTopology(0, {"P": 2}, False, 4, "D", {"D": 16}, get_layout("HND"))
    with pytest.raises(TopologyError, match=r"tp_rank must be in \[0, 2\)"):
        topo(2, 2, 4, 2)
    with pytest.raises(TopologyError, match="layout must be a layout object"):
        TpKVTopology(0, {"D": 2}, False, 4, "D", {"D": 16}, "HND")  # type: ignore[arg-type]


def test_agrees_with_transfer_plans() -> None:
    """Legacy targets and offsets are what `plan_reads` reads, except that plans read a
    replicated remote's duplicate heads only once."""
    for d_tp, p_tp, k in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8, 16)):
        for rank in range(d_tp):
            t = topo(d_tp, p_tp, k, rank)
            plan = plan_reads(t.geometry("D"), t.geometry("P"), rank)
            legacy = t.get_target_remote_ranks(p_tp)
            if t.tp_ratio(p_tp) < 0 and t.is_kv_replicated("P"):
                assert set(plan.remote_ranks) < set(legacy)
            else:
                assert list(plan.remote_ranks) == legacy
            if t.tp_ratio(p_tp) > 1:
                share = len(t.physical_head_range())
                assert plan.reads[0].remote_head_offset == t.head_offset(p_tp) * share
    assert topo(2, 4, 8).geometry("P") == KVGeometry(4, 8, 16, "HND")
