"""The layout model, the built-in layouts (vLLM's shapes and stride orders), lookup, registry."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvx
from kvx.layouts import (
    BUILTIN_LAYOUTS,
    CPU_PACKED,
    HND,
    NHD,
    Layout,
    convert_blocks,
    copy_kv_blocks,
    get_layout,
    kv_postprocess_blksize_and_layout_on_receive,
    kv_postprocess_blksize_on_receive,
    kv_postprocess_layout_on_receive,
)
from kvx.registry.core import get_registry

B, N, H, D, LAYERS = 5, 4, 3, 2, 2

# vLLM's logical shape and stride order of every backend (reference section 7.1), written out.
VLLM = {
    "NHD": ((2, B, N, H, D), (0, 1, 2, 3, 4)),
    "HND": ((2, B, N, H, D), (0, 1, 3, 2, 4)),
    "FLASHINFER_NHD": ((B, 2, N, H, D), (0, 1, 2, 3, 4)),
    "FLASHINFER_HND": ((B, 2, N, H, D), (0, 1, 3, 2, 4)),
    "MLA": ((B, N, D), (0, 1, 2)),
    "CPU_PACKED": ((B, H, N, 2 * D), (0, 1, 2, 3)),
    "CROSS_NHD": ((LAYERS, 2, B, N, H, D), (2, 0, 1, 3, 4, 5)),
    "CROSS_HND": ((LAYERS, 2, B, N, H, D), (2, 0, 1, 4, 3, 5)),
    "CROSS_FLASHINFER_NHD": ((LAYERS, B, 2, N, H, D), (1, 0, 2, 3, 4, 5)),
    "CROSS_FLASHINFER_HND": ((LAYERS, B, 2, N, H, D), (1, 0, 2, 4, 3, 5)),
    "CROSS_MLA": ((LAYERS, B, N, D), (1, 0, 2, 3)),
}


def vllm_alloc(name: str) -> torch.Tensor:
    """Allocate like vLLM: physical order first, then view back with the inverse permutation."""
    shape, order = VLLM[name]
    physical = torch.empty([shape[i] for i in order])
    return physical.permute([order.index(i) for i in range(len(order))])


def test_builtins_are_exactly_the_documented_set() -> None:
    assert set(BUILTIN_LAYOUTS) == set(VLLM)


@pytest.mark.parametrize("name", sorted(VLLM))
def test_builtin_shape_and_strides_match_vllm(name: str) -> None:
    layout = BUILTIN_LAYOUTS[name]
    expected = vllm_alloc(name)
    assert layout.logical_shape(B, N, H, D, LAYERS) == tuple(expected.shape)
    assert layout.stride_order == VLLM[name][1]
    t = layout.allocate(B, N, H, D, LAYERS, dtype=torch.float32)
    assert t.shape == expected.shape and t.stride() == expected.stride()
    sizes = layout.sizes_of(t)
    assert layout.block_size_of(t) == N and layout.num_blocks_of(t) == B
    assert sizes.get("heads", H) == H and sizes["head_size"] == D
    if layout.split_order:
        for half in layout.half_views(t):  # dense inside each half of a slab
            assert list(half.stride()) == sorted(half.stride(), reverse=True)
            assert half.stride()[-1] == 1
    else:
        assert layout.semantic_view(t).is_contiguous()


def test_cpu_packed_slab_is_k_transposed_then_v_token_major() -> None:
    # What vLLM-CPU's "vec" kernels write (tests/vllm checks it against vLLM's cache-write op):
    # each (block, head) slab of 2 * N * D elements is K as [D, N], then V as [N, D].
    t = CPU_PACKED.allocate(B, N, H, D, dtype=torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    k, v = CPU_PACKED.half_views(t)
    assert CPU_PACKED.half_memory(0) == ("blocks", "heads", "head_size", "tokens")
    assert CPU_PACKED.half_memory(1) == ("blocks", "heads", "tokens", "head_size")
    slab = 2 * N * D
    for b, h, tok, d in ((0, 0, 0, 1), (1, 2, 3, 0), (B - 1, H - 1, N - 1, D - 1)):
        base = (b * H + h) * slab
        assert k[b, h, d, tok] == base + d * N + tok
        assert v[b, h, tok, d] == base + N * D + tok * D + d
    assert k.data_ptr() == t.data_ptr()
    with pytest.raises(ValueError, match=r"'CPU_PACKED' stores K as .* use Layout\.half_views"):
        CPU_PACKED.semantic_view(t)


def test_half_views_of_a_layout_with_one_order_select_kv() -> None:
    t = NHD.allocate(B, N, H, D, dtype=torch.float32)
    k, v = NHD.half_views(t)
    assert NHD.half_memory(1) == ("blocks", "tokens", "heads", "head_size") and not NHD.split_order
    assert k.data_ptr() == t[0].data_ptr() and v.data_ptr() == t[1].data_ptr()
    with pytest.raises(ValueError, match="'MLA' has no kv dim"):
        BUILTIN_LAYOUTS["MLA"].half_views(torch.empty(B, N, D))


def test_properties() -> None:
    assert NHD.kv_split and not NHD.blocks_first and not NHD.is_cross_layer
    assert BUILTIN_LAYOUTS["FLASHINFER_HND"].blocks_first
    assert not BUILTIN_LAYOUTS["FLASHINFER_HND"].kv_split
    assert BUILTIN_LAYOUTS["CROSS_HND"].is_cross_layer
    assert BUILTIN_LAYOUTS["CROSS_HND"].blocks_first
    assert NHD.tp_dim == "heads" and BUILTIN_LAYOUTS["MLA"].tp_dim is None
    assert BUILTIN_LAYOUTS["MLA"].dims == frozenset({"blocks", "tokens", "head_size"})


_KV = dict(shape=("kv", "blocks", "tokens", "heads"), memory=("kv", "blocks", "tokens", "heads"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(shape=("blocks", "tokens", "lanes"), memory=("blocks", "tokens")), "unknown dim"),
        (dict(shape=("blocks", "tokens"), memory=("blocks", "tokens", "tokens")), "repeats"),
        (dict(shape=("blocks", "tokens", "heads"), memory=("blocks", "tokens")), "same dims"),
        (dict(shape=("blocks", "head_size"), memory=("blocks", "head_size")), "needs 'blocks'"),
        (
            dict(shape=("blocks", "tokens"), memory=("blocks", "tokens"), stride_order=(0, 0)),
            "not a permutation",
        ),
        (
            dict(shape=("blocks", "tokens*heads"), memory=("blocks", "tokens", "heads")),
            "cannot be sized",
        ),
        (
            dict(shape=("blocks", "tokens"), memory=("blocks", "tokens"), tp_dim="heads"),
            "tp_dim",
        ),
        (
            dict(
                shape=("blocks", "tokens", "head_size"),
                memory=("blocks", "tokens", "head_size"),
                k_memory=("blocks", "head_size", "tokens"),
                tp_dim=None,
            ),
            "needs a 'kv' dim",
        ),
        (dict(**_KV, k_memory=("kv", "heads", "blocks", "tokens")), r"only \['tokens'"),
        (dict(**_KV, k_memory=("blocks", "kv", "tokens", "heads")), r"only \['tokens'"),
        (dict(**_KV, k_memory=("kv", "blocks", "tokens", "heads")), "leave k_memory empty"),
    ],
)
def test_invalid_layouts_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Layout("BAD", **kwargs)


def test_tensor_that_does_not_fit_is_refused_with_its_shape() -> None:
    with pytest.raises(ValueError, match=r"expects a 5-d tensor .* got shape \(4, 4\)"):
        NHD.sizes_of(torch.empty(4, 4))
    with pytest.raises(ValueError, match=r"dim 'kv' has size 3"):
        NHD.sizes_of(torch.empty(3, B, N, H, D))
    with pytest.raises(ValueError, match=r"dim 'kv\*head_size' has size 5"):
        CPU_PACKED.sizes_of(torch.empty(B, H, N, 5))
    with pytest.raises(ValueError, match="not laid out in memory"):
        CPU_PACKED.half_views(torch.empty(B, H, 2 * D, N).transpose(2, 3))
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        NHD.logical_shape(B, 0)


def test_get_layout_by_name_with_did_you_mean() -> None:
    assert get_layout("HND") is HND
    assert get_layout(HND) is HND
    with pytest.raises(
        ValueError, match=r"unknown layout 'CPU_PACK' \(did you mean \"CPU_PACKED\"\?\)"
    ):
        get_layout("CPU_PACK")
    with pytest.raises(TypeError, match="name or a Layout"):
        get_layout(3)  # type: ignore[arg-type]


def test_layouts_and_transforms_are_discoverable_through_the_registry() -> None:
    registry = get_registry()
    assert set(BUILTIN_LAYOUTS) <= set(registry.layouts())
    for name, layout in BUILTIN_LAYOUTS.items():
        assert registry.get_layout(name) is layout
        assert registry.layouts()[name].spec.summary == layout.summary
    transforms = {
        "convert_blocks": convert_blocks,
        "copy_kv_blocks": copy_kv_blocks,
        "kv_postprocess_layout_on_receive": kv_postprocess_layout_on_receive,
        "kv_postprocess_blksize_on_receive": kv_postprocess_blksize_on_receive,
        "kv_postprocess_blksize_and_layout_on_receive": (
            kv_postprocess_blksize_and_layout_on_receive
        ),
    }
    assert set(transforms) <= set(registry.transforms())
    for name, fn in transforms.items():
        assert registry.load_transform(name) is fn


THIRD_PARTY = """
from kvx.layouts import Layout

# tokens innermost: nothing built-in looks like this
TOKENS_LAST = Layout(
    "TOKENS_LAST",
    shape=("blocks", "kv", "heads", "head_size", "tokens"),
    memory=("blocks", "kv", "heads", "head_size", "tokens"),
    summary="test layout with tokens innermost",
)
"""


def test_a_third_party_layout_registers_and_converts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvx_tokens_last_layout.py").write_text(textwrap.dedent(THIRD_PARTY))
    monkeypatch.syspath_prepend(str(tmp_path))

    class Plugin:
        @kvx.hookimpl
        def kvx_layouts(self) -> list[kvx.LayoutSpec]:
            return [kvx.LayoutSpec("TOKENS_LAST", "kvx_tokens_last_layout:TOKENS_LAST")]

    registry = get_registry()
    name = registry.register_plugin(Plugin(), name="test-tokens-last")
    try:
        custom = get_layout("TOKENS_LAST")
        src = NHD.allocate(4, 8, 2, 4, dtype=torch.bfloat16)
        src.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, src.shape))
        mid = custom.allocate(8, 4, 2, 4, dtype=torch.bfloat16)
        back = torch.zeros_like(src)
        convert_blocks(src, mid, [2, 0], [5, 1, 7, 3], dst_layout="TOKENS_LAST")
        assert torch.equal(mid.view(torch.int16)[1, :, :, :, 2], src.view(torch.int16)[:, 2, 6])
        convert_blocks(mid, back, [5, 1, 7, 3], [2, 0], src_layout=custom)
        assert torch.equal(back.view(torch.int16)[:, [2, 0]], src.view(torch.int16)[:, [2, 0]])
    finally:
        registry.unregister_plugin(name)
        sys.modules.pop("kvx_tokens_last_layout", None)
    with pytest.raises(ValueError, match="unknown layout 'TOKENS_LAST'"):
        get_layout("TOKENS_LAST")
