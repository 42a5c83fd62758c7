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
from collections.abc import Callable, Iterator, Sequence
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
    kv_postprocess_blksize_on_receive,
    kv_postprocess_layout_on_receive,
)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
]
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FAMILIES = [
    ("NHD", "HND", "FLASHINFER_NHD", "FLASHINFER_HND", "CPU_PACKED"),
    ("MLA",),
    ("CROSS_NHD", "CROSS_HND", "CROSS_FLASHINFER_NHD", "CROSS_FLASHINFER_HND"),
    ("CROSS_MLA",),
]
CHUNKS = [1, 100, _kernels.CPU_CHUNK_BYTES]  # 1 byte: one gather/scatter step per block
THREAD_BYTES = [1, _kernels.NATIVE_BYTES_PER_THREAD]  # 1 byte: native splits any call in threads


@pytest.fixture(scope="module", autouse=True, params=["native", "torch"])
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the module's tests on the native kernel (it must be built), then on PyTorch."""
    module = _kernels.load_native("1") if request.param == "native" else None
    with patch.object(_kernels, "native", module):
        yield request.param


@contextlib.contextmanager
def staging(data: st.DataObject) -> Iterator[None]:
    """Drawn staging: PyTorch's chunk bytes; the native kernel's bytes per thread and whether
    it may copy directly (else through its scratch)."""
    chunk = data.draw(st.sampled_from(CHUNKS), "chunk bytes")
    per_thread = data.draw(st.sampled_from(THREAD_BYTES), "bytes per thread")
    direct = data.draw(st.booleans(), "native direct copy")
    with (
        patch.object(_kernels, "CPU_CHUNK_BYTES", chunk),
        patch.object(_kernels, "NATIVE_BYTES_PER_THREAD", per_thread),
        patch.object(_kernels, "NATIVE_DIRECT", direct),
    ):
        yield


def pos(name: str, layer: int, b: int, kv: int, t: int, h: int, d: int, n: int, hd: int) -> tuple:
    """Logical index of element (layer, block, kv, token, head, dim) in a tensor of `name`."""
    if name in ("NHD", "HND"):
        return (kv, b, t, h, d)
    if name in ("FLASHINFER_NHD", "FLASHINFER_HND"):
        return (b, kv, t, h, d)
    if name == "MLA":
        return (b, t, d)
    if name == "CPU_PACKED":  # slab of (block, head): K as [hd, n], then V as [n, hd]
        flat = d * n + t if kv == 0 else n * hd + t * hd + d
        return (b, h, flat // (2 * hd), flat % (2 * hd))
    if name in ("CROSS_NHD", "CROSS_HND"):
        return (layer, kv, b, t, h, d)
    if name in ("CROSS_FLASHINFER_NHD", "CROSS_FLASHINFER_HND"):
        return (layer, b, kv, t, h, d)
    assert name == "CROSS_MLA"
    return (layer, b, t, d)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(WORDS[t.element_size()])


def random_fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    w = bits(t)
    info = torch.iinfo(w.dtype)
    gen = torch.Generator().manual_seed(seed)
    w.copy_(torch.randint(info.min, info.max, w.shape, generator=gen, dtype=w.dtype))
    return t


def get(nested: list, index: tuple) -> int:
    for i in index:
        nested = nested[i]
    return nested  # type: ignore[return-value]


def put(nested: list, index: tuple, value: int) -> None:
    for i in index[:-1]:
        nested = nested[i]
    nested[index[-1]] = value


def dims(name: str, layers: int, heads: int) -> tuple[range, range, range]:
    layout = BUILTIN_LAYOUTS[name]
    return (
        range(layers if layout.is_cross_layer else 1),
        range(2 if "kv" in layout.dims else 1),
        range(heads if "heads" in layout.dims else 1),
    )


def ref_convert(
    src: torch.Tensor,
    dst: torch.Tensor,
    names: tuple[str, str],
    ids: tuple[Sequence[int], Sequence[int]],
    block_sizes: tuple[int, int],
    total: int,
    heads: tuple[Sequence[int], Sequence[int]],
    layers: int,
    head_size: int,
) -> torch.Tensor:
    """dst's bits after copying `total` tokens of src's blocks into dst's blocks, elementwise."""
    s, out = bits(src).tolist(), bits(dst).tolist()
    (sn, dn), (sids, dids), (ns, nd) = names, ids, block_sizes
    layer_range, kv_range, _ = dims(sn, layers, 1)
    for tok in range(total):
        sb, st_, db, dt = sids[tok // ns], tok % ns, dids[tok // nd], tok % nd
        for layer in layer_range:
            for kv in kv_range:
                for hs, hdst in zip(*heads):
                    for d in range(head_size):
                        value = get(s, pos(sn, layer, sb, kv, st_, hs, d, ns, head_size))
                        put(out, pos(dn, layer, db, kv, dt, hdst, d, nd, head_size), value)
    return torch.tensor(out, dtype=bits(dst).dtype).reshape(dst.shape)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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


def test_no_python_loop_over_blocks(kernel: str) -> None:
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
