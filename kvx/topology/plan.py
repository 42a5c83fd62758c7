"""Transfer plans: what one local (reader, D) rank reads from which remote (P) ranks.

A plan works in global KV-head ids and tokens, so it is independent of the byte layout: a
`HeadRead` says which heads of which remote TP rank land where in the local rank's head dim,
and `TransferPlan.block_pairs` says which remote block's tokens land in which local block.

Head selection matches vLLM's NIXL connector where vLLM supports the pair (D rank `r` reads
remote rank `r // tp_ratio` when D TP >= P TP; the `|tp_ratio|` consecutive ranks
`r*|ratio| ...` when D TP < P TP; MLA reads whole blocks from `r * P_TP // D_TP`) and goes beyond
it: any TP pair whose head counts split, P TP > D TP with replicated P KV (each head is read
once, from one of the ranks holding it) and block sizes differing in either direction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvx.hooks.specs import KVLayout
from kvx.topology.errors import TopologyError
from kvx.topology.heads import check_tp_heads, head_holders, physical_head_range


@dataclass(frozen=True)
class KVGeometry:
    """One engine's KV shape, as both sides exchange it in the handshake."""

    tp_size: int
    num_kv_heads: int
    """The model's total KV heads (before TP sharding); ignored for MLA."""
    block_size: int
    layout: str = "HND"
    """A registered `kvx.layouts` name (MLA geometries need a layout without a heads dim)."""
    is_mla: bool = False
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "num_kv_heads", "block_size", "pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"KVGeometry.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.layout, str) or not self.layout:
            raise TopologyError(
                f"KVGeometry.layout must be a registered layout name, got {self.layout!r}"
            )
        if not self.is_mla:
            check_tp_heads(self.num_kv_heads, self.tp_size, where="KVGeometry")

    def heads_of(self, tp_rank: int) -> range:
        """Global KV-head ids stored by `tp_rank` (MLA: `range(1)`)."""
        return physical_head_range(self.num_kv_heads, self.tp_size, tp_rank, is_mla=self.is_mla)

    def holders_of(self, head: int) -> range:
        """TP ranks storing global KV head `head`."""
        return head_holders(self.num_kv_heads, self.tp_size, head, is_mla=self.is_mla)


@dataclass(frozen=True)
class HeadRead:
    """Heads one local rank reads from one remote TP rank."""

    remote_tp_rank: int
    remote_heads: range
    """Global KV-head ids read from that remote rank (a subset of its physical heads)."""
    local_heads: range
    """Global KV-head ids they become on the local rank (same length)."""
    remote_head_offset: int
    """Index of `remote_heads.start` within the remote rank's own head dim."""
    local_head_offset: int
    """Index of `local_heads.start` within the local rank's own head dim."""

    @property
    def num_heads(self) -> int:
        return len(self.local_heads)


@dataclass(frozen=True)
class BlockSpan:
    """A run of tokens copied from one remote block into one local block."""

    remote_block_id: int
    remote_token_start: int
    """Offset of the run's first token inside the remote block."""
    local_block_id: int
    local_token_start: int
    """Offset of the run's first token inside the local block."""
    num_tokens: int
    remote_index: int
    """Position of `remote_block_id` in the remote block list."""
    local_index: int
    """Position of `local_block_id` in the local block list."""


@dataclass(frozen=True)
class TransferPlan:
    """Everything one local TP rank reads from the remote engine (for one PP stage pair)."""

    local: KVGeometry
    remote: KVGeometry
    local_tp_rank: int
    reads: tuple[HeadRead, ...]
    """Together they cover every physical head of the local rank exactly once, in local
    head order."""

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """Remote TP ranks this local rank reads from, in read order, each once."""
        return tuple(dict.fromkeys(r.remote_tp_rank for r in self.reads))

    @property
    def local_heads(self) -> range:
        """The local rank's physical heads (global ids)."""
        return self.local.heads_of(self.local_tp_rank)

    @property
    def block_size_ratio(self) -> int:
        """`local.block_size // remote.block_size` when local blocks are larger, else the
        negated inverse (`-k`: one remote block fills `k` local blocks); 1 when equal."""
        lb, rb = self.local.block_size, self.remote.block_size
        return lb // rb if lb >= rb else -(rb // lb)

    def block_pairs(
        self,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        num_tokens: int,
    ) -> list[BlockSpan]:
        """Which remote block's token range lands in which local block's token range.

        The remote blocks hold a `num_tokens`-long sequence, written in order into the local
        blocks; each list must have exactly the blocks that sequence needs (the last may be
        partial). Block sizes may differ in either direction as long as one divides the other.
        Spans come in token order; each lies inside one local and one remote block.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise TopologyError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        lb, rb = self.local.block_size, self.remote.block_size
        for name, ids, size in (
            ("local_block_ids", local_block_ids, lb),
            ("remote_block_ids", remote_block_ids, rb),
        ):
            need = -(-num_tokens // size)
            if len(ids) != need:
                raise TopologyError(
                    f"{name} has {len(ids)} blocks but {num_tokens} tokens need {need} "
                    f"blocks of {size} tokens; pass exactly those blocks (trim a prefix-cache "
                    "hit on the caller's side)"
                )
        spans = []
        pos = 0
        while pos < num_tokens:
            li, lo = divmod(pos, lb)
            ri, ro = divmod(pos, rb)
            n = min(lb - lo, rb - ro, num_tokens - pos)
            spans.append(
                BlockSpan(
                    remote_block_id=int(remote_block_ids[ri]),
                    remote_token_start=ro,
                    local_block_id=int(local_block_ids[li]),
                    local_token_start=lo,
                    num_tokens=n,
                    remote_index=ri,
                    local_index=li,
                )
            )
            pos += n
        return spans


def check_compatible(
    local: KVGeometry,
    remote: KVGeometry,
    layouts: tuple[KVLayout, KVLayout] | None = None,
) -> None:
    """Raise `TopologyError` unless a local engine can read the remote engine's KV cache.

    `layouts`, the (local, remote) layout objects the geometries name (found by the caller in
    its registry), are checked against `is_mla` too; without them only the shapes are."""
    if local.is_mla != remote.is_mla:
        raise TopologyError(
            f"is_mla differs (local {local.is_mla}, remote {remote.is_mla}): an MLA latent "
            "cache and a per-head cache are different models; both sides must run the same model"
        )
    if not local.is_mla and local.num_kv_heads != remote.num_kv_heads:
        raise TopologyError(
            f"num_kv_heads differs (local {local.num_kv_heads}, remote {remote.num_kv_heads}); "
            "it is the model's total KV heads before TP sharding, so both sides must report "
            "the same model value"
        )
    lb, rb = local.block_size, remote.block_size
    if max(lb, rb) % min(lb, rb):
        raise TopologyError(
            f"block sizes must divide one another: local block_size={lb}, remote "
            f"block_size={rb}; pick sizes such as {min(lb, rb)} and {2 * min(lb, rb)}"
        )
    if layouts is not None:
        for side, geo, layout in (("local", local, layouts[0]), ("remote", remote, layouts[1])):
            check_layout(geo, layout, side)


def check_layout(geo: KVGeometry, layout: KVLayout, side: str = "local") -> None:
    """Raise `TopologyError` unless `layout` (the object `geo.layout` names) fits `geo.is_mla`:
    a heads dim for per-head caches, none for MLA."""
    name, is_mla = geo.layout, geo.is_mla
    heads = getattr(layout, "tp_dim", None)  # the dim TP shards (None: MLA)
    if is_mla and heads is not None:
        raise TopologyError(
            f"{side} layout {name!r} has a heads dim but is_mla=True; MLA caches need a "
            "layout without heads, such as 'MLA' or 'CROSS_MLA'"
        )
    if not is_mla and heads is None:
        raise TopologyError(
            f"{side} layout {name!r} has no heads dim (an MLA layout) but is_mla=False; "
            "use an attention layout such as 'HND' or set is_mla=True"
        )


def plan_reads(local: KVGeometry, remote: KVGeometry, local_tp_rank: int) -> TransferPlan:
    """The reads local TP rank `local_tp_rank` makes to fill its physical heads.

    Each local head is read once, from one remote rank holding it. When several remote ranks
    hold it (remote replication, or MLA), the `n` local ranks sharing that head are spread
    over its `m` remote holders: the `i`-th takes holder `i*m // n`. This is vLLM's choice
    (`r * P_TP // D_TP` for D TP >= P TP and for MLA; the first rank per distinct head of
    `r*|ratio| ...` for D TP < P TP) extended to every TP pair whose heads split.
    """
    check_compatible(local, remote)
    mine = local.heads_of(local_tp_rank)
    chosen: list[tuple[int, int]] = []  # (head, remote rank)
    for head in mine:
        sharers = local.holders_of(head)
        holders = remote.holders_of(head)
        index = (local_tp_rank - sharers.start) * len(holders) // len(sharers)
        chosen.append((head, holders[index]))
    reads: list[HeadRead] = []
    start = 0
    for i in range(1, len(chosen) + 1):
        if i < len(chosen) and chosen[i][1] == chosen[start][1]:
            continue
        first, rank = chosen[start]
        heads = range(first, chosen[i - 1][0] + 1)
        reads.append(
            HeadRead(
                remote_tp_rank=rank,
                remote_heads=heads,
                local_heads=heads,
                remote_head_offset=first - remote.heads_of(rank).start,
                local_head_offset=first - mine.start,
            )
        )
        start = i
    return TransferPlan(local=local, remote=remote, local_tp_rank=local_tp_rank, reads=tuple(reads))


def readers_per_remote_rank(producer: KVGeometry, consumer: KVGeometry) -> dict[int, int]:
    """For each producer TP rank, how many consumer ranks read from it.

    This is the number of "done" notifications a producer rank waits for before freeing a
    request's blocks (vLLM's `local_consumers`, `max(1, tp_ratio)`, where vLLM supports the
    pair). A count of 0 means no consumer rank reads that producer rank (its heads are
    replicated and read from another rank): that rank must NOT wait for any notification
    and may free the request's blocks as soon as the consumer side has been told where to
    read (or when the request finishes sending on the ranks that are read).
    """
    counts = dict.fromkeys(range(producer.tp_size), 0)
    for rank in range(consumer.tp_size):
        for p in plan_reads(consumer, producer, rank).remote_ranks:
            counts[p] += 1
    return counts
