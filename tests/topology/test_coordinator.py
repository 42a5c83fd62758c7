"""GroupCoordinator on real multi-process torch.distributed (gloo, spawn): every rank's group
membership matches the rank grid (vLLM's), and a collective runs in each group."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
from typing import Any

import pytest

from kvx.topology import RankGrid, TopologyError
from kvx.topology import coordinator as c

from . import _dist_worker

# One launch per world size (spawning ranks dominates the cost); world 8 also covers external
# DP replicas (world larger than dp*pp*pcp*tp) and vLLM 0.33's DCP-across-PCP order.
CONFIGS: dict[int, list[dict[str, Any]]] = {
    2: [
        {"tensor_model_parallel_size": 2},
        {"pipeline_model_parallel_size": 2},
        {"data_parallel_size": 2},
    ],
    8: [
        {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4},
        {"tensor_model_parallel_size": 2, "prefill_context_model_parallel_size": 2,
         "pipeline_model_parallel_size": 2},
        {"tensor_model_parallel_size": 4, "decode_context_model_parallel_size": 2,
         "data_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
         "data_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "decode_context_model_parallel_size": 2,
         "data_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "prefill_context_model_parallel_size": 2,
         "decode_context_model_parallel_size": 4, "dcp_across_pcp": True},
    ],
}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(world_size: int, configs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Run `_dist_worker.run` on `world_size` spawned ranks; always reap the children."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_dist_worker.run, args=(r, world_size, port, configs, results))
        for r in range(world_size)
    ]
    views: dict[int, list[dict[str, Any]]] = {}
    try:
        for p in procs:
            p.start()
        for _ in range(world_size):
            try:
                rank, view, error = results.get(timeout=90)
            except queue.Empty:
                pytest.fail(f"only {len(views)} of {world_size} ranks reported within 90 s")
            assert error is None, f"rank {rank} failed:\n{error}"
            views[rank] = view
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return views


def _sizes(config: dict[str, Any], world_size: int) -> RankGrid:
    return RankGrid(
        world_size=world_size,
        tp_size=config.get("tensor_model_parallel_size", 1),
        pp_size=config.get("pipeline_model_parallel_size", 1),
        dp_size=config.get("data_parallel_size", 1),
        pcp_size=config.get("prefill_context_model_parallel_size", 1),
        dcp_size=config.get("decode_context_model_parallel_size", 1),
        dcp_across_pcp=config.get("dcp_across_pcp", False),
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", sorted(CONFIGS))
def test_groups_on_real_processes(world_size: int) -> None:
    configs = CONFIGS[world_size]
    views = _launch(world_size, configs)
    for i, config in enumerate(configs):
        grid = _sizes(config, world_size)
        for rank in range(world_size):
            for kind, g in views[rank][i].items():
                ranks = grid.group_of(kind, rank)
                pos = ranks.index(rank)
                assert g["ranks"] == ranks, (config, rank, kind)
                assert g["world_size"] == len(ranks) and g["rank_in_group"] == pos
                assert g["local_rank"] == rank
                assert g["first_last"] == (ranks[0], ranks[-1], rank == ranks[0], rank == ranks[-1])
                n = len(ranks)
                assert g["next_prev"] == (ranks[(pos + 1) % n], ranks[(pos - 1) % n])
                assert g["sum"] == sum(ranks), (config, rank, kind)
                assert g["gathered"] == ranks
                assert g["cpu_backend"] == "gloo"


def test_documented_examples() -> None:
    """TP=2, PP=4 on 8 ranks (reference section 6.1)."""
    grid = RankGrid(8, tp_size=2, pp_size=4)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_helpers_refuse_out_of_order_use() -> None:
    if c.model_parallel_is_initialized():
        pytest.fail("model parallel state leaked into the test process")
    with pytest.raises(TopologyError, match="init_distributed_environment"):
        c.initialize_model_parallel(1)
    with pytest.raises(TopologyError, match="tp group is not initialised"):
        c.get_tp_group()
    with pytest.raises(TopologyError, match="enable_expert_parallel"):
        c.get_ep_group()
