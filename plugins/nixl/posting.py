"""Posting one request's NIXL READs on D: descriptor lists prepared once per head slice and
remote rank, transfers made per request with `make_prepped_xfer` (split out of `worker.py`).

Making a request's transfers (`prepare_*`) and posting them (`post`) are two steps so that the
worker makes every request of a step first and then posts them back to back: on one machine
UCX copies inside the post (`cma`, `process_vm_readv`), each copy evicts the CPU caches, and
Python run between two copies ran several times slower than warm (see docs/performance.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvx.plugins.nixl.handshake import AgentMetadata, Region
from kvx.plugins.nixl.metadata import RemoteRead
from kvx.plugins.nixl.regions import block_descs
from kvx.plugins.nixl.remote import RankKey, RemoteEngine
from kvx.plugins.nixl.staging import Staging, plan_staging
from kvx.topology import KVGeometry

LOCAL = "NIXL_INIT_AGENT"


@dataclass
class ReadJob:
    spec: RemoteRead
    remote: RemoteEngine
    local_block_ids: list[int]
    start_token: int
    started: float
    groups: list[tuple[list[int], int]] = field(default_factory=list)
    """Per KV-cache group, the local blocks read and the index of the first in the prompt."""
    handles: list[Any] = field(default_factory=list)
    keys: list[RankKey] = field(default_factory=list)  # the remote worker of each handle
    staging: Staging | None = None
    nbytes: int = 0
    ndescs: int = 0


@dataclass(frozen=True)
class GroupRegions:
    """The paired regions of one KV-cache group's layers: first descriptor ids (local,
    remote) and the bytes one block of them moves."""

    group: int
    local_firsts: np.ndarray
    remote_firsts: np.ndarray
    block_bytes: int


@dataclass(frozen=True)
class DirectRead:
    """One READ every request makes from one remote worker and head slice, but its block ids:
    both prepared lists and the paired regions of each KV-cache group."""

    key: RankKey
    local_dlist: Any
    remote_dlist: Any
    groups: tuple[GroupRegions, ...]


@dataclass
class ReadPoster:
    """This worker's registered KV (regions, `heads` per block, device and memory type) and
    the local descriptor lists prepared on it; posts READs for `ReadJob`s."""

    agent: Any
    caches: dict[str, torch.Tensor]
    regions: list[Region]
    heads: int
    block_size: int
    head_size: int
    device: int
    mem_type: str
    group_of: dict[str, int] = field(default_factory=dict)
    """The KV-cache group of each layer (absent: group 0)."""
    _local_dlists: dict[tuple[int, int], Any] = field(default_factory=dict, init=False)
    _index: dict[tuple[str, int], int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._index = {(r.layer, r.kv): i for i, r in enumerate(self.regions)}

    def _local_dlist(self, head_offset: int, num_heads: int) -> Any:
        key = (head_offset, num_heads)
        if key not in self._local_dlists:
            descs = block_descs(self.regions, head_offset, num_heads, self.heads, self.device)
            self._local_dlists[key] = self.agent.prep_xfer_dlist(LOCAL, descs, self.mem_type)
        return self._local_dlists[key]

    def _make_remote_dlist(
        self, agent: str, meta: AgentMetadata, head_offset: int, num_heads: int
    ) -> Any:
        heads = len(
            KVGeometry(
                meta.tp_size, meta.num_kv_heads, meta.block_size, meta.layout, meta.is_mla
            ).heads_of(meta.tp_rank)
        )
        descs = block_descs(meta.regions, head_offset, num_heads, heads, meta.device_id)
        return self.agent.prep_xfer_dlist(agent, descs, meta.mem_type)

    def _make(
        self,
        job: ReadJob,
        local_dlist: Any,
        local_ids: list[int] | np.ndarray,
        key: RankKey,
        remote_dlist: Any,
        remote_ids: list[int] | np.ndarray,
        nbytes: int,
    ) -> None:
        handle = self.agent.make_prepped_xfer(
            "READ", local_dlist, local_ids, remote_dlist, remote_ids
        )
        job.handles.append(handle)
        job.keys.append(key)
        job.nbytes += nbytes
        job.ndescs += len(local_ids)

    def post(self, job: ReadJob) -> None:
        """Post every READ `prepare_*` made for `job` (on one machine each copies here)."""
        for handle, key in zip(job.handles, job.keys, strict=True):
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError(f"NIXL refused to post a READ from {job.remote.agents[key]}")

    def prepare_direct(self, job: ReadJob) -> None:
        """Make the READs of each remote (head slice of a) block straight into the local
        block."""
        remote, spec = job.remote, job.spec
        reads = remote.direct_reads
        if reads is None:
            reads = remote.direct_reads = self._direct_reads(remote)
        blocks = []  # per group: local and remote block ids
        for (local, first), (_, theirs) in zip(job.groups, spec.tables(), strict=True):
            remote_ids = theirs[first : first + len(local)]
            if len(remote_ids) != len(local):
                raise ValueError(f"P sent {len(theirs)} blocks for {spec.remote_num_tokens} tokens")
            blocks.append(
                (np.asarray(local, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64))
            )
        for read in reads:  # region-major ids: every block of region 0, then region 1...
            local_ids, rids, nbytes = [], [], 0
            for regions in read.groups:
                local_blocks, remote_blocks = blocks[regions.group]
                if not len(local_blocks):
                    continue
                local_ids.append(_ids(regions.local_firsts, local_blocks))
                rids.append(_ids(regions.remote_firsts, remote_blocks))
                nbytes += len(local_blocks) * regions.block_bytes
            if local_ids:
                self._make(
                    job,
                    read.local_dlist,
                    np.concatenate(local_ids),
                    read.key,
                    read.remote_dlist,
                    np.concatenate(rids),
                    nbytes,
                )

    def _direct_reads(self, remote: RemoteEngine) -> list[DirectRead]:
        """Every READ one request makes from `remote` (per head slice and remote worker),
        without its block ids: the same for every request, so worked out on the first."""
        reads = []
        stages = sorted(set(remote.stage_of_layer.values()))
        for read in remote.plan.reads:
            num_heads = read.num_heads
            full = num_heads == self.heads
            lo, nh = (0, 0) if full else (read.local_head_offset, read.num_heads)
            local_dlist = self._local_dlist(lo, nh)
            remote_heads = len(remote.geometry.heads_of(read.remote_tp_rank))
            whole = read.num_heads == remote_heads and full
            ro, rnh = (0, 0) if whole else (read.remote_head_offset, read.num_heads)
            for stage in stages:
                key = (stage, read.remote_tp_rank)
                groups = self._pair_regions(remote.metas[key], num_heads)
                if groups:
                    remote_dlist = remote.remote_dlist(key, ro, rnh, self._make_remote_dlist)
                    reads.append(DirectRead(key, local_dlist, remote_dlist, groups))
        return reads

    def _pair_regions(self, meta: AgentMetadata, num_heads: int) -> tuple[GroupRegions, ...]:
        """Per KV-cache group, the first descriptor id of every remote region of `meta` that
        has a local region (same layer and K/V) and of that local region, and the bytes one
        block of all of them moves with `num_heads` heads: the same for every request, so
        worked out once."""
        pairs: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for ri, region in enumerate(meta.regions):
            li = self._index.get((region.layer, region.kv))
            if li is None:
                continue
            mine = self.regions[li]
            local, remote, nbytes = pairs.setdefault(self.group_of.get(mine.layer, 0), ([], [], []))
            local.append(li * mine.num_blocks)
            remote.append(ri * region.num_blocks)
            nbytes.append(mine.block_len * num_heads // self.heads)
        return tuple(
            GroupRegions(
                g,
                np.asarray(local, dtype=np.int64),
                np.asarray(remote, dtype=np.int64),
                sum(nbytes),
            )
            for g, (local, remote, nbytes) in sorted(pairs.items())
        )

    def prepare_staged(self, job: ReadJob) -> None:
        """Make the READs of whole remote blocks into registered staging buffers (see
        `staging.py`)."""
        cache = next(iter(self.caches.values()))
        staging = plan_staging(
            job.remote,
            job.spec.remote_block_ids,
            job.spec.remote_num_tokens,
            job.start_token,
            list(self.caches),
            self.head_size,
            cache.dtype,
            cache.device,
        )
        staging.registration = self.agent.register_memory(
            [
                (t.data_ptr(), t.numel() * t.element_size(), self.device, "")
                for t in staging.tensors.values()
            ],
            self.mem_type,
        )
        job.staging = staging
        for read in staging.reads:
            descs = block_descs(read.regions, device=self.device)
            dlist = self.agent.prep_xfer_dlist(LOCAL, descs, self.mem_type)
            staging.dlists.append(dlist)
            remote_dlist = job.remote.remote_dlist(read.key, 0, 0, self._make_remote_dlist)
            nbytes = sum(r.block_len * r.num_blocks for r in read.regions)
            local_ids = list(range(len(read.remote_ids)))
            self._make(job, dlist, local_ids, read.key, remote_dlist, read.remote_ids, nbytes)

    def release(self) -> None:
        """Release the prepared local descriptor lists."""
        for dlist in self._local_dlists.values():
            self.agent.release_dlist_handle(dlist)
        self._local_dlists.clear()


def _ids(firsts: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Descriptor ids `first + block` for every first (region) and block, region-major, as
    the int32 array NIXL takes without converting a Python list."""
    return (firsts[:, None] + blocks[None, :]).ravel().astype(np.int32)
