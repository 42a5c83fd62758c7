"""Machinery shared by the transforms: bit views, block-id checks and the gather/scatter.

Transforms only move bytes, so they run on bit views of the caches: every dtype (float8
included, which has few CPU kernels) is handled alike, and a wide word means fewer elements for
the indexing kernels, which copy element by element (16-byte words are ~25% faster than 8-byte
ones for `index_copy_` on CPU). Words are integers, or complex128 for 16 bytes: the kernels only
load and store them, never compute, so every bit pattern (NaN payloads included) survives.

On CPU the gather/scatter runs in the native kernel `kvx.layouts._native` (one read and one
write per byte, see `_native.c`) when it is built; `KVX_LAYOUTS_NATIVE` chooses: unset = use it
if built, else warn once and use PyTorch; `1` = require it; `0` = always PyTorch.
"""

from __future__ import annotations

import importlib
import math
import os
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import torch

CPU_CHUNK_BYTES = 4 << 20
"""Bytes gathered per step on CPU: the staging copy stays in cache between gather and scatter."""

_WORDS = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
    16: torch.complex128,
}

BlockIdsLike = Sequence[int] | torch.Tensor

NATIVE_ENV = "KVX_LAYOUTS_NATIVE"
NATIVE_MAX_DIMS = 16
"""Dims of one block the native kernel accepts (views with more take the PyTorch path)."""
NATIVE_BYTES_PER_THREAD = 1 << 20
"""Bytes a call must move per thread before the native kernel splits it across threads."""
NATIVE_STREAM_BYTES = 32 << 20
"""A native call (not in place) that writes at least this many bytes writes its runs of a page
or more with non-temporal stores where the CPU has them (x86-64 with AVX2): more than a
last-level cache holds, so its first writes would be evicted before it ends anyway, and the
stores skip reading the destination lines first (8 layers, 64 MiB of 16-token blocks: saves
and loads 0.86-0.88x memcpy's CPU time -> 0.92-0.99x). -1: never."""
NATIVE_DIRECT = True
"""Let the native kernel copy source to destination directly when not in place (tests turn it
off to cover the scratch path, which every other case takes)."""


def load_native(mode: str | None) -> ModuleType | None:
    """The native kernel module for `mode` (the value of `KVX_LAYOUTS_NATIVE`), or None."""
    if mode not in (None, "", "0", "1"):
        raise ValueError(f"{NATIVE_ENV} must be 0, 1 or unset, got {mode!r}")
    if mode == "0":
        return None
    try:
        return importlib.import_module("kvx.layouts._native")
    except ImportError as exc:
        if mode == "1":
            raise ImportError(
                f"{NATIVE_ENV}=1 but the native kernel kvx.layouts._native is not built ({exc}); "
                "reinstall kvx with a C compiler and the Python headers available"
            ) from exc
        warnings.warn(
            f"kvx.layouts: native kernel not built ({exc}); layout transforms use the slower "
            f"PyTorch path (set {NATIVE_ENV}=0 to choose it without this warning)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


native: ModuleType | None = load_native(os.environ.get(NATIVE_ENV))
"""The loaded native kernel, or None when transforms use the PyTorch path."""


def word_bytes(t: torch.Tensor, max_bytes: int = 16) -> int:
    """The widest word (<= `max_bytes`) `t` can be viewed as, widening only its last dim."""
    e = t.element_size()
    if t.dim() == 0 or (t.stride(-1) != 1 and t.shape[-1] != 1):
        return e
    for w in (16, 8, 4, 2):
        if e < w <= max_bytes and all(
            (n * e) % w == 0 for n in (t.shape[-1], t.storage_offset(), *t.stride()[:-1])
        ):
            return w
    return e


def as_words(t: torch.Tensor, w: int) -> torch.Tensor:
    """A bit-identical view of `t` with `w`-byte elements (see `word_bytes`)."""
    same = t.view(_WORDS[t.element_size()])
    return same if w == t.element_size() else same.view(_WORDS[w])


def block_index(ids: BlockIdsLike, num_blocks: int, device: torch.device, arg: str) -> torch.Tensor:
    """`ids` as an int64 tensor on `device`, checked to lie in [0, num_blocks)."""
    if isinstance(ids, torch.Tensor):
        idx = ids
    else:
        idx = torch.as_tensor(ids)
        if idx.numel() == 0:
            idx = idx.to(torch.long)
    if (
        idx.dim() != 1
        or idx.dtype.is_floating_point
        or idx.dtype.is_complex
        or (idx.dtype == torch.bool)
    ):
        raise ValueError(
            f"{arg} must be a 1-d list or tensor of integer block ids, got "
            f"{idx.dtype} with shape {tuple(idx.shape)}"
        )
    if idx.numel():
        lo, hi = (int(v) for v in torch.aminmax(idx))
        if lo < 0 or hi >= num_blocks:
            raise ValueError(
                f"{arg}: block id {lo if lo < 0 else hi} is out of range; the cache has "
                f"{num_blocks} blocks (ids 0..{num_blocks - 1})"
            )
    return idx.to(device=device, dtype=torch.long)


NativeIds = int | list[int] | tuple[int, ...]
"""Block ids as the native `gather_scatter_layers` takes them: a list or tuple of ints (it
converts and checks them), or the address of int64s."""


def native_ids(ids: BlockIdsLike, num_blocks: int, arg: str) -> tuple[NativeIds, object]:
    """`ids` for the native kernel and the object to keep alive until its call returns. A list
    or tuple goes as it is: the kernel converts and checks it without a tensor per call (when
    the engine's forward has evicted torch's code from the caches, building, checking and
    moving a call's two id tensors cost ~0.15 ms, a third of an 8 MiB copy); anything else
    (a tensor, an array) goes as an int64 tensor's address, checked here by `block_index`."""
    if isinstance(ids, list | tuple):
        return ids, ids
    idx = _long_ids(block_index(ids, num_blocks, torch.device("cpu"), arg))
    return idx.data_ptr(), idx


def gather_scatter(
    src: torch.Tensor,
    src_idx: torch.Tensor,
    dst: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    in_place: bool = False,
) -> None:
    """Copy `src[src_idx]` (blocks along dim 0) into `dst[dst_idx]`.

    The gathered blocks are reinterpreted as `dst` blocks in order (so a source block may fill
    several destination blocks or the reverse). Per-block views may be strided: the gather reads
    through `src`'s strides, the scatter writes through `dst`'s. `in_place`: `src` and `dst`
    view the same memory and the ids are one tensor, each block rewritten from itself; a
    repeated id is rewritten once. On CPU the native kernel moves one unit of blocks at a time
    through a cache-resident scratch; the PyTorch path stages cache-sized chunks of whole
    blocks, never one block at a time.
    """
    src_elems, dst_elems = math.prod(src.shape[1:]), math.prod(dst.shape[1:])
    unit = math.lcm(src_elems, dst_elems)
    per_src, per_dst = unit // src_elems, unit // dst_elems
    units = src_idx.numel() // per_src
    assert units * per_src == src_idx.numel() and units * per_dst == dst_idx.numel()
    assert not in_place or (src_idx is dst_idx and per_src == 1)
    if units == 0:
        return
    cpu = src.device.type == "cpu" and dst.device.type == "cpu"
    if native is not None and cpu and max(src.dim(), dst.dim()) <= NATIVE_MAX_DIMS + 1:
        _native_gather_scatter(native, src, src_idx, dst, dst_idx, units, in_place)
        return
    step = units
    if cpu:
        step = max(1, CPU_CHUNK_BYTES // (unit * src.element_size()))
        if in_place:
            # A chunk is gathered after earlier chunks were written: a repeated id would be
            # rewritten twice. vLLM's single gather makes repeats harmless, so drop them.
            src_idx = dst_idx = torch.unique(src_idx)
            units = src_idx.numel()
    buf = torch.empty(
        (min(units, step) * per_src, *src.shape[1:]), dtype=src.dtype, device=src.device
    )
    for start in range(0, units, step):
        stop = min(units, start + step)
        rows = torch.index_select(
            src, 0, src_idx[start * per_src : stop * per_src], out=buf[: (stop - start) * per_src]
        )
        rows = rows.view(-1, *dst.shape[1:]).to(dst.device)
        dst.index_copy_(0, dst_idx[start * per_dst : stop * per_dst], rows)


def _native_gather_scatter(
    kernel: ModuleType,
    src: torch.Tensor,
    src_idx: torch.Tensor,
    dst: torch.Tensor,
    dst_idx: torch.Tensor,
    units: int,
    in_place: bool,
) -> None:
    """`gather_scatter` on CPU in the native kernel (raw addresses: the tensors stay alive here)."""
    esz = src.element_size()
    assert dst.element_size() == esz, "src and dst words differ in size"
    src_idx = _long_ids(src_idx)
    dst_idx = src_idx if in_place else _long_ids(dst_idx)
    kernel.gather_scatter(  # checks every id against the block count before touching memory
        src.data_ptr(),
        src.shape,
        src.stride(),
        src_idx.data_ptr(),
        src_idx.numel() // units,
        dst.data_ptr(),
        dst.shape,
        dst.stride(),
        dst_idx.data_ptr(),
        dst_idx.numel() // units,
        units,
        esz,
        _threads(units, src_idx.numel() * math.prod(src.shape[1:]) * esz),
        in_place,
        NATIVE_DIRECT,
        NATIVE_STREAM_BYTES,
    )


def native_layers(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether `gather_scatter_layers` runs for views shaped like `src` and `dst`."""
    return (
        native is not None
        and src.device.type == "cpu"
        and dst.device.type == "cpu"
        and max(src.dim(), dst.dim()) <= NATIVE_MAX_DIMS + 1
    )


class LayersPlan(NamedTuple):
    """One native `gather_scatter_layers` call's geometry for several tensor pairs of one
    geometry (such as every layer of a cache), worked out once: per call only the ids change."""

    src_addrs: list[int]
    src_shape: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_blocks: int
    per_src: int
    dst_addrs: list[int]
    dst_shape: tuple[int, ...]
    dst_stride: tuple[int, ...]
    dst_blocks: int
    per_dst: int
    word: int
    src_block_bytes: int


def layers_plan(
    src: torch.Tensor, src_addrs: list[int], dst: torch.Tensor, dst_addrs: list[int]
) -> LayersPlan:
    """The plan of `gather_scatter_layers` (check `native_layers` first): `src` and `dst` give
    the shapes, strides and words, `src_addrs[i]` and `dst_addrs[i]` the first element of the
    i-th pair (tensors the caller keeps alive)."""
    assert src.element_size() == dst.element_size()
    src_elems, dst_elems = math.prod(src.shape[1:]), math.prod(dst.shape[1:])
    unit = math.lcm(src_elems, dst_elems)
    return LayersPlan(
        list(src_addrs),
        tuple(src.shape),
        src.stride(),
        src.shape[0],
        unit // src_elems,
        list(dst_addrs),
        tuple(dst.shape),
        dst.stride(),
        dst.shape[0],
        unit // dst_elems,
        src.element_size(),
        src_elems * src.element_size(),
    )


def gather_scatter_layers(
    plan: LayersPlan, src_ids: NativeIds, n_src_ids: int, dst_ids: NativeIds, n_dst_ids: int
) -> None:
    """`gather_scatter` for every pair of `plan` in one native call, with `n_src_ids` and
    `n_dst_ids` block ids (`native_ids`; the kernel checks every one)."""
    assert native is not None
    units = n_src_ids // plan.per_src
    assert units * plan.per_src == n_src_ids and units * plan.per_dst == n_dst_ids
    if units == 0:
        return
    native.gather_scatter_layers(  # checks every id against the block count once
        plan.src_addrs,
        plan.src_shape,
        plan.src_stride,
        src_ids,
        plan.per_src,
        plan.dst_addrs,
        plan.dst_shape,
        plan.dst_stride,
        dst_ids,
        plan.per_dst,
        units,
        plan.word,
        _threads(units, n_src_ids * plan.src_block_bytes),
        NATIVE_DIRECT,
        NATIVE_STREAM_BYTES,
    )


class InPlacePlan(NamedTuple):
    """The geometry of an in-place native `gather_scatter(src, ids, dst, ids)` where `src` and
    `dst` are views of one tensor starting at its first element: reusable for every tensor of
    the same shape, strides, offset and dtype (the per-call view building is most of a small
    call's cost)."""

    src_shape: tuple[int, ...]
    src_stride: tuple[int, ...]
    dst_shape: tuple[int, ...]
    dst_stride: tuple[int, ...]
    word: int
    block_bytes: int


def in_place_plan(src: torch.Tensor, dst: torch.Tensor) -> InPlacePlan:
    """The plan of `gather_scatter(src, ids, dst, ids, in_place=True)`."""
    assert src.data_ptr() == dst.data_ptr() and src.element_size() == dst.element_size()
    word = src.element_size()
    return InPlacePlan(
        tuple(src.shape),
        src.stride(),
        tuple(dst.shape),
        dst.stride(),
        word,
        math.prod(src.shape[1:]) * word,
    )


def run_in_place(
    kernel: ModuleType, plan: InPlacePlan, tensor: torch.Tensor, idx: torch.Tensor
) -> None:
    """Run `plan` on `tensor` (a CPU tensor of the plan's geometry) for block ids `idx`."""
    idx = _long_ids(idx)
    units = idx.numel()
    addr = tensor.data_ptr()
    kernel.gather_scatter(
        addr,
        plan.src_shape,
        plan.src_stride,
        idx.data_ptr(),
        1,
        addr,
        plan.dst_shape,
        plan.dst_stride,
        idx.data_ptr(),
        1,
        units,
        plan.word,
        _threads(units, units * plan.block_bytes),
        True,
        NATIVE_DIRECT,
    )


def _long_ids(idx: torch.Tensor) -> torch.Tensor:
    if idx.dtype != torch.long or not idx.is_contiguous():
        idx = idx.to(torch.long).contiguous()
    return idx


def _threads(units: int, bytes_moved: int) -> int:
    """Threads for a native call: torch's setting, but at least 1 MiB (by default) each."""
    return max(1, min(torch.get_num_threads(), units, bytes_moved // NATIVE_BYTES_PER_THREAD, 64))
