"""The layout model: where the bytes of a paged KV cache tensor live.

A `Layout` describes one layer's KV tensor (or a cross-layer tensor holding every layer) with
three facts:

- `shape`: the tensor's logical dims as the engine presents them (vLLM's
  `get_kv_cache_shape`), each a semantic dim or a product of them such as `"kv*head_size"`;
- `stride_order`: vLLM's `get_kv_cache_stride_order`, i.e. memory dim `i` is logical dim
  `stride_order[i]`;
- `memory`: the semantic dims in memory order, outermost first. It is what kvx trusts: the
  memory-ordered logical dims are reshaped into it, so a packed dim may hide a different
  factor order (vLLM-CPU's `[blocks, heads, tokens, 2*head_size]` is K-then-V per slab).

A layout may store K and V in different memory orders (vLLM-CPU keeps K transposed,
`[head_size, tokens]`, and V token-major): `k_memory` then gives the K half's order and
`memory` the V half's; both agree up to and including `kv`. No single strided view holds such
a tensor, so `semantic_view` refuses it and `half_views` gives one view per half.

Semantic dims: `layers`, `blocks`, `kv` (always 2: K then V), `tokens` (the block size),
`heads` (KV heads on this rank) and `head_size` (MLA: the latent width).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LAYERS = "layers"
BLOCKS = "blocks"
KV = "kv"
TOKENS = "tokens"
HEADS = "heads"
HEAD_SIZE = "head_size"
DIMS = (LAYERS, BLOCKS, KV, TOKENS, HEADS, HEAD_SIZE)
"""Every semantic dim a layout may use."""


@dataclass(frozen=True)
class Layout:
    """One KV cache layout (see the module docstring for the three fields that define it).

    `tp_dim` is the dim tensor parallelism shards (`"heads"`, or None when every rank holds the
    whole tensor, as for MLA). `k_memory` is the K half's memory order when it differs from
    `memory` (then V's): `memory` with some of `tokens`, `heads`, `head_size` after `kv`
    reordered; empty when K and V share `memory`. Construction validates the description.
    """

    name: str
    shape: tuple[str, ...]
    memory: tuple[str, ...]
    stride_order: tuple[int, ...] = ()
    tp_dim: str | None = HEADS
    summary: str = ""
    k_memory: tuple[str, ...] = ()
    _factors: tuple[tuple[str, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        factors = tuple(tuple(entry.split("*")) for entry in self.shape)
        object.__setattr__(self, "_factors", factors)
        if not self.stride_order:
            object.__setattr__(self, "stride_order", tuple(range(len(self.shape))))
        where = f"layout {self.name!r}"
        unknown = sorted({d for f in factors for d in f} - set(DIMS))
        if unknown or set(self.memory) - set(DIMS):
            bad = unknown or sorted(set(self.memory) - set(DIMS))
            raise ValueError(f"{where}: unknown dim(s) {bad}; allowed: {list(DIMS)}")
        if len(set(self.memory)) != len(self.memory):
            raise ValueError(f"{where}: memory {self.memory} repeats a dim")
        used = sorted(d for f in factors for d in f)
        if used != sorted(self.memory):
            raise ValueError(
                f"{where}: shape {self.shape} and memory {self.memory} must use the same dims"
            )
        if BLOCKS not in self.memory or TOKENS not in self.memory:
            raise ValueError(f"{where}: memory {self.memory} needs 'blocks' and 'tokens'")
        if sorted(self.stride_order) != list(range(len(self.shape))):
            raise ValueError(
                f"{where}: stride_order {self.stride_order} is not a permutation of "
                f"range({len(self.shape)})"
            )
        for f in factors:
            if len(f) > 1 and (BLOCKS in f or len([d for d in f if d != KV]) > 1):
                raise ValueError(
                    f"{where}: shape entry {'*'.join(f)!r} cannot be sized from a tensor; "
                    "a product may hold 'kv' and one other dim, never 'blocks'"
                )
        if self.tp_dim is not None and self.tp_dim not in self.memory:
            raise ValueError(f"{where}: tp_dim {self.tp_dim!r} is not one of {self.memory}")
        if self.k_memory:
            self._check_k_memory(where)

    def _check_k_memory(self, where: str) -> None:
        if KV not in self.memory:
            raise ValueError(f"{where}: k_memory {self.k_memory} needs a 'kv' dim in memory")
        cut = self.memory.index(KV) + 1
        movable = (TOKENS, HEADS, HEAD_SIZE)
        if (
            sorted(self.k_memory) != sorted(self.memory)
            or self.k_memory[:cut] != self.memory[:cut]
            or any(
                (a in movable) != (b in movable) or (a not in movable and a != b)
                for a, b in zip(self.k_memory, self.memory)
            )
        ):
            raise ValueError(
                f"{where}: k_memory {self.k_memory} must be memory {self.memory} with only "
                f"{list(movable)} after 'kv' reordered"
            )
        if self.k_memory == self.memory:
            raise ValueError(f"{where}: k_memory equals memory; leave k_memory empty")

    # -- facts ---------------------------------------------------------------------------------

    @property
    def dims(self) -> frozenset[str]:
        """The semantic dims this layout holds."""
        return frozenset(self.memory)

    @property
    def is_cross_layer(self) -> bool:
        """True if one tensor holds every layer."""
        return LAYERS in self.memory

    @property
    def blocks_first(self) -> bool:
        """True if blocks are the outermost memory dim (vLLM's "blocks-first")."""
        return self.memory[0] == BLOCKS

    @property
    def blocks_dim(self) -> int:
        """Index of the blocks dim in the tensor's (logical) shape: where to `index_select`
        whole blocks."""
        return self.shape.index(BLOCKS)

    @property
    def kv_split(self) -> bool:
        """True if K and V of a block are separate regions (`kv` outside `blocks` in memory)."""
        return KV in self.memory and self.memory.index(KV) < self.memory.index(BLOCKS)

    @property
    def split_order(self) -> bool:
        """True if K and V are stored in different memory orders (see `k_memory`)."""
        return bool(self.k_memory)

    def half_memory(self, kv: int) -> tuple[str, ...]:
        """The memory order of the K (`kv=0`) or V (`kv=1`) half, without the `kv` dim."""
        if KV not in self.memory or kv not in (0, 1):
            raise ValueError(f"layout {self.name!r} has no K/V half {kv!r} (dims {self.memory})")
        order = self.k_memory if kv == 0 and self.k_memory else self.memory
        return tuple(d for d in order if d != KV)

    # -- sizes ---------------------------------------------------------------------------------

    def logical_shape(
        self,
        num_blocks: int,
        block_size: int,
        num_heads: int = 1,
        head_size: int = 1,
        num_layers: int = 1,
    ) -> tuple[int, ...]:
        """The tensor shape for these sizes (dims the layout lacks are ignored)."""
        sizes = self._sizes(num_blocks, block_size, num_heads, head_size, num_layers)
        return tuple(math.prod(sizes[d] for d in f) for f in self._factors)

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        num_heads: int = 1,
        head_size: int = 1,
        num_layers: int = 1,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """An uninitialised tensor with this layout's logical shape and memory order."""
        import torch

        shape = self.logical_shape(num_blocks, block_size, num_heads, head_size, num_layers)
        physical = torch.empty([shape[i] for i in self.stride_order], dtype=dtype, device=device)
        inverse = sorted(range(len(shape)), key=self.stride_order.__getitem__)
        return physical.permute(inverse)

    def sizes_of(self, tensor: torch.Tensor) -> dict[str, int]:
        """Every semantic dim's size, read from `tensor`'s shape (raises on a mismatch)."""
        if tensor.dim() != len(self.shape):
            raise ValueError(
                f"layout {self.name!r} expects a {len(self.shape)}-d tensor "
                f"{list(self.shape)}, got shape {tuple(tensor.shape)}"
            )
        sizes: dict[str, int] = {KV: 2} if KV in self.memory else {}
        for f, n in zip(self._factors, tensor.shape):
            rest = [d for d in f if d != KV]
            known = math.prod(sizes[d] for d in f if d == KV)
            if not rest:
                ok = n == known
            else:
                ok = n % known == 0 and sizes.setdefault(rest[0], n // known) == n // known
            if not ok:
                raise ValueError(
                    f"layout {self.name!r}: dim {'*'.join(f)!r} has size {n}, which does not "
                    f"fit (kv is always 2); tensor shape {tuple(tensor.shape)}"
                )
        return sizes

    def block_size_of(self, tensor: torch.Tensor) -> int:
        """Tokens per block of `tensor`."""
        return self.sizes_of(tensor)[TOKENS]

    def num_blocks_of(self, tensor: torch.Tensor) -> int:
        """Blocks in `tensor`."""
        return self.sizes_of(tensor)[BLOCKS]

    def semantic_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of `tensor` with one dim per entry of `memory`, in that order.

        Refused for a layout whose K and V orders differ (`split_order`): use `half_views`."""
        if self.k_memory:
            raise ValueError(
                f"layout {self.name!r} stores K as {list(self.half_memory(0))} and V as "
                f"{list(self.half_memory(1))}: no single view holds both; use "
                "Layout.half_views (one view per K/V half)"
            )
        return self._memory_view(tensor)

    def half_views(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of `tensor`'s K and V halves, each with one dim per entry of
        `half_memory(kv)`, in that order (any layout with a `kv` dim)."""
        at = self.memory.index(KV) if KV in self.memory else -1
        if at < 0:
            raise ValueError(f"layout {self.name!r} has no kv dim (dims {self.memory})")
        whole = self._memory_view(tensor)
        sizes = self.sizes_of(tensor)
        k, v = whole.select(at, 0), whole.select(at, 1)
        if self.k_memory:
            try:
                k = k.view([sizes[d] for d in self.half_memory(0)])
            except RuntimeError:
                raise ValueError(
                    f"layout {self.name!r}: the K half of a tensor of shape "
                    f"{tuple(tensor.shape)} and strides {tensor.stride()} is not laid out in "
                    f"memory as {list(self.half_memory(0))}"
                ) from None
        return k, v

    def _memory_view(self, tensor: torch.Tensor) -> torch.Tensor:
        sizes = self.sizes_of(tensor)
        try:
            return tensor.permute(self.stride_order).view([sizes[d] for d in self.memory])
        except RuntimeError:
            raise ValueError(
                f"layout {self.name!r}: tensor of shape {tuple(tensor.shape)} and strides "
                f"{tensor.stride()} is not laid out in memory as {list(self.memory)}"
            ) from None

    def _sizes(
        self, num_blocks: int, block_size: int, num_heads: int, head_size: int, num_layers: int
    ) -> Mapping[str, int]:
        sizes = {
            LAYERS: num_layers,
            BLOCKS: num_blocks,
            KV: 2,
            TOKENS: block_size,
            HEADS: num_heads,
            HEAD_SIZE: head_size,
        }
        for dim, n in sizes.items():
            if n < (0 if dim == BLOCKS else 1):
                raise ValueError(f"layout {self.name!r}: {dim} must be >= 1, got {n}")
        return sizes
