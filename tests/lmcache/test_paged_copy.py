"""The CPU GPU-connector maps paged blocks in every per-layer K/V layout to LMCache's chunk
formats and back, element for element; skipped slots and untouched blocks keep their bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvx.engine.kv_cache import token_view
from kvx.layouts import get_layout
from kvx.plugins.lmcache.paged_copy import LayerwisePagedCPUConnector, PagedCPUConnector
from kvx.plugins.lmcache.worker import slot_mapping

LAYOUTS = ["NHD", "HND", "FLASHINFER_NHD", "FLASHINFER_HND", "CPU_PACKED"]
BLOCKS, BLOCK, HEADS, HEAD, LAYERS = 12, 8, 2, 4, 3


def _caches(name: str, fill: float | None = None) -> list[torch.Tensor]:
    layout = get_layout(name)
    out = []
    for _ in range(LAYERS):
        t = layout.allocate(BLOCKS, BLOCK, HEADS, HEAD, dtype=torch.float32)
        if fill is None:
            t.copy_(torch.randn(t.shape))
        else:
            t.fill_(fill)
        out.append(t)
    return out


def _tokens(name: str, caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """[layers, tokens, 2, heads, head] of the given slots, read through kvx's own token view."""
    layout = get_layout(name)
    rows = []
    for t in caches:
        view = token_view(layout, t)
        rows.append(torch.stack([view[int(s) // BLOCK, int(s) % BLOCK] for s in slots]))
    return torch.stack(rows)


@pytest.mark.parametrize("name", LAYOUTS)
def test_chunk_round_trip(name: str) -> None:
    layout = get_layout(name)
    src = _caches(name)
    block_ids = [5, 2, 9, 0]  # 32 tokens, non-contiguous blocks
    slots = slot_mapping(block_ids, BLOCK, 30)  # two chunks: 16 + 14 tokens
    conn = PagedCPUConnector(layout, LAYERS, HEADS, HEAD)
    objs = [SimpleNamespace(tensor=torch.empty(conn.get_shape(n))) for n in (16, 14)]
    kwargs = {"kvcaches": src, "slot_mapping": slots}
    conn.batched_from_gpu(objs, [0, 16], [16, 30], **kwargs)
    expected = _tokens(name, src, slots)  # [L, T, 2, H, D]
    got = torch.cat([o.tensor.view(2, LAYERS, -1, HEADS, HEAD) for o in objs], dim=2)
    assert torch.equal(got.permute(1, 2, 0, 3, 4), expected)

    dst = _caches(name, fill=-7.0)
    load_slots = slots.clone()
    load_slots[:3] = -1  # computed already: must stay untouched
    conn.batched_to_gpu(objs, [0, 16], [16, 30], kvcaches=dst, slot_mapping=load_slots)
    written = load_slots[load_slots >= 0]
    assert torch.equal(_tokens(name, dst, written), _tokens(name, src, written))
    for t in dst:  # everything else keeps the sentinel: count what changed
        changed = int((t != -7.0).sum())
        assert changed == len(written) * 2 * HEADS * HEAD


@pytest.mark.parametrize("name", ["NHD", "CPU_PACKED"])
def test_layerwise_generators(name: str) -> None:
    layout = get_layout(name)
    src = _caches(name)
    slots = slot_mapping([3, 7], BLOCK, 16)
    conn = LayerwisePagedCPUConnector(layout, LAYERS, HEADS, HEAD)
    objs = [[SimpleNamespace(tensor=torch.empty(conn.get_shape(16)))] for _ in range(LAYERS)]
    steps = conn.batched_from_gpu(objs, [0], [16], kvcaches=src, slot_mapping=slots)
    next(steps)
    for layer in range(LAYERS):
        next(steps)  # copies exactly this layer
        got = objs[layer][0].tensor.view(16, 2, HEADS, HEAD)
        assert torch.equal(got, _tokens(name, src, slots)[layer])
    dst = _caches(name, fill=0.0)
    sink = conn.batched_to_gpu([0], [16], kvcaches=dst, slot_mapping=slots)
    next(sink)
    for layer in range(LAYERS):
        sink.send(objs[layer])
        assert torch.equal(_tokens(name, dst, slots)[layer], _tokens(name, src, slots)[layer])
        if layer + 1 < LAYERS:
            assert not dst[layer + 1].any()  # the next layer is not written yet
    next(sink)


def test_refuses_cross_layer_and_mla() -> None:
    for name in ("MLA", "CROSS_NHD"):
        with pytest.raises(ValueError, match="per-layer K/V"):
            PagedCPUConnector(get_layout(name), LAYERS, HEADS, HEAD)


def test_slot_mapping_marks_tokens_past_the_blocks() -> None:
    assert slot_mapping([4, 1], 4, 6).tolist() == [16, 17, 18, 19, 4, 5]
    assert slot_mapping([2], 4, 6).tolist() == [8, 9, 10, 11, -1, -1]
    assert slot_mapping([], 4, 2).tolist() == [-1, -1]


def test_layerwise_load_skips_slots_marked_minus_one() -> None:
    layout = get_layout("HND")  # tokens not adjacent to blocks: the indexed-assignment path
    src = _caches("HND")
    slots = slot_mapping([3, 7], BLOCK, 16)
    conn = LayerwisePagedCPUConnector(layout, LAYERS, HEADS, HEAD)
    objs = [[SimpleNamespace(tensor=torch.empty(conn.get_shape(16)))] for _ in range(LAYERS)]
    steps = conn.batched_from_gpu(objs, [0], [16], kvcaches=src, slot_mapping=slots)
    for _ in steps:
        pass
    dst = _caches("HND", fill=-7.0)
    load_slots = slots.clone()
    load_slots[:5] = -1  # computed already: must stay untouched
    sink = conn.batched_to_gpu([0], [16], kvcaches=dst, slot_mapping=load_slots)
    next(sink)
    for layer in range(LAYERS):
        sink.send(objs[layer])
    next(sink)
    written = load_slots[5:]
    assert torch.equal(_tokens("HND", dst, written), _tokens("HND", src, written))
    for t in dst:
        assert int((t != -7.0).sum()) == len(written) * 2 * HEADS * HEAD
