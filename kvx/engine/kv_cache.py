"""A worker's paged KV cache: one tensor per layer, in the engine's layout, with token access.

The tensors handed to a connector (`tensors`) have the layout's shape and memory order. The
engine itself reads and writes through a *token view* of each tensor, a strided view shaped
`[blocks, block_size, kv_parts, heads, head_size]` over the same memory, so the model code is
the same for every layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvx.errors import did_you_mean, quoted_list
from kvx.types import KVCacheSpec, ParallelInfo


def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV heads held by `tp_rank`; one shared head per rank when TP exceeds the heads
    (matches vLLM's physical head range)."""
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over TP {tp_size}")
        per = num_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % num_kv_heads:
        raise ValueError(f"TP {tp_size} is not a multiple of {num_kv_heads} KV heads")
    head = tp_rank * num_kv_heads // tp_size
    return range(head, head + 1)


def _alloc(layout: str, b: int, n: int, h: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    if layout == "NHD":
        return torch.zeros(2, b, n, h, d, dtype=dtype)
    if layout == "HND":  # logical [2, B, N, H, D], heads before tokens in memory
        return torch.zeros(2, b, h, n, d, dtype=dtype).transpose(2, 3)
    if layout == "FLASHINFER_NHD":
        return torch.zeros(b, 2, n, h, d, dtype=dtype)
    if layout == "FLASHINFER_HND":
        return torch.zeros(b, 2, h, n, d, dtype=dtype).transpose(2, 3)
    if layout == "CPU_PACKED":
        return torch.zeros(b, h, n, 2 * d, dtype=dtype)
    raise AssertionError(layout)


def _token_view(layout: str, t: torch.Tensor, n: int, h: int, d: int) -> torch.Tensor:
    if layout in ("NHD", "HND"):
        return t.permute(1, 2, 0, 3, 4)
    if layout in ("FLASHINFER_NHD", "FLASHINFER_HND"):
        return t.permute(0, 2, 1, 3, 4)
    if layout == "CPU_PACKED":  # each (block, head) slab: all K tokens, then all V tokens
        return t.view(t.shape[0], h, 2, n, d).permute(0, 3, 2, 1, 4)
    if layout == "MLA":
        return t.view(t.shape[0], n, 1, 1, d)
    raise AssertionError(layout)


ENGINE_LAYOUTS = ("NHD", "HND", "FLASHINFER_NHD", "FLASHINFER_HND", "CPU_PACKED", "MLA")


class PagedKVCache:
    """Per-layer KV tensors of one worker (its TP head shard, its PP layers)."""

    def __init__(self, spec: KVCacheSpec, parallel: ParallelInfo, layer_names: Sequence[str]):
        if spec.layout == "MLA" and not spec.use_mla:
            raise ValueError(
                "KVCacheSpec.layout: 'MLA' holds one latent vector per token; set "
                "use_mla=True for an MLA model, or pick an attention layout"
            )
        layout = "MLA" if spec.use_mla else spec.layout
        if layout not in ENGINE_LAYOUTS:
            raise ValueError(
                f"KVCacheSpec.layout: {spec.layout!r} is not supported by the reference engine"
                f"{did_you_mean(spec.layout, ENGINE_LAYOUTS)}; allowed: "
                f"{quoted_list(ENGINE_LAYOUTS)}"
            )
        if spec.num_blocks < 1:
            raise ValueError(f"KVCacheSpec.num_blocks must be >= 1, got {spec.num_blocks}")
        self.layout = layout
        self.block_size = spec.block_size
        self.dtype = spec.torch_dtype
        self.heads = (
            range(1)
            if spec.use_mla
            else rank_heads(spec.num_kv_heads, parallel.tp_size, parallel.tp_rank)
        )
        # The first rank holding each head reports it; replicas stay silent so sums count once.
        replicas = (
            parallel.tp_size if spec.use_mla else max(1, parallel.tp_size // spec.num_kv_heads)
        )
        self.primary = parallel.tp_rank % replicas == 0
        n, h, d = spec.block_size, len(self.heads), spec.head_size
        self.tensors: dict[str, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] = {}
        for name in layer_names:
            if layout == "MLA":
                tensor = torch.zeros(spec.num_blocks, n, d, dtype=self.dtype)
            else:
                tensor = _alloc(layout, spec.num_blocks, n, h, d, self.dtype)
            self.tensors[name] = tensor
            self._views[name] = _token_view(layout, tensor, n, h, d)

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, ...]:
        """(block index, offset) of every token position in [start, end)."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, layer: str, block_ids: Sequence[int], start: int, kv: torch.Tensor) -> None:
        """Store `kv` (`[n, kv_parts, heads, head_size]`) for positions start..start+n-1."""
        blocks, offsets = self.slots(block_ids, start, start + kv.shape[0])
        self._views[layer][blocks, offsets] = kv

    def read(self, layer: str, block_ids: Sequence[int], end: int) -> torch.Tensor:
        """KV of positions 0..end-1 as `[end, kv_parts, heads, head_size]`."""
        blocks, offsets = self.slots(block_ids, 0, end)
        return self._views[layer][blocks, offsets]

    def token_view(self, layer: str) -> torch.Tensor:
        """`[blocks, block_size, kv_parts, heads, head_size]` view of a layer's tensor."""
        return self._views[layer]
