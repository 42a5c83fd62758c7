"""A worker's paged KV cache: one tensor per layer, in the engine's layout, with token access.

The tensors handed to a connector (`tensors`) have the layout's shape and memory order; the
layout is any one registered through the `kvx_layouts` hook (`kvx list`). The engine itself
reads and writes through a *token view* of each tensor, a strided view shaped
`[blocks, block_size, kv_parts, heads, head_size]` over the same memory, so the model code is
the same for every layout. A layout storing K and V in different memory orders (vLLM-CPU's
transposed K) has no such single view; its token view is a `KVHalvesView` over one strided view
per half, which reads by copying and writes through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvx.contract.types import KVCacheSpec, ParallelInfo, PluginRegistry
from kvx.errors import RegistryError
from kvx.topology import is_primary_holder
from kvx.topology import physical_head_range as rank_heads

TOKEN_DIMS = ("blocks", "tokens", "kv", "heads", "head_size")


def token_view(layout: Any, tensor: torch.Tensor) -> torch.Tensor | KVHalvesView:
    """`[blocks, block_size, kv_parts, heads, head_size]` view of a tensor in a registered
    layout (MLA: one part, one head), sharing its memory."""
    if getattr(layout, "split_order", False):
        halves = layout.half_views(tensor)
        return KVHalvesView(
            tuple(_ordered(h, layout.half_memory(kv), _HALF_DIMS) for kv, h in enumerate(halves))
        )
    view = layout.semantic_view(tensor)
    memory = list(layout.memory)
    for dim in ("kv", "heads"):
        if dim not in memory:  # MLA: a single latent vector per token
            view = view.unsqueeze(-1)
            memory.append(dim)
    return _ordered(view, memory, TOKEN_DIMS)


_HALF_DIMS = ("blocks", "tokens", "heads", "head_size")


def _ordered(view: torch.Tensor, memory: Sequence[str], dims: Sequence[str]) -> torch.Tensor:
    return view.permute([list(memory).index(d) for d in dims])


class KVHalvesView:
    """The token view of a layout whose K and V orders differ: indexed like the
    `[blocks, block_size, 2, heads, head_size]` view it stands for (integers and slices after
    the first two dims). Reading returns a copy; assigning writes into both halves."""

    def __init__(self, halves: tuple[torch.Tensor, ...]):
        self.halves = halves  # each [blocks, block_size, heads, head_size]
        blocks, tokens, heads, size = halves[0].shape
        self.shape = torch.Size((blocks, tokens, len(halves), heads, size))
        self.dtype = halves[0].dtype

    def __getitem__(self, key: Any) -> torch.Tensor:
        outer, kv, inner = _split_key(key)
        stacked = torch.stack([h[outer] for h in self.halves], dim=-3)
        return stacked[(..., kv, *inner)]

    def __setitem__(self, key: Any, value: Any) -> None:
        outer, kv, inner = _split_key(key)
        target = self[key].shape
        value = torch.as_tensor(value, dtype=self.dtype).expand(target)
        picks = range(len(self.halves))[kv]
        if isinstance(picks, int):
            self.halves[picks][(*outer, *inner)] = value
            return
        axis = len(target) - 1 - sum(not isinstance(k, int) for k in inner)
        for j, part in enumerate(picks):
            self.halves[part][(*outer, *inner)] = value.select(axis, j)


def _split_key(key: Any) -> tuple[tuple[Any, ...], Any, tuple[Any, ...]]:
    """`key` as (blocks and tokens, kv, heads and head_size) indices."""
    key = key if isinstance(key, tuple) else (key,)
    key = key + (slice(None),) * (5 - len(key))
    if len(key) > 5 or not all(isinstance(k, int | slice) for k in key[2:]):
        raise IndexError(
            f"a K/V halves token view takes at most 5 indices, integers or slices after the "
            f"first two; got {key!r}"
        )
    return key[:2], key[2], key[3:]


class PagedKVCache:
    """Per-layer KV tensors of one worker (its TP head shard, its PP layers)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        parallel: ParallelInfo,
        layer_names: Sequence[str],
        layouts: PluginRegistry,
    ):
        """`layouts`: the registry the spec's layout name is looked up in."""
        if spec.layout == "MLA" and not spec.use_mla:
            raise ValueError(
                "KVCacheSpec.layout: 'MLA' holds one latent vector per token; set "
                "use_mla=True for an MLA model, or pick an attention layout"
            )
        try:
            layout: Any = layouts.get_layout("MLA" if spec.use_mla else spec.layout)
        except RegistryError as exc:
            raise ValueError(f"KVCacheSpec.layout: {exc}") from None
        if layout.is_cross_layer:
            raise ValueError(
                f"KVCacheSpec.layout: {spec.layout!r} holds every layer in one "
                "tensor; the reference engine keeps one tensor per layer"
            )
        if spec.num_blocks < 1:
            raise ValueError(f"KVCacheSpec.num_blocks must be >= 1, got {spec.num_blocks}")
        self.layout = layout.name
        self.block_size = spec.block_size
        self.dtype = spec.torch_dtype
        heads = (spec.num_kv_heads, parallel.tp_size, parallel.tp_rank)
        self.heads = rank_heads(*heads, is_mla=spec.use_mla)
        # The first rank holding each head reports it; replicas stay silent so sums count once.
        self.primary = is_primary_holder(*heads, is_mla=spec.use_mla)
        n, h, d = spec.block_size, len(self.heads), spec.head_size
        self.tensors: dict[str, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor | KVHalvesView] = {}
        for name in layer_names:
            tensor = layout.allocate(spec.num_blocks, n, h, d, dtype=self.dtype).zero_()
            self.tensors[name] = tensor
            self._views[name] = token_view(layout, tensor)

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, ...]:
        """(block index, offset) of every token position in [start, end)."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, layer: str, block_ids: Sequence[int], start: int, kv: torch.Tensor) -> None:
        """Store `kv` (`[n, kv_parts, heads, head_size]`) for positions start..start+n-1."""
        blocks, offsets = self.slots(block_ids, start, start + kv.shape[0])
        self._views[layer][blocks, offsets] = kv

    def read(self, layer: str, block_ids: Sequence[int], end: int, start: int = 0) -> torch.Tensor:
        """KV of positions start..end-1 as `[end - start, kv_parts, heads, head_size]`."""
        blocks, offsets = self.slots(block_ids, start, end)
        return self._views[layer][blocks, offsets]

    def token_view(self, layer: str) -> torch.Tensor | KVHalvesView:
        """`[blocks, block_size, kv_parts, heads, head_size]` view of a layer's tensor (see
        `KVHalvesView` for a layout storing K and V in different orders)."""
        return self._views[layer]
