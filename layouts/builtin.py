"""The built-in layouts (vLLM's attention backends and vLLM-CPU) and lookup by name.

Shapes and stride orders match vLLM's `get_kv_cache_shape` / `get_kv_cache_stride_order` for the
FlashAttention, FlashInfer and MLA backends, and the tensor vLLM-CPU hands a connector (with
the K/V orders its "vec" attention kernels write: matches vLLM-CPU's `cpu_attn_reshape_and_cache`).
"""

from __future__ import annotations

import kvx
from kvx.layouts.descriptor import Layout

_FA = ("kv", "blocks", "tokens", "heads", "head_size")
_FI = ("blocks", "kv", "tokens", "heads", "head_size")

NHD = Layout(
    "NHD",
    shape=_FA,
    memory=_FA,
    summary="vLLM FlashAttention [2, blocks, block_size, heads, head_size], tokens before heads",
)
HND = Layout(
    "HND",
    shape=_FA,
    stride_order=(0, 1, 3, 2, 4),
    memory=("kv", "blocks", "heads", "tokens", "head_size"),
    summary="vLLM FlashAttention [2, blocks, block_size, heads, head_size], heads before tokens",
)
FLASHINFER_NHD = Layout(
    "FLASHINFER_NHD",
    shape=_FI,
    memory=_FI,
    summary="FlashInfer blocks-first [blocks, 2, block_size, heads, head_size]",
)
FLASHINFER_HND = Layout(
    "FLASHINFER_HND",
    shape=_FI,
    stride_order=(0, 1, 3, 2, 4),
    memory=("blocks", "kv", "heads", "tokens", "head_size"),
    summary="FlashInfer blocks-first, heads before tokens in memory",
)
MLA = Layout(
    "MLA",
    shape=("blocks", "tokens", "head_size"),
    memory=("blocks", "tokens", "head_size"),
    tp_dim=None,
    summary="MLA latent cache [blocks, block_size, head_size], replicated across TP",
)
CPU_PACKED = Layout(
    "CPU_PACKED",
    shape=("blocks", "heads", "tokens", "kv*head_size"),
    memory=("blocks", "heads", "kv", "tokens", "head_size"),
    k_memory=("blocks", "heads", "kv", "head_size", "tokens"),
    summary="vLLM-CPU [blocks, heads, block_size, 2*head_size]; each (block, head) slab is "
    "K transposed [head_size, block_size], then V [block_size, head_size]",
)

_X_FA = ("layers", *_FA)
_X_FI = ("layers", *_FI)
CROSS_NHD = Layout(
    "CROSS_NHD",
    shape=_X_FA,
    stride_order=(2, 0, 1, 3, 4, 5),
    memory=("blocks", "layers", "kv", "tokens", "heads", "head_size"),
    summary="cross-layer FlashAttention NHD [layers, 2, blocks, ...], blocks outermost",
)
CROSS_HND = Layout(
    "CROSS_HND",
    shape=_X_FA,
    stride_order=(2, 0, 1, 4, 3, 5),
    memory=("blocks", "layers", "kv", "heads", "tokens", "head_size"),
    summary="cross-layer FlashAttention HND [layers, 2, blocks, ...], blocks outermost",
)
CROSS_FLASHINFER_NHD = Layout(
    "CROSS_FLASHINFER_NHD",
    shape=_X_FI,
    stride_order=(1, 0, 2, 3, 4, 5),
    memory=("blocks", "layers", "kv", "tokens", "heads", "head_size"),
    summary="cross-layer FlashInfer NHD [layers, blocks, 2, ...], blocks outermost",
)
CROSS_FLASHINFER_HND = Layout(
    "CROSS_FLASHINFER_HND",
    shape=_X_FI,
    stride_order=(1, 0, 2, 4, 3, 5),
    memory=("blocks", "layers", "kv", "heads", "tokens", "head_size"),
    summary="cross-layer FlashInfer HND [layers, blocks, 2, ...], blocks outermost",
)
CROSS_MLA = Layout(
    "CROSS_MLA",
    shape=("layers", "blocks", "tokens", "head_size"),
    stride_order=(1, 0, 2, 3),
    memory=("blocks", "layers", "tokens", "head_size"),
    tp_dim=None,
    summary="cross-layer MLA [layers, blocks, block_size, head_size], blocks outermost",
)

BUILTIN_LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        NHD,
        HND,
        FLASHINFER_NHD,
        FLASHINFER_HND,
        MLA,
        CPU_PACKED,
        CROSS_NHD,
        CROSS_HND,
        CROSS_FLASHINFER_NHD,
        CROSS_FLASHINFER_HND,
        CROSS_MLA,
    )
}
"""Built-in layouts by name."""


def get_layout(layout: str | Layout, registry: kvx.PluginRegistry | None = None) -> Layout:
    """The layout named `layout` (a `Layout` is returned as is).

    Built-ins resolve from `BUILTIN_LAYOUTS` (the objects kvx.layouts registers); other names
    through `Registry.get_layout` of `registry` (a connector passes its `ctx.registry`;
    default: the process-wide one), kvx's one layout lookup.
    """
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a name or a Layout, got {type(layout).__name__}")
    if layout in BUILTIN_LAYOUTS:
        return BUILTIN_LAYOUTS[layout]
    try:
        found = kvx.get_layout(layout, registry)
    except kvx.RegistryError as exc:  # "'X' is not a registered layout (did you mean...)..."
        why = str(exc).partition(" is not a registered layout")[2] or f": {exc}"
        raise ValueError(f"unknown layout {layout!r}{why}") from None
    if not isinstance(found, Layout):
        raise TypeError(
            f"layout {layout!r} resolves to {type(found).__name__}, not a kvx.layouts.Layout"
        )
    return found
