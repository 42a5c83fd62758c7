"""A slice's bytes without staging copies: P's segments are views of its blocks whose
concatenation is exactly the gathered copy, and D's direct placement writes every element the
convert path writes and leaves every other element alone."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvx.layouts import convert_blocks, get_layout
from kvx.plugins.p2p import tensors
from kvx.plugins.p2p.messages import TensorMeta
from kvx.plugins.p2p.tensors import (
    MAX_SEGMENTS,
    block_segments,
    from_wire,
    gather,
    physical,
    scatter,
)

LAYOUTS = ["NHD", "HND", "FLASHINFER_NHD", "CPU_PACKED", "MLA"]
BLOCK, HEADS, HEAD_SIZE, BLOCKS = 4, 2, 8, 12


def _cache(name: str, seed: int) -> torch.Tensor:
    t = get_layout(name).allocate(BLOCKS, BLOCK, HEADS, HEAD_SIZE, dtype=torch.float16)
    return t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))


def _meta(name: str, blocks: int, tokens: int, nbytes: int) -> TensorMeta:
    heads = 1 if name == "MLA" else HEADS
    return TensorMeta(
        "r", "l0", 0, 0, heads, HEAD_SIZE, BLOCK, blocks, tokens, name, "float16", nbytes
    )


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", LAYOUTS)
def test_segments_view_the_blocks_and_equal_the_gathered_bytes(name: str) -> None:
    layout, cache = get_layout(name), _cache(name, 1)
    ids = [7, 8, 9, 2, 3, 11]  # three runs
    heads = None if name == "MLA" else range(HEADS)
    segments = block_segments(cache, layout, ids, heads)
    assert segments is not None
    expected = physical(gather(cache, layout, ids, heads, HEAD_SIZE), layout)
    assert torch.equal(torch.cat(segments), expected)
    outer = 1 if layout.blocks_first else 2
    assert len(segments) == 3 * outer
    assert all(_storage(s) == _storage(cache) for s in segments)  # views: nothing copied
    with pytest.raises(ValueError, match="out of range"):
        block_segments(cache, layout, [BLOCKS], heads)


def test_a_head_subset_or_too_many_runs_is_not_sent_as_views() -> None:
    layout, cache = get_layout("NHD"), _cache("NHD", 2)
    assert block_segments(cache, layout, [0, 1], range(1, 2)) is None
    big = layout.allocate(MAX_SEGMENTS + 2, 1, 1, 1, dtype=torch.float16)
    assert block_segments(big, layout, list(range(0, MAX_SEGMENTS + 2, 2)), None) is None


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("start_token, num_tokens", [(0, 22), (8, 14), (4, 16), (0, 3)])
def test_direct_placement_matches_the_convert_path_on_every_element(
    name: str, start_token: int, num_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, src = get_layout(name), _cache(name, 3)
    sent_ids = [5, 6, 0, 1, 2, 9]  # P's blocks holding tokens 0..22 (24 slots)
    heads = None if name == "MLA" else range(HEADS)
    segments = block_segments(src, layout, sent_ids, heads)
    assert segments is not None and len(segments) > 1
    meta = _meta(name, len(sent_ids), 22, sum(s.numel() for s in segments))
    dst_ids = [11, 3, 4, 8, 1, 10][: -(-num_tokens // BLOCK)]
    direct, reference = _cache(name, 4), _cache(name, 4)
    with monkeypatch.context() as patch:  # the segments land as they are: never joined first
        patch.setattr(tensors, "assemble", _no_staging)
        scatter(segments, meta, direct, layout, dst_ids, start_token, num_tokens, heads)
    received = from_wire(torch.cat(segments), meta)
    first = start_token // BLOCK
    convert_blocks(
        received,
        reference,
        list(range(first, -(-(start_token + num_tokens) // BLOCK))),
        dst_ids,
        src_layout=layout,
        dst_layout=layout,
        num_tokens=num_tokens,
    )
    assert torch.equal(direct, reference)  # every element: written ones and untouched ones
    assert not torch.equal(direct, _cache(name, 4))  # and something was written


def _no_staging(*args: object) -> None:
    raise AssertionError("the slice was assembled into a staging copy")


def test_segments_that_split_a_block_fall_back_to_the_convert_path() -> None:
    layout, src = get_layout("NHD"), _cache("NHD", 5)
    whole = physical(gather(src, layout, [1, 2], range(HEADS), HEAD_SIZE), layout)
    odd = [whole[:100], whole[100:]]  # not on block boundaries
    meta = _meta("NHD", 2, 8, whole.numel())
    dst, reference = _cache("NHD", 6), _cache("NHD", 6)
    scatter(odd, meta, dst, layout, [4, 7], 0, 8, None)
    convert_blocks(src, reference, [1, 2], [4, 7], src_layout=layout, dst_layout=layout)
    assert torch.equal(dst, reference)


@pytest.mark.parametrize("name", ["NHD", "CPU_PACKED"])
def test_a_slice_starting_after_null_blocks_lands_at_its_blocks(name: str) -> None:
    """P skipped two null blocks (outside its window): the slice's block 0 is the request's
    block 2; D writes tokens 8..18 into its blocks, every other element stays."""
    layout, src, dst = get_layout(name), _cache(name, 5), _cache(name, 6)
    sent = physical(gather(src, layout, [4, 5, 6], range(HEADS), HEAD_SIZE), layout)
    nbytes = sent.numel() * sent.element_size()
    meta = TensorMeta(
        "r", "l0", 0, 0, HEADS, HEAD_SIZE, BLOCK, 3, 18, name, "float16", nbytes, first_block=2
    )
    want = dst.clone()
    convert_blocks(
        src, want, [4, 5, 6], [9, 1, 3], src_layout=layout, dst_layout=layout, num_tokens=10
    )
    scatter([sent], meta, dst, layout, [9, 1, 3], 8, 10, range(HEADS))
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="sent tokens from 8"):
        scatter([sent], meta, dst, layout, [0, 9, 1, 3], 4, 14, range(HEADS))
    with pytest.raises(ValueError, match="end before its first block"):
        msgspec.structs.replace(meta, num_tokens=8)
