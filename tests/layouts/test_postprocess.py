"""vLLM's receive-side post-processing (block size, layout, both) against a per-element
reference and against vLLM's own style of call, bit for bit, on the native kernel and on the
PyTorch fallback (the shared helpers: _transform_kit.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvx.layouts import (
    kv_postprocess_blksize_and_layout_on_receive,
    kv_postprocess_blksize_on_receive,
    kv_postprocess_layout_on_receive,
)

from ._transform_kit import (
    DTYPES,
    bits,
    get,
    kernel,  # noqa: F401 (autouse fixture: every test runs on both kernels)
    put,
    random_fill,
    staging,
)

# -- vLLM's receive-side post-processing -------------------------------------------------------


def cache_4d(memory: str, b: int, n: int, h: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-layer K or V cache `[B, N, H, D]` with the given memory order and block stride."""
    if memory == "NHD":
        return torch.empty(b, n, h, d, dtype=dtype)
    if memory == "HND":
        return torch.empty(b, h, n, d, dtype=dtype).transpose(1, 2)
    if memory == "NHD, block stride 2x":  # e.g. the V half of a blocks-first tensor
        return torch.empty(b, 2, n, h, d, dtype=dtype)[:, 1]
    assert memory == "HND, block stride 2x"
    return torch.empty(b, 2, h, n, d, dtype=dtype)[:, 1].transpose(1, 2)


def ref_regroup(cache: torch.Tensor, ids: Sequence[int], r: int, hnd_input: bool) -> torch.Tensor:
    """Each block's elements, flattened in [H, N, D] (or [N, H, D]) logical order, are r
    sub-blocks [H, N/r, D]; token j*N/r + t of the result is sub-block j's token t."""
    x = bits(cache).tolist()
    _, big_n, heads, hd = cache.shape
    n = big_n // r
    for b in set(ids):
        block = x[b]
        order = (
            [(t, h, d) for h in range(heads) for t in range(big_n) for d in range(hd)]
            if hnd_input
            else [(t, h, d) for t in range(big_n) for h in range(heads) for d in range(hd)]
        )
        flat = [get(block, i) for i in order]
        for j in range(r):
            for h in range(heads):
                for t in range(n):
                    for d in range(hd):
                        put(block, (j * n + t, h, d), flat[((j * heads + h) * n + t) * hd + d])
    return torch.tensor(x, dtype=bits(cache).dtype).reshape(cache.shape)


def vllm_style(fn: str, cache: torch.Tensor, idx: torch.Tensor, r: int) -> None:
    """The straightforward index_select -> reshape/permute -> index_copy_ of reference 7.3."""
    blocks = cache.index_select(0, idx)
    _, big_n, heads, hd = blocks.shape
    if fn == "layout":
        new = blocks.reshape(-1, heads, big_n, hd).permute(0, 2, 1, 3)
    elif fn == "blksize":
        hnd = blocks.permute(0, 2, 1, 3)
        merged = hnd.reshape(-1, r, heads, big_n // r, hd).permute(0, 2, 1, 3, 4).flatten(2, 3)
        new = merged.permute(0, 2, 1, 3)
    else:
        new = blocks.reshape(-1, r, heads, big_n // r, hd).permute(0, 1, 3, 2, 4).flatten(1, 2)
    cache.index_copy_(0, idx, new)


POSTPROCESS: dict[str, tuple[Callable[..., None], bool]] = {
    "layout": (kv_postprocess_layout_on_receive, False),
    "blksize": (kv_postprocess_blksize_on_receive, True),
    "blksize_and_layout": (kv_postprocess_blksize_and_layout_on_receive, False),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", sorted(POSTPROCESS))
@settings(max_examples=70, deadline=None)
@given(data=st.data())
def test_postprocess_matches_reference_and_vllm(fn: str, data: st.DataObject) -> None:
    transform, hnd_input = POSTPROCESS[fn]
    r = 1 if fn == "layout" else data.draw(st.sampled_from([1, 2, 4, 8]), "ratio")
    n = data.draw(st.integers(1, 3), "remote block size") * r
    heads, hd = data.draw(st.integers(1, 3), "heads"), data.draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = data.draw(st.integers(1, 6), "blocks")
    memory = data.draw(
        st.sampled_from(["NHD", "HND", "NHD, block stride 2x", "HND, block stride 2x"])
    )
    dtype = data.draw(st.sampled_from(DTYPES))
    ids = data.draw(st.permutations(range(num_blocks)))[: data.draw(st.integers(0, num_blocks))]
    if ids and data.draw(st.booleans(), "repeat an id"):
        ids = [*ids, ids[0]]
    cache = random_fill(
        cache_4d(memory, num_blocks, n, heads, hd, dtype), data.draw(st.integers(0, 2**16))
    )
    expected = ref_regroup(cache, ids, r, hnd_input)
    straightforward = bits(cache).clone()
    vllm_style(fn, straightforward, torch.tensor(ids, dtype=torch.long), r)
    assert torch.equal(straightforward, expected)  # the reference reads vLLM like we do
    with staging(data):
        if fn == "layout":
            transform(cache, torch.tensor(ids, dtype=torch.long))
        else:
            transform(cache, ids, r)
    assert torch.equal(bits(cache), expected)


def test_blksize_example_from_the_reference() -> None:
    # Local 16 tokens, remote 4, 4 heads: h0b0|h1b0|h2b0|h3b0|h0b1|... becomes h0(b0..b3)|...
    cache = cache_4d("HND", 3, 16, 4, 1, torch.float32)
    memory = cache.permute(0, 2, 1, 3)  # [B, H, N, D]: the bytes in memory order
    received = torch.tensor(
        [100 * b + 10 * h + t for b in range(4) for h in range(4) for t in range(4)]
    )
    memory[1].copy_(received.view(4, 16, 1).float())
    kv_postprocess_blksize_on_receive(cache, torch.tensor([1]), 4)
    want = [100 * b + 10 * h + t for h in range(4) for b in range(4) for t in range(4)]
    assert memory[1].flatten().long().tolist() == want


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: kv_postprocess_layout_on_receive(c[0], [0]), "cache must be 4-d"),
        (lambda c: kv_postprocess_blksize_on_receive(c, [0], 3), "ratio 3 does not divide"),
        (lambda c: kv_postprocess_blksize_on_receive(c, [0], 0), "must be an int >= 1, got 0"),
        (lambda c: kv_postprocess_blksize_on_receive(c, [4], 2), "block id 4 is out of range"),
        (lambda c: kv_postprocess_layout_on_receive(c, [[0]]), "must be a 1-d list or tensor"),
    ],
)
def test_postprocess_bad_input(call: Callable[[torch.Tensor], None], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(4, 8, 2, 4))
