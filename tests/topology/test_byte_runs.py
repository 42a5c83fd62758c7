"""block_byte_runs: the runs hold exactly the selected elements, checked against real tensors
in every built-in per-layer layout."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kvx.engine.kv_cache import token_view
from kvx.layouts import get_layout
from kvx.topology import TopologyError, block_byte_runs

LAYOUTS = ("HND", "NHD", "FLASHINFER_HND", "FLASHINFER_NHD", "CPU_PACKED", "MLA")


def _regions(layout_name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensor's memory regions (dims outside blocks), each `[blocks, bytes per block]`."""
    layout = get_layout(layout_name)
    sizes, outer = layout.sizes_of(tensor), layout.memory.index("blocks")
    regions = math.prod(sizes[d] for d in layout.memory[:outer])
    flat = tensor.permute(layout.stride_order).reshape(regions, sizes["blocks"], -1)
    return list(flat)


@pytest.mark.parametrize("name", LAYOUTS)
def test_runs_hold_exactly_the_selected_elements(name: str) -> None:
    layout = get_layout(name)
    mla = name == "MLA"
    h_total, n, d, blocks = (1 if mla else 4), 8, 4, 3
    t = layout.allocate(blocks, n, h_total, d, dtype=torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    tokens_view = token_view(layout, t)  # [blocks, tokens, kv, heads, head_size]
    head_choices = [None, range(1)] if mla else [None, range(0, 2), range(1, 3), range(3, 4)]
    for heads, tokens in itertools.product(head_choices, [None, range(0, 8), range(2, 5)]):
        runs = block_byte_runs(
            layout, num_heads=h_total, block_size=n, head_size=d, itemsize=4, heads=heads,
            tokens=tokens,
        )  # fmt: skip
        hs = heads or range(h_total)
        ts = tokens or range(n)
        for b in range(blocks):
            want = tokens_view[b, ts.start : ts.stop, :, hs.start : hs.stop]
            got = []
            for region in _regions(name, t):
                raw = region[b].contiguous().view(torch.uint8)
                got += [raw[o : o + length].view(torch.float32) for o, length in runs]
            assert sorted(torch.cat(got).tolist()) == sorted(want.flatten().tolist()), (
                name, heads, tokens,
            )  # fmt: skip
    if name == "HND":
        one = block_byte_runs(layout, num_heads=4, block_size=n, head_size=d, itemsize=2,
                              heads=range(2, 4))  # fmt: skip
        assert one == [(2 * n * d * 2, 2 * n * d * 2)]  # one contiguous run per K/V region


def test_bad_selection() -> None:
    with pytest.raises(TopologyError, match="heads must be a non-empty range"):
        block_byte_runs(
            get_layout("HND"), num_heads=2, block_size=4, head_size=2, itemsize=2, heads=range(1, 3)
        )
    with pytest.raises(TopologyError, match="no heads dim"):
        block_byte_runs(
            get_layout("MLA"), num_heads=1, block_size=4, head_size=2, itemsize=2, heads=range(2)
        )
