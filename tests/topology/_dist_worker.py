"""Child process body for the multi-process torch.distributed tests (imported by spawn)."""

from __future__ import annotations

import traceback
from typing import Any

import torch

# Configurations checked in one launch: keyword arguments of initialize_model_parallel.
KINDS = ("tp", "dcp", "pcp", "pp", "dp", "ep")


def run(rank: int, world_size: int, port: int, configs: list[dict[str, Any]], results: Any) -> None:
    """Join the world, then for each config build the groups, record this rank's view of every
    group and the all_reduce of the global ranks over it, and tear the groups down."""
    from kvx.topology import coordinator as c

    try:
        c.init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", rank)
        views = []
        for config in configs:
            c.initialize_model_parallel(**config, enable_expert_parallel=True)
            view = {}
            getters = {
                "tp": c.get_tp_group,
                "dcp": c.get_dcp_group,
                "pcp": c.get_pcp_group,
                "pp": c.get_pp_group,
                "dp": c.get_dp_group,
                "ep": c.get_ep_group,
                "world": c.get_world_group,
            }
            for kind, get in getters.items():
                g = get()
                total = g.all_reduce(torch.tensor([rank], dtype=torch.int64)).item()
                gathered = g.all_gather(torch.tensor([rank])).tolist()
                view[kind] = {
                    "ranks": g.ranks,
                    "world_size": g.world_size,
                    "rank_in_group": g.rank_in_group,
                    "local_rank": g.local_rank,
                    "first_last": (g.first_rank, g.last_rank, g.is_first_rank, g.is_last_rank),
                    "next_prev": (g.next_rank, g.prev_rank),
                    "sum": total,
                    "gathered": gathered,
                    "cpu_backend": str(torch.distributed.get_backend(g.cpu_group)),
                }
            c.get_tp_group().barrier()
            c.destroy_model_parallel()
            views.append(view)
        c.destroy_distributed_environment()
        results.put((rank, views, None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
