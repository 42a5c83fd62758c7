"""TP/PP topology: the rank grid, KV head ownership per rank and transfer plans between engines."""

from __future__ import annotations

from kvx.topology.errors import TopologyError
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
    plan_reads,
    readers_per_remote_rank,
)
from kvx.topology.tp_kv import TpKVTopology

__all__ = [
    "BlockSpan",
    "HeadRead",
    "HeteroTPTransferConfig",
    "KVGeometry",
    "TopologyError",
    "TpKVTopology",
    "TransferPlan",
    "check_compatible",
    "check_tp_heads",
    "head_holders",
    "is_kv_replicated",
    "is_primary_holder",
    "num_physical_heads",
    "physical_head_range",
    "plan_reads",
    "readers_per_remote_rank",
]
