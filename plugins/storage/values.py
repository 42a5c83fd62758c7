"""Value buffers seen as stored blocks: uint8 rows `[n, value_bytes]`, one stored value each
(header, then every layer of its stage in the writer's element order)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvx.layouts import convert_blocks
from kvx.plugins.storage.blockformat import HEADER, BlockShape


def layer_view(
    values: torch.Tensor, shape: BlockShape, position: int, dtype: torch.dtype
) -> torch.Tensor:
    """Layer `position` of every value in `values` as stored blocks of `shape`'s layout: a
    strided view `[n, *order]`."""
    item = shape.itemsize
    per = shape.layer_bytes // item
    at = HEADER.size // item + position * per
    return values.view(dtype)[:, at : at + per].view(-1, *shape.tensor_shape[1:])


def token_slice(view: torch.Tensor, shape: BlockShape, tokens: slice) -> torch.Tensor:
    """The `tokens` of every stored block in a layer view (a piece of an engine block's size;
    the order must not be split)."""
    if tokens == slice(None):
        return view
    index = [slice(None)] * view.dim()
    index[1 + shape.order.index("t")] = tokens
    return view[tuple(index)]


def converted(
    view: torch.Tensor, rows: Sequence[int], shape: BlockShape, target: BlockShape
) -> torch.Tensor:
    """Stored blocks `rows` of a layer view of `shape`, as new blocks of `target`'s order."""
    out = torch.empty((len(rows), *target.tensor_shape[1:]), dtype=view.dtype)
    convert_blocks(
        view, out, rows, range(len(rows)), src_layout=shape.layout, dst_layout=target.layout
    )
    return out


def unify_orders(
    values: torch.Tensor, rows: list[int], shapes: list[BlockShape | None], dtype: torch.dtype
) -> BlockShape:
    """The shape of the first of `rows`, after rewriting (in `values`) every other row stored
    in another element order into its order: writers of different layouts may have stored
    one request's blocks."""
    target = shapes[rows[0]]
    assert target is not None
    others: dict[BlockShape, list[int]] = {}
    for row in rows:
        shape = shapes[row]
        assert shape is not None
        if shape != target:
            others.setdefault(shape, []).append(row)
    for shape, moved in others.items():
        for position in range(len(shape.layers)):
            src = layer_view(values, shape, position, dtype)
            layer_view(values, target, position, dtype)[moved] = converted(
                src, moved, shape, target
            )
    return target
