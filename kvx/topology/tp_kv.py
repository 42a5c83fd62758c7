"""`TpKVTopology`: a local TP rank's view of its own and remote engines' TP and block sizes.

Method names and results match vLLM's legacy `TpKVTopology` (NIXL connector utils), with the
engine's attention backend replaced by a kvx layout object. vLLM's assertions are
`TopologyError`s saying what would work. For the de-duplicated, any-direction transfer plan
kvx adds on top, see `kvx.topology.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvx.hooks.specs import KVLayout
from kvx.topology.errors import TopologyError
from kvx.topology.heads import is_kv_replicated as _replicated
from kvx.topology.heads import physical_head_range
from kvx.topology.plan import KVGeometry


def _ratio_error(what: str, local: int, remote: int) -> TopologyError:
    return TopologyError(
        f"local {what} {local} and remote {what} {remote} must divide one another for vLLM's "
        f"{what} ratio; kvx.topology.plan_reads handles any pair whose heads split"
    )


@dataclass
class TpKVTopology:
    """TP and KV-cache topology of one local rank against the remote engines it has met.

    `remote_tp_size` / `remote_block_size` map engine id to TP size / block size and include
    the local engine (`engine_id`), as in vLLM.
    """

    tp_rank: int
    remote_tp_size: dict[str, int]
    is_mla: bool
    total_num_kv_heads: int
    engine_id: str
    remote_block_size: dict[str, int]
    layout: KVLayout
    """The local KV cache's layout object (stands in for vLLM's attention backend)."""
    is_mamba: bool = False

    def __post_init__(self) -> None:
        for name in ("remote_tp_size", "remote_block_size"):
            if self.engine_id not in getattr(self, name):
                raise TopologyError(
                    f"TpKVTopology.{name} must include the local engine {self.engine_id!r} "
                    "(vLLM keeps the local sizes in the same map)"
                )
        if not 0 <= self.tp_rank < self.tp_size:
            raise TopologyError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if not isinstance(self.layout, KVLayout):
            raise TopologyError(
                f"TpKVTopology.layout must be a layout object (e.g. a kvx.layouts.Layout), "
                f"got {self.layout!r}"
            )

    # -- the local engine ----------------------------------------------------------------------

    @property
    def tp_size(self) -> int:
        return self.remote_tp_size[self.engine_id]

    @property
    def block_size(self) -> int:
        return self.remote_block_size[self.engine_id]

    @property
    def is_kv_layout_blocks_first(self) -> bool:
        """True if a layer's cache starts with the blocks dim (FlashInfer, vLLM-CPU; always for
        hybrid Mamba models), matching vLLM's probe of the backend's KV cache shape."""
        if self.is_mamba:
            return True
        shape = [d for d in self.layout.shape if d != "layers"]
        return not self.is_mla and shape[0] == "blocks"

    @property
    def cross_layers_blocks(self) -> bool:
        """True if one tensor holds every layer."""
        return "layers" in self.layout.memory

    @property
    def split_k_and_v(self) -> bool:
        """Whether K and V are registered as separate memory regions (FlashAttention-like)."""
        return not (self.cross_layers_blocks or self.is_mla or self.is_kv_layout_blocks_first)

    def physical_head_range(
        self, engine_id: str | None = None, tp_rank: int | None = None
    ) -> range:
        """Global KV heads stored by `tp_rank` (default: this rank) of `engine_id` (default:
        the local engine); MLA: `range(1)`."""
        engine = self.engine_id if engine_id is None else engine_id
        rank = self.tp_rank if tp_rank is None else tp_rank
        return physical_head_range(
            self.total_num_kv_heads, self.remote_tp_size[engine], rank, is_mla=self.is_mla
        )

    def geometry(self, engine_id: str, layout: str | None = None) -> KVGeometry:
        """`engine_id`'s KV geometry for `kvx.topology.plan_reads` (layout default: ours)."""
        return KVGeometry(
            tp_size=self.remote_tp_size[engine_id],
            num_kv_heads=self.total_num_kv_heads,
            block_size=self.remote_block_size[engine_id],
            layout=self.layout.name if layout is None else layout,
            is_mla=self.is_mla,
        )

    # -- ratios (vLLM's sign convention) -------------------------------------------------------

    def tp_ratio(self, remote_tp_size: int) -> int:
        """Local ranks per remote rank (`local // remote`, >= 1) when local TP >= remote TP,
        else `-(remote // local)`: each local rank reads `|ratio|` remote ranks."""
        local = self.tp_size
        if local >= remote_tp_size:
            if local % remote_tp_size:
                raise _ratio_error("TP size", local, remote_tp_size)
            return local // remote_tp_size
        if remote_tp_size % local:
            raise _ratio_error("TP size", local, remote_tp_size)
        return -(remote_tp_size // local)

    def block_size_ratio(self, remote_block_size: int) -> int:
        """`local block size // remote block size`; like vLLM the local block must be a multiple
        of the remote one (`TransferPlan.block_pairs` handles both directions)."""
        if self.block_size % remote_block_size:
            raise TopologyError(
                f"local block size {self.block_size} is not a multiple of remote block size "
                f"{remote_block_size} (vLLM reads only remote blocks <= local ones); use "
                "TransferPlan.block_pairs for larger remote blocks"
            )
        return self.block_size // remote_block_size

    def tp_ratio_from_engine_id(self, remote_engine_id: str) -> int:
        return self.tp_ratio(self.remote_tp_size[remote_engine_id])

    def block_size_ratio_from_engine_id(self, remote_engine_id: str) -> int:
        return self.block_size_ratio(self.remote_block_size[remote_engine_id])

    # -- replication ---------------------------------------------------------------------------

    def is_kv_replicated(self, engine_id: str) -> bool:
        """True if `engine_id`'s TP size exceeds the KV heads (equal is not replication)."""
        return _replicated(self.total_num_kv_heads, self.remote_tp_size[engine_id])

    def replicates_kv_cache(self, remote_engine_id: str) -> bool:
        """MLA caches are always replicated; others when `is_kv_replicated`."""
        return self.is_mla or self.is_kv_replicated(remote_engine_id)

    # -- which remote ranks ----------------------------------------------------------------------

    def get_target_remote_ranks(self, remote_tp_size: int) -> list[int]:
        """Remote ranks this rank reads: `[tp_rank // ratio]` when ratio > 0, else the
        `|ratio|` consecutive ranks from `tp_rank * |ratio|` (vLLM's legacy choice, without the
        de-duplication `plan_reads` does for a replicated remote)."""
        ratio = self.tp_ratio(remote_tp_size)
        if ratio > 0:
            return [self.tp_rank // ratio]
        return [self.tp_rank * -ratio + i for i in range(-ratio)]

    def get_target_remote_ranks_from_engine_id(self, remote_engine_id: str) -> list[int]:
        return self.get_target_remote_ranks(self.remote_tp_size[remote_engine_id])

    def local_consumers(self, remote_tp_size: int) -> int:
        """Notifications each read remote rank waits for: `max(1, tp_ratio)` (vLLM)."""
        return max(1, self.tp_ratio(remote_tp_size))

    def head_offset(self, remote_tp_size: int) -> int:
        """Where this rank's heads start in the remote rank's block when local TP > remote TP
        (0 otherwise), in units of one local rank's share (its physical heads); times
        `remote_block_len // tp_ratio` gives vLLM's byte offset (`compute_head_offset`)."""
        ratio = self.tp_ratio(remote_tp_size)
        if self.is_mla or ratio <= 1:
            return 0
        k, local = self.total_num_kv_heads, self.tp_size
        if local > k:
            remote_rank = self.tp_rank * remote_tp_size // local
            return self.tp_rank * k // local - remote_rank * k // remote_tp_size
        return self.tp_rank % ratio
