"""RankGrid memberships equal vLLM's tensor expressions (`initialize_model_parallel`) for every
small grid, and bad sizes are refused with a reason."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvx.topology import RankCoords, RankGrid, TopologyError


def _vllm_groups(grid: RankGrid) -> dict[str, list[list[int]]]:
    """vLLM's group construction, written with torch as vLLM writes it."""
    _, dp, pp, pcp, tp = grid.shape
    ranks = torch.arange(grid.world_size).reshape(-1, dp, pp, pcp, tp)
    dcp_base = ranks.transpose(3, 4) if grid.dcp_across_pcp else ranks
    return {
        "tp": ranks.view(-1, tp).tolist(),
        "dcp": dcp_base.reshape(-1, grid.dcp_size).tolist(),
        "pcp": ranks.transpose(3, 4).reshape(-1, pcp).tolist(),
        "pp": ranks.transpose(2, 4).reshape(-1, pp).tolist(),
        "dp": ranks.transpose(1, 4).reshape(-1, dp).tolist(),
        "ep": ranks.transpose(1, 2).reshape(-1, dp * pcp * tp).tolist(),
        "world": [list(range(grid.world_size))],
    }


def _grids() -> list[RankGrid]:
    out = []
    for world, tp, pp, dp, pcp in itertools.product((1, 2, 4, 8, 16), *[(1, 2, 4)] * 4):
        if world % (tp * pp * dp * pcp):
            continue
        for dcp, across in itertools.product((1, 2, 4), (False, True)):
            if (pcp * tp if across else tp) % dcp == 0:
                out.append(RankGrid(world, tp, pp, dp, pcp, dcp, across))
    return out


def test_every_small_grid_matches_vllm() -> None:
    grids = _grids()
    assert len(grids) > 300
    for grid in grids:
        want = _vllm_groups(grid)
        for kind, groups in want.items():
            assert grid.groups(kind) == groups, (grid, kind)
        for rank in range(grid.world_size):
            assert grid.rank_of(grid.coords(rank)) == rank
            assert rank in grid.group_of("tp", rank)


def test_coords() -> None:
    grid = RankGrid(16, tp_size=2, pp_size=2, dp_size=2)  # two external DP replicas
    assert grid.shape == (2, 2, 2, 1, 2)
    assert grid.coords(13) == RankCoords(external_dp=1, dp=1, pp=0, pcp=0, tp=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 6, "tp_size": 4}, "not a multiple of dp\\*pp\\*pcp\\*tp"),
        ({"world_size": 4, "tp_size": 2, "dcp_size": 4}, "dcp_size=4 must divide tp_size=2"),
        ({"world_size": 4, "tp_size": 0}, "tp_size must be an int >= 1"),
    ],
)
def test_bad_sizes(kwargs: dict, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        RankGrid(**kwargs)


def test_bad_lookups() -> None:
    grid = RankGrid(4, tp_size=2)
    with pytest.raises(TopologyError, match="group kind must be one of"):
        grid.groups("xp")
    with pytest.raises(TopologyError, match=r"rank must be in \[0, 4\)"):
        grid.group_of("tp", 4)
