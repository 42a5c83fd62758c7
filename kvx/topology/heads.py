"""Which KV heads a tensor-parallel rank physically stores.

With `K` KV heads and TP size `tp`: if `tp <= K` each rank stores `K // tp` consecutive heads;
otherwise every rank stores one head and `tp // K` consecutive ranks share it (replication).
MLA caches hold one latent "head" that every rank stores whole. Matches vLLM's
`_physical_head_range` and `get_num_kv_heads`.
"""

from __future__ import annotations

from kvx.topology.errors import TopologyError, divisors


def check_tp_heads(num_kv_heads: int, tp_size: int, *, where: str = "") -> None:
    """Raise `TopologyError` unless `num_kv_heads` KV heads can be spread over `tp_size` ranks
    (`tp_size` divides the heads, or is a multiple of them)."""
    at = f"{where}: " if where else ""
    for name, value in (("num_kv_heads", num_kv_heads), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TopologyError(f"{at}{name} must be an int >= 1, got {value!r}")
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        raise TopologyError(
            f"{at}tp_size={tp_size} does not divide num_kv_heads={num_kv_heads}; use a TP size "
            f"that divides the heads ({divisors(num_kv_heads)}) or a multiple of "
            f"{num_kv_heads} (each rank then holds one replicated head)"
        )
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise TopologyError(
            f"{at}tp_size={tp_size} exceeds num_kv_heads={num_kv_heads} but is not a multiple "
            f"of it, so heads cannot be replicated evenly; use a multiple of {num_kv_heads} or "
            f"a divisor of it ({divisors(num_kv_heads)})"
        )


def num_physical_heads(num_kv_heads: int, tp_size: int, *, is_mla: bool = False) -> int:
    """KV heads stored per rank: `max(1, K // tp)`, 1 for MLA (matches vLLM's
    `get_num_kv_heads`)."""
    if is_mla:
        return 1
    check_tp_heads(num_kv_heads, tp_size)
    return max(1, num_kv_heads // tp_size)


def physical_head_range(
    num_kv_heads: int, tp_size: int, tp_rank: int, *, is_mla: bool = False
) -> range:
    """Global KV-head ids stored by `tp_rank` (MLA: `range(1)`, the latent head).

    Matches vLLM's `_physical_head_range`: `[r*K/tp, (r+1)*K/tp)` when `tp <= K`, else the one
    head `r*K // tp` (consecutive ranks share it)."""
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise TopologyError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
    if is_mla:
        return range(1)
    check_tp_heads(num_kv_heads, tp_size)
    if tp_size <= num_kv_heads:
        per = num_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank * num_kv_heads // tp_size
    return range(head, head + 1)


def head_holders(num_kv_heads: int, tp_size: int, head: int, *, is_mla: bool = False) -> range:
    """The TP ranks that store global KV head `head` (every rank for MLA)."""
    if is_mla:
        return range(tp_size)
    check_tp_heads(num_kv_heads, tp_size)
    if not 0 <= head < num_kv_heads:
        raise TopologyError(f"head must be in [0, {num_kv_heads}), got {head!r}")
    if tp_size <= num_kv_heads:
        rank = head // (num_kv_heads // tp_size)
        return range(rank, rank + 1)
    replicas = tp_size // num_kv_heads
    return range(head * replicas, (head + 1) * replicas)


def is_kv_replicated(num_kv_heads: int, tp_size: int, *, is_mla: bool = False) -> bool:
    """True if several ranks store the same heads: `tp > K` (equality is not replication),
    or MLA with `tp > 1`. Matches vLLM's `replicates_kv_cache`."""
    return tp_size > 1 if is_mla else tp_size > num_kv_heads


def is_primary_holder(
    num_kv_heads: int, tp_size: int, tp_rank: int, *, is_mla: bool = False
) -> bool:
    """True for the first of the ranks sharing this rank's heads (always True without
    replication): the one that reports or stores them so replicas count once."""
    head = physical_head_range(num_kv_heads, tp_size, tp_rank, is_mla=is_mla).start
    return head_holders(num_kv_heads, tp_size, head, is_mla=is_mla).start == tp_rank
