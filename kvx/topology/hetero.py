"""`HeteroTPTransferConfig`: per (D rank, P engine) read targets for hybrid attention + Mamba.

When P TP > D TP, attention (FA) KV may be replicated across P ranks while Mamba conv/SSM
state is sharded over all of them, so a D rank reads FA data from fewer P ranks than Mamba
state. Fields, methods and results match vLLM's legacy `HeteroTPTransferConfig`; sizes are in
bytes, descriptors are `(address, length, device)` triples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvx.topology.heads import physical_head_range

logger = logging.getLogger(__name__)

Descriptor = tuple[int, int, int]
"""(address, length in bytes, device id), as NIXL takes them."""


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), max(max(a.start, b.start), min(a.stop, b.stop)))


@dataclass
class HeteroTPTransferConfig:
    """Read targets and descriptor sizes for one D rank reading one P engine.

    `fa_*` concerns attention KV, `mamba_*` the Mamba conv/SSM state. Block lengths are one
    layer's bytes per block (K+V together when `is_blocks_first`).
    """

    tp_ratio: int
    """vLLM's sign convention: `d_tp // p_tp` if D TP >= P TP, else `-(p_tp // d_tp)`."""
    K: int
    """Total KV heads before TP sharding (vLLM's field name)."""
    d_tp: int
    p_tp: int
    d_rank: int
    use_mla: bool
    d_block_len: int
    p_block_len: int
    is_blocks_first: bool

    d_physical_heads: int = field(init=False)
    p_physical_heads: int = field(init=False)
    fa_read_targets: list[int] = field(init=False)
    """P ranks holding distinct FA heads this D rank needs, in head order."""
    physical_fa_num_reads: int = field(init=False)
    transfer_targets: list[int] = field(init=False)
    """Every P rank this D rank reads (FA and Mamba)."""
    mamba_num_reads: int = field(init=False)
    fa_entry_size: int = field(init=False)
    """Bytes of one FA descriptor entry (K or V half for blocks-first), same on both sides."""
    is_d_replicated: bool = field(init=False)
    is_p_replicated: bool = field(init=False)

    def __post_init__(self) -> None:
        k = self.K
        self.is_d_replicated = self.d_tp > k
        self.is_p_replicated = self.p_tp > k
        self.d_physical_heads = max(1, k // self.d_tp)
        self.p_physical_heads = max(1, k // self.p_tp)
        spread = -self.tp_ratio if self.tp_ratio < 0 else 1
        mamba = (
            range(self.d_rank * spread, (self.d_rank + 1) * spread) if self.tp_ratio < 0 else None
        )
        if self.use_mla:
            self.fa_read_targets = [0]
        elif self.tp_ratio > 0:
            self.fa_read_targets = [self.d_rank // self.tp_ratio]
        elif self.tp_ratio == 0:
            self.fa_read_targets = [self.d_rank]
        else:
            # Prefer P ranks inside the Mamba range so FA targets are also transfer targets.
            self.fa_read_targets = self._distinct_head_ranks(mamba) or self._distinct_head_ranks(
                range(self.p_tp)
            )
        self.physical_fa_num_reads = len(self.fa_read_targets)
        if mamba is not None and spread > self.physical_fa_num_reads:
            self.mamba_num_reads, self.transfer_targets = spread, list(mamba)
        else:
            self.mamba_num_reads = self.physical_fa_num_reads
            self.transfer_targets = list(self.fa_read_targets)
        smaller = min(self.d_block_len, self.p_block_len)
        self.fa_entry_size = smaller // 2 if self.is_blocks_first else smaller
        self._validate()

    def _distinct_head_ranks(self, candidates: range | None) -> list[int]:
        """First rank of `candidates` for each distinct overlap with D's heads."""
        needs = physical_head_range(self.K, self.d_tp, self.d_rank)
        picked: dict[tuple[int, int], int] = {}
        for p in candidates or ():
            common = _overlap(needs, physical_head_range(self.K, self.p_tp, p))
            if common:
                picked.setdefault((common.start, common.stop), p)
        return list(picked.values())

    def _validate(self) -> None:
        """Log inconsistencies (vLLM logs rather than raises here)."""
        missing = [t for t in self.fa_read_targets if t not in self.transfer_targets]
        for t in missing:
            logger.error(
                "FA target P rank %d is not among transfer targets %s; its FA reads would be "
                "missed",
                t,
                self.transfer_targets,
            )
        if self.is_blocks_first and self.tp_ratio < 0 and self.physical_fa_num_reads > 0:
            per_read = self.d_block_len // 2 // self.physical_fa_num_reads
            if per_read != self.p_block_len // 2:
                logger.warning(
                    "FA size mismatch: D K-half %d / %d reads = %d bytes but P K-half is %d; "
                    "head counts or the Mamba-inflated block length disagree",
                    self.d_block_len // 2,
                    self.physical_fa_num_reads,
                    per_read,
                    self.p_block_len // 2,
                )

    def should_skip_fa(self, p_rank: int) -> bool:
        """True if `p_rank` is read only for Mamba state, not FA KV."""
        return p_rank not in self.fa_read_targets

    def fa_head_slot(self, p_rank: int) -> int:
        """Which chunk of D's FA block `p_rank`'s heads go to: its index among the FA targets,
        or (a replica) the index of the target holding the same head; 0 if none does."""
        if p_rank in self.fa_read_targets:
            return self.fa_read_targets.index(p_rank)
        heads = physical_head_range(self.K, self.p_tp, p_rank)
        for slot, target in enumerate(self.fa_read_targets):
            if _overlap(heads, physical_head_range(self.K, self.p_tp, target)):
                return slot
        return 0

    def fa_rank_offset(self, remote_kv_block_len: int) -> int:
        """Byte offset of this D rank's heads inside the P rank's FA block (0 unless D TP > P
        TP, non-MLA); `remote_kv_block_len` is the bytes of one D rank's share."""
        if self.use_mla or self.tp_ratio <= 0:
            return 0
        if self.is_d_replicated:
            d_head = self.d_rank * self.K // self.d_tp
            p_first = self.fa_read_targets[0] * self.K // self.p_tp
            return (d_head - p_first) * remote_kv_block_len
        return self.d_rank % self.tp_ratio * remote_kv_block_len

    @property
    def needs_split_handles(self) -> bool:
        """True if the local handle must be split per P rank (P TP > D TP, non-MLA, several
        transfer targets)."""
        return self.tp_ratio < 0 and not self.use_mla and len(self.transfer_targets) > 1

    def compute_split_handle_data(
        self, src_blocks_data: list[Descriptor], num_fa_descs: int, abs_tp: int
    ) -> list[list[Descriptor]]:
        """Per transfer target, the local descriptors cut to that P rank's share.

        The first `num_fa_descs` descriptors are FA: cut into `physical_fa_num_reads` chunks,
        the target gets chunk `fa_head_slot`. The rest are Mamba: cut into `abs_tp` chunks,
        the `i`-th target gets chunk `i`.
        """
        if self.physical_fa_num_reads < 1:
            raise ValueError("no FA read targets: nothing to split FA descriptors by")
        handles = []
        for index, p_rank in enumerate(self.transfer_targets):
            slot = 0 if self.should_skip_fa(p_rank) else self.fa_head_slot(p_rank)
            data = []
            for j, (addr, length, dev) in enumerate(src_blocks_data):
                if j < num_fa_descs:
                    chunk = length // self.physical_fa_num_reads
                    data.append((addr + slot * chunk, chunk, dev))
                else:
                    chunk = length // abs_tp
                    data.append((addr + index * chunk, chunk, dev))
            handles.append(data)
        return handles

    def filter_block_ids_for_rank(
        self,
        remote_rank: int,
        local_ids: list[list[int]],
        remote_ids: list[list[int]],
        is_mamba_group: list[bool],
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Per KV-cache group block ids to read from `remote_rank`: unchanged if it carries FA
        data for this D rank, else only the Mamba groups' (FA groups emptied)."""
        if not self.should_skip_fa(remote_rank):
            return local_ids, remote_ids
        keep = range(len(local_ids))
        return (
            [local_ids[g] if is_mamba_group[g] else [] for g in keep],
            [remote_ids[g] if is_mamba_group[g] else [] for g in keep],
        )

    def describe(self) -> str:
        """One line for logs."""
        return (
            f"HeteroTPTransferConfig(tp_ratio={self.tp_ratio}, K={self.K}, d_tp={self.d_tp}, "
            f"p_tp={self.p_tp}, d_rank={self.d_rank}, "
            f"physical_fa_reads={self.physical_fa_num_reads}, "
            f"mamba_reads={self.mamba_num_reads}, fa_targets={self.fa_read_targets}, "
            f"transfer_targets={self.transfer_targets}, fa_entry_size={self.fa_entry_size}, "
            f"d_block_len={self.d_block_len}, p_block_len={self.p_block_len})"
        )
