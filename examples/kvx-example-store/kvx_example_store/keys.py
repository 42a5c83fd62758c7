"""Stored keys: a chained hash of each full block's tokens, prefixed by what makes the bytes
of a block differ between engines (model, dtype, geometry, parallelism)."""

from __future__ import annotations

import hashlib

import kvx


def engine_prefix(ctx: kvx.EngineContext) -> str:
    """Engines with the same prefix store the same bytes for the same tokens."""
    c, p = ctx.cache, ctx.parallel
    fields = (ctx.model_name, c.dtype, c.layout, c.block_size, c.num_kv_heads, c.head_size)
    more = (c.layer_names, c.use_mla, p.tp_size, p.pp_size)
    return hashlib.sha256(repr(fields + more).encode()).hexdigest()[:16]


def block_keys(
    prefix: str, token_ids: list[int], mm_hashes: list[str], block_size: int
) -> list[str]:
    """The key of every full block of `token_ids`: block `i`'s hash covers every token up
    to its end (and the request's multimodal inputs: equal placeholder tokens of different
    images must not share keys), so equal keys mean equal prefixes."""
    keys = []
    digest = hashlib.sha256("\0".join([prefix, *mm_hashes]).encode())
    for end in range(block_size, len(token_ids) + 1, block_size):
        for token in token_ids[end - block_size : end]:
            digest.update(token.to_bytes(8, "little", signed=True))
        keys.append(f"{prefix}:{digest.copy().hexdigest()}")
    return keys
