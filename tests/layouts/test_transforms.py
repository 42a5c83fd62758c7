"""Every transform against a naive per-element reference written with plain Python loops.

The reference places each element by hand (`pos` below, from vLLM's shapes, not from
`kvx.layouts`), works on the integer bit patterns of the tensors (random bits: NaNs and float8
included), and the results are compared bit for bit over the whole destination, so untouched
blocks and untouched tail tokens are checked too. Every test here runs twice: on the native
kernel (which must be built) and on the PyTorch fallback.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvx.layouts import (
    BUILTIN_LAYOUTS,
    HND,
    NHD,
    _kernels,
    convert_blocks,
    copy_kv_blocks,
    kv_postprocess_blksize_and_layout_on_receive,
)

from ._transform_kit import (
    DTYPES,
    FAMILIES,
    WORDS,
    bits,
    ceil_div,
    kernel,  # noqa: F401 (autouse fixture: every test runs on both kernels)
    random_fill,
    ref_convert,
    staging,
)

# -- convert_blocks ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_convert_blocks_matches_reference(data: st.DataObject) -> None:
    family = data.draw(st.sampled_from(FAMILIES), "family")
    sn = data.draw(st.sampled_from(family), "src layout")
    dn = data.draw(st.sampled_from(family), "dst layout")
    dtype = data.draw(st.sampled_from(DTYPES), "dtype")
    g, r = data.draw(st.sampled_from([1, 2, 3])), data.draw(st.sampled_from([1, 2, 4, 8]))
    ns, nd = (g * r, g) if data.draw(st.booleans(), "src larger") else (g, g * r)
    hd = data.draw(st.sampled_from([1, 2, 4, 8]), "head_size")
    layers = data.draw(st.integers(1, 2), "layers")
    n_heads = data.draw(st.integers(1, 2), "heads moved")
    hs_total, hd_total = (n_heads * data.draw(st.integers(1, 2)) for _ in range(2))
    h0s = data.draw(st.integers(0, hs_total - n_heads))
    h0d = data.draw(st.integers(0, hd_total - n_heads))
    total = data.draw(st.integers(0, 2 * max(ns, nd) + ns), "tokens")
    default_tokens = total % ns == 0 and data.draw(st.booleans())
    ks, kd = ceil_div(total, ns), ceil_div(total, nd)
    bs, bd = ks + data.draw(st.integers(0, 3)), kd + data.draw(st.integers(0, 3))
    src_ids = data.draw(st.lists(st.integers(0, max(bs - 1, 0)), min_size=ks, max_size=ks))
    dst_ids = data.draw(st.permutations(range(bd)))[:kd]
    seed = data.draw(st.integers(0, 2**16))

    ls, ld = BUILTIN_LAYOUTS[sn], BUILTIN_LAYOUTS[dn]
    src = random_fill(ls.allocate(bs, ns, hs_total, hd, layers, dtype=dtype), seed)
    dst = random_fill(ld.allocate(bd, nd, hd_total, hd, layers, dtype=dtype), seed + 1)
    src_before = bits(src).clone()
    has_heads = "heads" in ls.dims
    heads = (range(h0s, h0s + n_heads), range(h0d, h0d + n_heads)) if has_heads else ([0], [0])
    expected = ref_convert(
        src, dst, (sn, dn), (src_ids, dst_ids), (ns, nd), total, heads, layers, hd
    )
    with staging(data):
        convert_blocks(
            src,
            dst,
            src_ids,
            torch.tensor(dst_ids, dtype=torch.int32) if data.draw(st.booleans()) else dst_ids,
            src_layout=sn,
            dst_layout=ld,
            num_tokens=None if default_tokens else total,
            src_heads=heads[0] if has_heads else None,
            dst_heads=heads[1] if has_heads else None,
        )
    assert torch.equal(bits(dst), expected)
    assert torch.equal(bits(src), src_before)


@pytest.mark.timeout(60)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_round_trip_a_b_a_is_exact(data: st.DataObject) -> None:
    family = data.draw(st.sampled_from(FAMILIES), "family")
    a, b = data.draw(st.sampled_from(family)), data.draw(st.sampled_from(family))
    dtype = data.draw(st.sampled_from(DTYPES))
    g, r = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([1, 2, 4, 8]))
    na, nb = (g * r, g) if data.draw(st.booleans()) else (g, g * r)
    hd = data.draw(st.sampled_from([2, 4, 8]))
    heads_a = data.draw(st.integers(1, 2))
    heads_b = heads_a * data.draw(st.integers(1, 2))
    slot = data.draw(st.integers(0, heads_b // heads_a - 1)) * heads_a
    k = data.draw(st.integers(1, 4))
    ids_a = data.draw(st.permutations(range(k + 2)))[:k]
    ids_b = data.draw(st.permutations(range(ceil_div(k * na, nb) + 2)))[: ceil_div(k * na, nb)]
    seed = data.draw(st.integers(0, 2**16))
    la, lb = BUILTIN_LAYOUTS[a], BUILTIN_LAYOUTS[b]
    x = random_fill(la.allocate(k + 2, na, heads_a, hd, 2, dtype=dtype), seed)
    y = random_fill(lb.allocate(len(ids_b) + 2, nb, heads_b, hd, 2, dtype=dtype), seed + 1)
    z = random_fill(la.allocate(k + 2, na, heads_a, hd, 2, dtype=dtype), seed + 2)
    on_b = {"dst_heads": range(slot, slot + heads_a)} if "heads" in la.dims else {}
    back = {"src_heads": range(slot, slot + heads_a)} if "heads" in la.dims else {}
    convert_blocks(x, y, ids_a, ids_b, src_layout=a, dst_layout=b, **on_b)
    convert_blocks(y, z, ids_b, ids_a, src_layout=b, dst_layout=a, num_tokens=k * na, **back)
    all_heads = (range(heads_a), range(heads_a))
    expected = ref_convert(x, z, (a, a), (ids_a, ids_a), (na, na), k * na, all_heads, 2, hd)
    assert torch.equal(bits(z), expected)


def test_remote_block_larger_than_local_splits_blocks() -> None:
    # vLLM rejects P block 32 -> D block 16; kvx splits each remote block into two.
    src = random_fill(HND.allocate(3, 32, 2, 8, dtype=torch.bfloat16), 0)
    dst = torch.zeros_like(NHD.allocate(6, 16, 2, 8, dtype=torch.bfloat16))
    convert_blocks(src, dst, [2, 0], [5, 1, 3, 0], src_layout="HND", num_tokens=60)
    for src_block, half, dst_block, tokens in ((2, 0, 5, 16), (2, 1, 1, 16), (0, 0, 3, 16)):
        got = bits(dst[:, dst_block, :tokens])
        assert torch.equal(got, bits(src[:, src_block, half * 16 : half * 16 + tokens]))
    assert torch.equal(bits(dst[:, 0, :12]), bits(src[:, 0, 16:28]))
    assert not bits(dst[:, 0, 12:]).any() and not bits(dst[:, [2, 4]]).any()


def test_heterogeneous_tp_examples_from_the_reference() -> None:
    # Section 6.5, example 1: P TP=4 (2 heads per rank) -> D TP=2 (4 heads): D0's block takes
    # P0's heads in slot 0 and P1's in slot 1. Example 2 is the reverse: D1 reads heads 2-3.
    p0, p1 = (random_fill(HND.allocate(4, 16, 2, 8, dtype=torch.float16), s) for s in (1, 2))
    d0 = HND.allocate(4, 16, 4, 8, dtype=torch.float16).zero_()
    convert_blocks(p0, d0, [3], [1], src_layout="HND", dst_layout="HND", dst_heads=range(0, 2))
    convert_blocks(p1, d0, [3], [1], src_layout="HND", dst_layout="HND", dst_heads=range(2, 4))
    assert torch.equal(bits(d0[:, 1]), torch.cat([bits(p0[:, 3]), bits(p1[:, 3])], dim=2))
    d1 = NHD.allocate(4, 16, 1, 8, dtype=torch.float16).zero_()
    convert_blocks(d0, d1, [1], [0], src_layout="HND", src_heads=range(2, 3))
    assert torch.equal(bits(d1[:, 0]), bits(p1[:, 3, :, :1]))


def test_same_tensor_with_disjoint_blocks() -> None:
    cache = random_fill(NHD.allocate(6, 8, 2, 4, dtype=torch.bfloat16), 3)
    before = bits(cache).clone()
    convert_blocks(cache, cache, [0, 4], [5, 1])
    assert torch.equal(bits(cache[:, [5, 1]]), before[:, [0, 4]])
    with pytest.raises(ValueError, match="share memory"):
        convert_blocks(cache, cache, [0, 4], [4, 1])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (dict(dst_layout="MLA"), r"cannot convert NHD to MLA: they hold different dims"),
        (dict(dst_dtype=torch.float16), r"src dtype torch.bfloat16 differs from dst dtype"),
        (dict(dst_head_size=8), r"src has head_size=4 but dst has head_size=8"),
        (dict(dst_block_size=12), r"block sizes must divide one another: src block size 8, dst"),
        (dict(src_ids=[0, 9]), r"src_block_ids: block id 9 is out of range; the cache has 6"),
        (dict(src_ids=[-1, 0]), r"src_block_ids: block id -1 is out of range"),
        (dict(src_ids=[0.0, 1.0]), r"src_block_ids must be a 1-d list or tensor of integer"),
        (dict(dst_ids=[1, 1]), r"dst_block_ids repeats a block id"),
        (dict(dst_ids=[1]), r"dst_block_ids has 1 blocks but 16 tokens need 2 blocks of 8"),
        (dict(num_tokens=17), r"src_block_ids has 2 blocks but 17 tokens need 3 blocks of 8"),
        (dict(num_tokens=-1), r"num_tokens must be an int >= 0, got -1"),
        (dict(dst_heads_total=4), r"src selects 2 heads but dst 4; pass src_heads / dst_heads"),
        (dict(src_heads=range(1, 3)), r"src_heads range\(1, 3\) exceeds the 2 heads"),
        (dict(src_heads=range(0, 2, 2)), r"src_heads must be a non-empty range"),
        (dict(src_layout="NDH"), r"unknown layout 'NDH' \(did you mean"),
    ],
)
def test_convert_blocks_bad_input_names_the_argument(call: dict, message: str) -> None:
    call = dict(call)  # popped below; the parameter is shared by both kernels' runs
    src = NHD.allocate(6, 8, 2, 4, dtype=torch.bfloat16)
    dst = BUILTIN_LAYOUTS[call.pop("dst_layout", "HND")].allocate(
        6,
        call.pop("dst_block_size", 8),
        call.pop("dst_heads_total", 2),
        call.pop("dst_head_size", 4),
        dtype=call.pop("dst_dtype", torch.bfloat16),
    )
    kwargs = dict(src_layout="NHD", dst_layout="HND" if dst.dim() == 5 else "MLA") | call
    src_ids, dst_ids = kwargs.pop("src_ids", [0, 1]), kwargs.pop("dst_ids", [2, 3])
    with pytest.raises(ValueError, match=message):
        convert_blocks(src, dst, src_ids, dst_ids, **kwargs)


# -- copy_kv_blocks ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_copy_kv_blocks_matches_reference(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(BUILTIN_LAYOUTS)), "layout")
    layout = BUILTIN_LAYOUTS[name]
    dtype = data.draw(st.sampled_from(DTYPES))
    n, heads, hd = (data.draw(st.sampled_from(v)) for v in ([1, 4, 16], [1, 2], [1, 2, 8]))
    bs, bd = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    k = data.draw(st.integers(0, min(bs, bd) + 2))
    src_ids = data.draw(st.lists(st.integers(0, bs - 1), min_size=k, max_size=k))
    dst_ids = data.draw(st.permutations(range(bd)))[: min(k, bd)]
    src_ids = src_ids[: len(dst_ids)]
    seed = data.draw(st.integers(0, 2**16))
    layers = [f"model.layers.{i}.attn" for i in range(data.draw(st.integers(1, 3)))]
    src = {
        x: random_fill(layout.allocate(bs, n, heads, hd, 2, dtype=dtype), seed + i)
        for i, x in enumerate(layers)
    }
    dst = {
        x: random_fill(layout.allocate(bd, n, heads, hd, 2, dtype=dtype), seed - i - 1)
        for i, x in enumerate(layers)
    }
    expected = {
        x: ref_convert(
            src[x],
            dst[x],
            (name, name),
            (src_ids, dst_ids),
            (n, n),
            n * len(src_ids),
            (range(heads), range(heads)),
            2,
            hd,
        )
        for x in layers
    }
    with staging(data):
        direction = data.draw(st.sampled_from(["h2d", "d2h"]))
        copy_kv_blocks(src, dst, src_ids, dst_ids, direction, layout=name)
    for x in layers:
        assert torch.equal(bits(dst[x]), expected[x])


def test_copy_kv_blocks_no_ops_and_errors() -> None:
    src = {"l0": random_fill(NHD.allocate(4, 8, 2, 4, dtype=torch.bfloat16), 0)}
    dst = {"l0": torch.zeros_like(src["l0"])}
    for args in (({}, dst, [0], [1]), (src, {}, [0], [1]), (src, dst, [], [])):
        copy_kv_blocks(*args, "h2d")  # type: ignore[arg-type]
    assert not bits(dst["l0"]).any()
    with pytest.raises(ValueError, match="src_block_ids has 2 ids but dst_block_ids has 1"):
        copy_kv_blocks(src, dst, [0, 1], [1], "h2d")
    with pytest.raises(ValueError, match="direction must be 'h2d' or 'd2h', got 'up'"):
        copy_kv_blocks(src, dst, [0], [1], "up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer 'l0' of src_kv_caches is missing"):
        copy_kv_blocks(src, {"l1": dst["l0"]}, [0], [1], "d2h")
    meta = {"l0": torch.empty(src["l0"].shape, dtype=torch.bfloat16, device="meta")}
    with pytest.raises(ValueError, match="'h2d': the src caches must be on the host"):
        copy_kv_blocks(meta, dst, [0], [1], "h2d")
    with pytest.raises(ValueError, match="'d2h': the dst caches must be on the host"):
        copy_kv_blocks(src, meta, [0], [1], "d2h")
    with pytest.raises(ValueError, match=r"src dtype torch.bfloat16 != dst dtype torch.float16"):
        copy_kv_blocks(src, {"l0": dst["l0"].half()}, [0], [1], "d2h")
    with pytest.raises(
        ValueError, match=r"src blocks \(2, 8, 2, 4\) and dst blocks \(2, 8, 1, 4\)"
    ):
        copy_kv_blocks(src, {"l0": NHD.allocate(4, 8, 1, 4, dtype=torch.bfloat16)}, [0], [1], "d2h")
    with pytest.raises(ValueError, match="dst_block_ids: block id 4 is out of range"):
        copy_kv_blocks(src, dst, [0], [4], "d2h")
    assert not bits(dst["l0"]).any()


def counted(calls: list[str], name: str, real: Callable[..., object]) -> Callable[..., object]:
    def counting(*args: object, **kwargs: object) -> object:
        calls.append(name)
        return real(*args, **kwargs)

    return counting


def test_no_python_loop_over_blocks(kernel: str) -> None:  # noqa: F811 (the fixture)
    # One native call, or one gather and one scatter, however many blocks move (CPU chunking
    # aside); the native path never falls back to PyTorch's indexing kernels.
    calls: list[str] = []
    src = NHD.allocate(64, 16, 2, 8, dtype=torch.bfloat16).zero_()
    dst = HND.allocate(32, 32, 2, 8, dtype=torch.bfloat16)
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            patch.object(
                _kernels.torch, "index_select", counted(calls, "gather", torch.index_select)
            )
        )
        if _kernels.native is not None:
            real = _kernels.native.gather_scatter
            stack.enter_context(
                patch.object(_kernels.native, "gather_scatter", counted(calls, "native", real))
            )
        convert_blocks(src, dst, list(range(64)), list(range(32)), dst_layout="HND")
    assert calls == (["native"] if kernel == "native" else ["gather"])
    assert math.prod(src.shape) == math.prod(dst.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_nan_payloads_survive_wide_words(dtype: torch.dtype) -> None:
    # Signalling and quiet NaNs with payloads, as 16-byte words: moved, never computed on.
    patterns = {
        torch.float32: [0x7F800001, 0x7FC01234, -0x00400001, 0x7F80_0000 + 0x3FFFFF],
        torch.float64: [0x7FF0000000000001, 0x7FF8000000001234, -0x0008000000000001, 5],
        torch.bfloat16: [0x7F81, 0x7FC1, -0x007F, 0x0001],
    }[dtype]
    word = WORDS[torch.empty(0, dtype=dtype).element_size()]
    cache = NHD.allocate(4, 8, 2, 16, dtype=dtype)
    bits(cache).copy_(
        torch.tensor(patterns, dtype=word).repeat(cache.numel() // 4).view(cache.shape)
    )
    before = bits(cache).clone()
    out = HND.allocate(2, 16, 2, 16, dtype=dtype)
    assert _kernels.word_bytes(NHD.semantic_view(cache)) == 16
    convert_blocks(cache, out, [3, 1], [1], dst_layout="HND")
    assert torch.equal(bits(out[:, 1, :8]), before[:, 3]) and torch.equal(
        bits(out[:, 1, 8:]), before[:, 1]
    )
    kv_postprocess_blksize_and_layout_on_receive(cache[0], [2, 0], 2)
    kv_postprocess_blksize_and_layout_on_receive(cache[0], [2, 0], 1)
    assert set(bits(cache).flatten().tolist()) == set(patterns)
