"""What the transform tests share: the element reference (`pos`, `ref_convert`, from vLLM's
shapes, not from `kvx.layouts`), bit-pattern helpers, drawn staging sizes, and the autouse
`kernel` fixture that runs a test module on the native kernel, then on the PyTorch fallback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from unittest.mock import patch

import pytest
import torch
from hypothesis import strategies as st

from kvx.layouts import (
    BUILTIN_LAYOUTS,
    _kernels,
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
