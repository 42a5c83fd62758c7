"""`GroupCoordinator` and the process-wide model-parallel groups on torch.distributed.

`init_distributed_environment` joins the world; `initialize_model_parallel` builds every
group kind of `kvx.topology.grid.RankGrid` (vLLM's memberships); `get_tp_group()` and friends
return this rank's coordinators; `destroy_model_parallel()` tears them down. Each coordinator
has a CPU group on gloo and a device group: NCCL when CUDA is available, otherwise the CPU
group itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from kvx.topology.errors import TopologyError
from kvx.topology.grid import RankGrid


class GroupCoordinator:
    """This rank's view of one process group (matches vLLM's `GroupCoordinator` fields).

    Every process must construct it with the same `group_ranks` (torch.distributed creates
    groups collectively); the coordinator keeps the group holding this rank.
    """

    def __init__(
        self,
        group_ranks: Sequence[Sequence[int]],
        local_rank: int,
        device_backend: str | None = None,
        group_name: str = "group",
    ) -> None:
        if not dist.is_initialized():
            raise TopologyError(
                "torch.distributed is not initialised; call init_distributed_environment first"
            )
        self.unique_name = group_name
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        use_cuda = torch.cuda.is_available()
        backend = device_backend or ("nccl" if use_cuda else "gloo")
        self.device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
        mine: list[int] | None = None
        for group in group_ranks:
            members = [int(r) for r in group]
            cpu_group = dist.new_group(members, backend="gloo")
            device_group = (
                cpu_group if backend == "gloo" else dist.new_group(members, backend=backend)
            )
            if self.rank in members:
                mine, self.cpu_group, self.device_group = members, cpu_group, device_group
        if mine is None:
            raise TopologyError(f"{group_name}: rank {self.rank} is in none of {group_ranks}")
        self.ranks = mine
        self.world_size = len(mine)
        self.rank_in_group = mine.index(self.rank)

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        """Global rank after this one in the group (wraps around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank before this one in the group (wraps around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group (in place on the device group) and return it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every member's `tensor`, concatenated along `dim` in the order of `ranks`.

        torch.distributed orders a group by global rank; groups such as vLLM 0.33's DCP groups
        list their ranks in another order, so the parts are put back into `ranks` order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        by_rank = dict(zip(sorted(self.ranks), parts))
        return torch.cat([by_rank[r] for r in self.ranks], dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` with the one of group member `src` (index in the group)."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=self.ranks[src], group=self.device_group)
        return tensor

    def barrier(self) -> None:
        """Wait for every member (on the CPU group)."""
        dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        """Release this rank's process groups."""
        for group in {id(g): g for g in (self.device_group, self.cpu_group)}.values():
            dist.destroy_process_group(group)


_WORLD: GroupCoordinator | None = None
_GROUPS: dict[str, GroupCoordinator] = {}


def init_distributed_environment(
    world_size: int,
    rank: int,
    init_method: str,
    local_rank: int = 0,
    backend: str = "gloo",
    timeout_s: float = 60.0,
) -> GroupCoordinator:
    """Join the world process group (once per process) and return the world coordinator."""
    global _WORLD
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=timeout_s),
        )
    if _WORLD is None:
        _WORLD = GroupCoordinator([list(range(dist.get_world_size()))], local_rank, "gloo", "world")
    return _WORLD


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    prefill_context_model_parallel_size: int = 1,
    decode_context_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    *,
    enable_expert_parallel: bool = False,
    dcp_across_pcp: bool = False,
    backend: str | None = None,
) -> RankGrid:
    """Build the TP, DCP, PCP, PP, DP (and EP) groups of the world (matches vLLM's
    `initialize_model_parallel`); returns the grid they came from."""
    if _WORLD is None:
        raise TopologyError("call init_distributed_environment before initialize_model_parallel")
    if _GROUPS:
        raise TopologyError("model parallel groups exist; call destroy_model_parallel first")
    grid = RankGrid(
        world_size=_WORLD.world_size,
        tp_size=tensor_model_parallel_size,
        pp_size=pipeline_model_parallel_size,
        dp_size=data_parallel_size,
        pcp_size=prefill_context_model_parallel_size,
        dcp_size=decode_context_model_parallel_size,
        dcp_across_pcp=dcp_across_pcp,
    )
    kinds = ["tp", "dcp", "pcp", "pp", "dp"] + (["ep"] if enable_expert_parallel else [])
    for kind in kinds:
        _GROUPS[kind] = GroupCoordinator(grid.groups(kind), _WORLD.local_rank, backend, kind)
    return grid


def model_parallel_is_initialized() -> bool:
    return bool(_GROUPS)


def _group(kind: str) -> GroupCoordinator:
    if kind not in _GROUPS:
        hint = " (pass enable_expert_parallel=True)" if kind == "ep" else ""
        raise TopologyError(f"the {kind} group is not initialised{hint}")
    return _GROUPS[kind]


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise TopologyError("the world group is not initialised")
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    return _group("tp")


def get_pp_group() -> GroupCoordinator:
    return _group("pp")


def get_dp_group() -> GroupCoordinator:
    return _group("dp")


def get_pcp_group() -> GroupCoordinator:
    return _group("pcp")


def get_dcp_group() -> GroupCoordinator:
    return _group("dcp")


def get_ep_group() -> GroupCoordinator:
    return _group("ep")


def destroy_model_parallel() -> None:
    """Destroy every model-parallel group (the world stays)."""
    for coordinator in _GROUPS.values():
        coordinator.destroy()
    _GROUPS.clear()


def destroy_distributed_environment() -> None:
    """Destroy the model-parallel groups and leave the world process group."""
    global _WORLD
    destroy_model_parallel()
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
