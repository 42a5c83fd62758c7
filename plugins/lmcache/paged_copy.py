"""Copies between kvx paged KV blocks (any registered per-layer layout) and LMCache's memory
objects, behind LMCache's GPU-connector interface on CPU (not a kvx connector: LMCache names
its copiers "connectors").

LMCache calls the object that moves KV between the serving engine's paged cache and its own
memory objects a "GPU connector"; all of its built-in ones need CUDA. These copy CPU tensors:

- `PagedCPUConnector`: chunk format `KV_2LTD`, `[2, layers, tokens, heads * head_size]`;
- `LayerwisePagedCPUConnector`: one layer at a time, format `KV_T2D`, `[tokens, 2, heads *
  head_size]`, through LMCache's generator protocol (`batched_from_gpu` yields once per layer
  copied; `batched_to_gpu` receives each layer's objects by `send`).

Both take `kvcaches` (this rank's layer tensors, in layer order) and `slot_mapping` (one paged
slot, `block * block_size + offset`, per token of the sequence LMCache was given; -1 leaves
that token's slot untouched on load) as keyword arguments. Copies are one gather or scatter per
(layer, K/V half, chunk): no per-token Python loop.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import (
    GPUConnectorInterface,
    VLLMPagedMemLayerwiseGPUConnector,
)

from kvx.layouts import Layout


class PagedLayer:
    """One layer's paged tensor as `[blocks, block_size, heads, head_size]` views of its K and
    V halves (views share the tensor's memory in any layout)."""

    def __init__(self, layout: Layout, tensor: torch.Tensor) -> None:
        order = ("blocks", "tokens", "heads", "head_size")
        self.halves = []
        self.flat: list[torch.Tensor | None] = []  # [slots, heads, head_size] when a view exists
        for kv, half in enumerate(layout.half_views(tensor)):
            memory = layout.half_memory(kv)
            view = half.permute([memory.index(d) for d in order])
            self.halves.append(view)
            blocks, size, heads, head = view.shape
            try:
                self.flat.append(view.view(blocks * size, heads, head))
            except RuntimeError:  # tokens not adjacent to blocks in memory (HND, vLLM-CPU)
                self.flat.append(None)
        self.block_size = int(self.halves[0].shape[1])

    def gather(self, kv: int, slots: torch.Tensor, out: torch.Tensor) -> None:
        """`out[t] = slot slots[t]` of half `kv`; `out` is `[tokens, heads, head_size]`."""
        flat = self.flat[kv]
        if flat is not None and out.is_contiguous():
            torch.index_select(flat, 0, slots, out=out)
        elif flat is not None:
            out.copy_(flat.index_select(0, slots))
        else:
            out.copy_(self.halves[kv][slots // self.block_size, slots % self.block_size])

    def scatter(self, kv: int, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Slot `slots[t]` of half `kv` = `src[t]`; every slot must be >= 0 (see `kept`)."""
        flat = self.flat[kv]
        if flat is not None:
            flat.index_copy_(0, slots, src)
        else:
            self.halves[kv][slots // self.block_size, slots % self.block_size] = src


def kept(slots: torch.Tensor) -> torch.Tensor | None:
    """Which of a chunk's tokens are written on load (slot >= 0): None when all are, checked
    once per chunk rather than per layer."""
    keep = slots >= 0
    return None if bool(keep.all()) else keep


def _layers(layout: Layout, kvcaches: Sequence[torch.Tensor]) -> list[PagedLayer]:
    return [PagedLayer(layout, t) for t in kvcaches]


class _Shapes:
    def __init__(self, layout: Layout, num_layers: int, heads: int, head_size: int) -> None:
        if layout.is_cross_layer or "kv" not in layout.memory:
            raise ValueError(
                f"the LMCache connector copies per-layer K/V layouts; {layout.name!r} is "
                "cross-layer or has no K/V halves (MLA)"
            )
        self.layout = layout
        self.num_layers = num_layers
        self.heads = heads
        self.head_size = head_size
        self._cached: tuple[tuple[int, ...], list[PagedLayer]] | None = None

    def paged(self, kwargs: dict[str, Any]) -> tuple[list[PagedLayer], torch.Tensor]:
        """The paged layers (views built once per set of tensors) and the slot mapping."""
        kvcaches = kwargs["kvcaches"]
        ids = tuple(t.data_ptr() for t in kvcaches)
        if self._cached is None or self._cached[0] != ids:
            self._cached = (ids, _layers(self.layout, kvcaches))
        return self._cached[1], kwargs["slot_mapping"]


class PagedCPUConnector(GPUConnectorInterface):
    """Whole chunks, every layer at once (`KV_2LTD`)."""

    def __init__(self, layout: Layout, num_layers: int, heads: int, head_size: int) -> None:
        self.shapes = _Shapes(layout, num_layers, heads, head_size)

    def get_shape(self, num_tokens: int) -> torch.Size:
        s = self.shapes
        return torch.Size([2, s.num_layers, num_tokens, s.heads * s.head_size])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(
        self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any
    ) -> None:
        layers, slot_mapping = self.shapes.paged(kwargs)
        s = self.shapes
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            slots = slot_mapping[start:end]
            chunk = obj.tensor.view(2, s.num_layers, end - start, s.heads, s.head_size)
            for i, layer in enumerate(layers):
                for kv in (0, 1):
                    layer.gather(kv, slots, chunk[kv, i])

    def batched_to_gpu(
        self,
        memory_objs: Any = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        layers, slot_mapping = self.shapes.paged(kwargs)
        s = self.shapes
        for obj, start, end in zip(memory_objs, starts or [], ends or [], strict=True):
            slots = slot_mapping[start:end]
            chunk = obj.tensor.view(2, s.num_layers, end - start, s.heads, s.head_size)
            keep = kept(slots)
            if keep is not None:
                slots, chunk = slots[keep], chunk[:, :, keep]
            for i, layer in enumerate(layers):
                for kv in (0, 1):
                    layer.scatter(kv, slots, chunk[kv, i])


class LayerwisePagedCPUConnector(VLLMPagedMemLayerwiseGPUConnector):
    """One layer per step of LMCache's layer-wise generators (`KV_T2D`).

    It derives from LMCache's layer-wise vLLM connector only because LMCache's `store_layer` and
    `retrieve_layer` accept instances of their own layer-wise classes; none of that class's
    CUDA state is created (its `__init__` is not called) and every method it uses is here."""

    def __init__(self, layout: Layout, num_layers: int, heads: int, head_size: int) -> None:
        self.shapes = _Shapes(layout, num_layers, heads, head_size)
        self.use_mla = False

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([num_tokens, 2, self.shapes.heads * self.shapes.head_size])

    def _chunk(self, obj: Any, tokens: int) -> torch.Tensor:
        return obj.tensor.view(tokens, 2, self.shapes.heads, self.shapes.head_size)

    def batched_from_gpu(
        self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any
    ) -> Generator[None, None, None]:
        """Yields once set up, then once per layer after copying that layer out."""
        layers, slot_mapping = self.shapes.paged(kwargs)
        spans = [slot_mapping[a:b] for a, b in zip(starts, ends, strict=True)]
        yield
        for i, layer in enumerate(layers):
            for obj, slots in zip(memory_objs[i], spans, strict=True):
                chunk = self._chunk(obj, len(slots))
                for kv in (0, 1):
                    layer.gather(kv, slots, chunk[:, kv])
            yield

    def batched_to_gpu(
        self,
        memory_objs: Any = None,
        starts: Any = None,
        ends: Any = None,
        **kwargs: Any,
    ) -> Generator[None, Any, None]:
        """Called as `(starts, ends, **kwargs)`; receives each layer's objects by `send` and
        copies them in; one last `next` ends it."""
        starts, ends = memory_objs, starts  # LMCache's positional convention for layer-wise
        layers, slot_mapping = self.shapes.paged(kwargs)
        spans = [slot_mapping[a:b] for a, b in zip(starts, ends, strict=True)]
        keeps = [kept(slots) for slots in spans]
        objs = yield
        for layer in layers:
            for obj, slots, keep in zip(objs, spans, keeps, strict=True):
                chunk = self._chunk(obj, len(slots))
                if keep is not None:
                    slots, chunk = slots[keep], chunk[keep]
                for kv in (0, 1):
                    layer.scatter(kv, slots, chunk[:, kv])
            objs = yield
        yield

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        """Nothing to cache: the paged views are rebuilt when the tensors change."""
