"""TP/PP topology: the rank grid, KV head ownership per rank and transfer plans between engines.

Everything here is plain arithmetic except the torch.distributed group helpers of
`kvx.topology.coordinator`, which are imported on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvx.topology.byte_runs import block_byte_runs
from kvx.topology.errors import TopologyError
from kvx.topology.grid import GROUP_KINDS, RankCoords, RankGrid
from kvx.topology.heads import (
    check_tp_heads,
    head_holders,
    is_kv_replicated,
    is_primary_holder,
    num_physical_heads,
    physical_head_range,
)
from kvx.topology.hetero import HeteroTPTransferConfig
from kvx.topology.plan import (
    BlockSpan,
    HeadRead,
    KVGeometry,
    TransferPlan,
    check_compatible,
    check_layout,
    plan_reads,
    readers_per_remote_rank,
)
from kvx.topology.pp import (
    RankRef,
    StagePlan,
    extract_layer_index,
    layer_sources,
    plan_stage_reads,
    pp_layer_range,
    readers_per_remote_worker,
    stage_layer_names,
)
from kvx.topology.tp_kv import TpKVTopology

if TYPE_CHECKING:
    from kvx.topology.coordinator import (
        GroupCoordinator,
        destroy_distributed_environment,
        destroy_model_parallel,
        get_dcp_group,
        get_dp_group,
        get_ep_group,
        get_pcp_group,
        get_pp_group,
        get_tp_group,
        get_world_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

_LAZY = (
    "GroupCoordinator",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_dcp_group",
    "get_dp_group",
    "get_ep_group",
    "get_pcp_group",
    "get_pp_group",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("kvx.topology.coordinator"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GROUP_KINDS",
    "BlockSpan",
    "GroupCoordinator",
    "HeadRead",
    "HeteroTPTransferConfig",
    "KVGeometry",
    "RankCoords",
    "RankGrid",
    "RankRef",
    "StagePlan",
    "TopologyError",
    "TpKVTopology",
    "TransferPlan",
    "block_byte_runs",
    "check_compatible",
    "check_layout",
    "check_tp_heads",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "extract_layer_index",
    "get_dcp_group",
    "get_dp_group",
    "get_ep_group",
    "get_pcp_group",
    "get_pp_group",
    "get_tp_group",
    "get_world_group",
    "head_holders",
    "init_distributed_environment",
    "initialize_model_parallel",
    "is_kv_replicated",
    "is_primary_holder",
    "layer_sources",
    "num_physical_heads",
    "physical_head_range",
    "plan_reads",
    "plan_stage_reads",
    "pp_layer_range",
    "readers_per_remote_rank",
    "readers_per_remote_worker",
    "stage_layer_names",
]
