"""copy_kv_blocks over many layers: one native call per group of layers of one geometry.

Layers of one shape, strides and word alignment share their views and go to the native kernel
together (`gather_scatter_layers`); others, and the PyTorch path, go one layer at a time. Every
element of every layer is compared, the blocks that must not change included.
"""

from __future__ import annotations

import platform
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch

from kvx.layouts import HND, NHD, KVBlockCopier, _kernels, copy_kv_blocks
from kvx.layouts import copy_blocks as copy_module

SRC_IDS, DST_IDS = [5, 0, 3, 3], [1, 6, 2, 7]


def layers() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Source and destination caches: four NHD layers carved from one buffer at offsets (past
    the layers before) of 0, 1, 8 and 12 bf16 elements, i.e. 16-, 2-, 16- and 8-byte words; one
    HND layer and one NHD layer of other heads."""
    gen = torch.Generator().manual_seed(7)
    shape = NHD.allocate(8, 4, 2, 8, dtype=torch.bfloat16).shape
    size = shape.numel()

    def carve(buffer: torch.Tensor, offset: int) -> torch.Tensor:
        return buffer[offset : offset + size].view(shape)

    def fill(t: torch.Tensor) -> torch.Tensor:
        t.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, t.shape, generator=gen))
        return t

    def side() -> dict[str, torch.Tensor]:
        buffer = fill(torch.empty(4 * size + 16, dtype=torch.bfloat16))
        caches = {f"l{i}": carve(buffer, o) for i, o in enumerate([0, size + 1, 2 * size + 8])}
        caches["l3"] = carve(buffer, 3 * size + 12)
        caches["hnd"] = fill(HND.allocate(8, 4, 2, 8, dtype=torch.bfloat16))
        caches["heads"] = fill(NHD.allocate(8, 4, 3, 8, dtype=torch.bfloat16))
        return caches

    return side(), side()


def expected(src: torch.Tensor, dst: torch.Tensor, layout: str) -> torch.Tensor:
    """`dst` after the copy, one block at a time (blocks on dim 1 in NHD and HND)."""
    out = dst.clone()
    for s, d in zip(SRC_IDS, DST_IDS):
        out[:, d] = src[:, s]
    return out.view(torch.int16)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_layers_grouped_by_geometry_copy_every_byte(direction: str, kernel: str) -> None:
    src, dst = layers()
    want = {name: expected(src[name], dst[name], "HND" if name == "hnd" else "NHD") for name in src}
    calls: list[int] = []
    native = _kernels.load_native("1") if kernel == "native" else None
    real = copy_module.gather_scatter_layers

    def counting(*args: object) -> None:
        calls.append(len(args[0].src_addrs))  # type: ignore[attr-defined]
        real(*args)  # type: ignore[arg-type]

    with (
        patch.object(_kernels, "native", native),
        patch.object(copy_module, "gather_scatter_layers", counting),
    ):
        nhd = {k: v for k, v in src.items() if k != "hnd"}
        copy_kv_blocks(nhd, dst, SRC_IDS, DST_IDS, direction)  # type: ignore[arg-type]
        copy_kv_blocks({"hnd": src["hnd"]}, dst, SRC_IDS, DST_IDS, direction, layout="HND")  # type: ignore[arg-type]
    # l0 and l2 share a geometry (16-byte words): one call for both (NHD's K and V are one
    # view); l1, l3 and the other layers go one at a time.
    assert calls == ([2] if kernel == "native" else [])
    for name in src:
        assert torch.equal(dst[name].view(torch.int16), want[name]), name


def test_native_layers_refuse_unequal_address_lists() -> None:
    native = _kernels.load_native("1")
    assert native is not None
    ids = torch.tensor([0], dtype=torch.long)
    t = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="2 source but 1 destination addresses"):
        native.gather_scatter_layers(
            [t.data_ptr(), t.data_ptr()], t.shape, t.stride(), ids.data_ptr(), 1,
            [t.data_ptr()], t.shape, t.stride(), ids.data_ptr(), 1, 1, 4, 1, True,
        )  # fmt: skip
    bad = torch.tensor([2], dtype=torch.long)
    with pytest.raises(IndexError, match="src: block id 2 is out of range for 2 blocks"):
        native.gather_scatter_layers(
            [t.data_ptr()], t.shape, t.stride(), bad.data_ptr(), 1,
            [t.data_ptr()], t.shape, t.stride(), ids.data_ptr(), 1, 1, 4, 1, True,
        )  # fmt: skip
    # ids as lists: converted and checked in the kernel, before any byte moves
    for src_ids, error, message in (
        ([0, 1], ValueError, "src_block_ids has 2 ids, expected 1"),
        ([2], ValueError, r"src_block_ids: block id 2 is out of range; the cache has 2 blocks"),
        ([True], ValueError, "src_block_ids must be a 1-d list or tensor of integer block ids"),
        ({0: 0}, TypeError, "src_block_ids: need an address or a list of ids"),
    ):
        with pytest.raises(error, match=message):
            native.gather_scatter_layers(
                [t.data_ptr()], t.shape, t.stride(), src_ids, 1,
                [t.data_ptr()], t.shape, t.stride(), [1], 1, 1, 4, 1, True,
            )  # fmt: skip
    assert torch.equal(t, torch.zeros(2, 4, dtype=torch.int32))


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_copier_built_once_copies_each_call_s_blocks(kernel: str) -> None:
    """A `KVBlockCopier` keeps its views and addresses across calls: each call moves its own ids
    with the caches' current bytes; refused calls change nothing."""
    src, dst = layers()
    src.pop("hnd"), dst.pop("hnd")
    native = _kernels.load_native("1") if kernel == "native" else None
    with patch.object(_kernels, "native", native):
        copier = KVBlockCopier(src, dst, "d2h")
        for src_ids, dst_ids in ((SRC_IDS, DST_IDS), ([7, 2], [0, 5]), ([], [])):
            for t in src.values():  # new bytes in place: a copier reads what is there now
                t.view(torch.int16).add_(1)
            want = {name: dst[name].clone() for name in src}
            for name in src:
                for s, d in zip(src_ids, dst_ids):
                    want[name][:, d] = src[name][:, s]
            copier(src_ids, dst_ids)
            for name in src:
                assert torch.equal(dst[name].view(torch.int16), want[name].view(torch.int16))
        before = {name: dst[name].clone() for name in dst}
        with pytest.raises(ValueError, match="src_block_ids has 2 ids but dst_block_ids has 1"):
            copier([0, 1], [2])
        with pytest.raises(ValueError, match="dst_block_ids: block id 8 is out of range"):
            copier([0, 1], [2, 8])
        for name in dst:
            assert torch.equal(dst[name].view(torch.int16), before[name].view(torch.int16))


def test_copier_moves_list_ids_without_building_tensors() -> None:
    """Native groups take list ids as they are (an `array` of int64s, range-checked in
    Python): no torch tensor per call, which is most of a small call's cost when the
    engine's forward has evicted torch's code. Bad lists still get block_index's errors."""
    src, dst = layers()
    for caches in (src, dst):
        for name in ("l1", "l3", "hnd", "heads"):  # one native group: l0 and l2
            caches.pop(name)
    want = {name: expected(src[name], dst[name], "NHD") for name in src}
    copier = KVBlockCopier(src, dst, "d2h")

    def no_tensors(*args: object, **kwargs: object) -> None:
        raise AssertionError("the copier built a tensor from list ids")

    with patch.object(torch, "as_tensor", no_tensors):
        copier(SRC_IDS, DST_IDS)
        with pytest.raises(ValueError, match="src_block_ids: block id -1 is out of range"):
            copier([-1, 0], [0, 1])
        with pytest.raises(ValueError, match="dst_block_ids: block id 8 is out of range"):
            copier([0, 1], (2, 8))
    for name in src:
        assert torch.equal(dst[name].view(torch.int16), want[name]), name
    with pytest.raises(ValueError, match="src_block_ids must be a 1-d list or tensor of integer"):
        copier([0.0], [1])
    copier(torch.tensor([1]), torch.tensor([0]))  # tensors still work, and arrays
    copier(np.array([7]), [np.int64(3)])  # a list of numpy ints goes to the kernel as it is
    for name in src:
        words = src[name].view(torch.int16)  # `want` holds int16 words
        want[name][:, 0], want[name][:, 3] = words[:, 1], words[:, 7]
        assert torch.equal(dst[name].view(torch.int16), want[name]), name


def can_stream() -> bool:
    """Whether the native kernel has non-temporal stores here (x86-64 with AVX2)."""
    cpuinfo = Path("/proc/cpuinfo")
    return (
        platform.machine() in ("x86_64", "AMD64")
        and cpuinfo.exists()
        and " avx2" in cpuinfo.read_text()
    )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("over", ["none", "group", "both"])
def test_large_copies_stream_every_byte(over: str, threads: int) -> None:
    """A native call writing at least NATIVE_STREAM_BYTES (all its layers together) writes
    with non-temporal stores: runs of 4110 bytes (a page and an odd tail) at addresses 2 bytes
    past 16-byte alignment (the unaligned head) move exactly as memcpy would, for a group of two
    layers (one call) and a lone layer (its own call), on one thread or split across two."""
    native = _kernels.load_native("1")
    gen = torch.Generator().manual_seed(11)
    shape = NHD.allocate(6, 3, 5, 137, dtype=torch.bfloat16).shape  # K or V: 4110 bytes
    size = shape.numel()

    def side() -> dict[str, torch.Tensor]:
        buffer = torch.empty(3 * size + 16, dtype=torch.bfloat16)
        buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, buffer.shape, generator=gen))
        # l0, l1: 2 bytes past alignment (one group); lone: aligned (its own call)
        offsets = {"l0": 1, "l1": size + 5, "lone": 2 * size + 16}
        return {n: buffer[o : o + size].view(shape) for n, o in offsets.items()}

    src, dst = side(), side()
    src_ids, dst_ids = [5, 0, 3], [1, 2, 4]
    want = {name: dst[name].clone() for name in dst}
    for name in src:
        for s, d in zip(src_ids, dst_ids):
            want[name][:, d] = src[name][:, s]
    keep = {name: t.clone() for name, t in src.items()}
    one_layer = len(src_ids) * 2 * 4110  # bytes the lone layer's call writes
    threshold = {"none": 2 * one_layer + 1, "group": one_layer + 1, "both": one_layer}[over]
    torch_threads = torch.get_num_threads()
    with (
        patch.object(_kernels, "native", native),
        patch.object(_kernels, "NATIVE_STREAM_BYTES", threshold),
        patch.object(_kernels, "NATIVE_BYTES_PER_THREAD", 1),  # any call may split
    ):
        torch.set_num_threads(threads)
        try:
            copier = KVBlockCopier(src, dst, "d2h")
            before = native.streamed_calls()
            copier(src_ids, dst_ids)
            streamed = native.streamed_calls() - before
        finally:
            torch.set_num_threads(torch_threads)
    assert streamed == ({"none": 0, "group": 1, "both": 2}[over] if can_stream() else 0)
    for name in src:
        assert torch.equal(dst[name].view(torch.int16), want[name].view(torch.int16)), name
        assert torch.equal(src[name].view(torch.int16), keep[name].view(torch.int16)), name
