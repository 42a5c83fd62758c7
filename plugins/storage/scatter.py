"""Loads through buffers: values read into a buffer (another layout, block size, head shard or
stage than the engine's own) and checked (`fetch_into`), then converted into the paged KV cache
with `convert_blocks` (`scatter`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvx import StorageBackend
from kvx.layouts import Layout, convert_blocks
from kvx.plugins.storage.blockformat import KV_ORDER, BlockFormatError, BlockShape, check_value
from kvx.plugins.storage.buffers import row_views
from kvx.plugins.storage.direct import Fetched, check_size
from kvx.plugins.storage.keys import Geometry, Stage
from kvx.plugins.storage.load_plan import BlockRun, Unit, scatter_moves
from kvx.plugins.storage.values import converted, layer_view, token_slice


def fetch_into(
    unit: Unit,
    names: list[str],
    flat: torch.Tensor,
    backend: StorageBackend,
    per: int,
    verify: bool,
    mac_key: bytes | None,
) -> Fetched:
    """Read a unit's values (`names`, per row) into rows of `flat`, `per` values per backend
    call, and check each (an IO thread); a failed read is returned, not raised."""
    shape = unit.shape
    values = row_views(flat, len(unit.keys), shape.value_bytes)
    rows = [memoryview(row.numpy()) for row in values]
    try:
        sizes: list[int | None] = []
        for at in range(0, len(names), per):
            sizes.extend(backend.get_into(names[at : at + per], rows[at : at + per]))
    except Exception as exc:  # an unreachable store fails these loads, not the engine step
        return Fetched(unit, flat, values, [], error=exc)
    errors: list[BlockFormatError | None] = []
    shapes: list[BlockShape | None] = []
    for name, row, size in zip(names, rows, sizes, strict=True):
        try:
            check_size(name, size, len(row))
            stored, _ = check_value(name, row, shape, verify=verify, mac_key=mac_key)
            errors.append(None)
            shapes.append(stored)
        except BlockFormatError as exc:
            errors.append(exc)
            shapes.append(None)
    return Fetched(unit, flat, values, errors, shapes)


def scatter(
    unit: Unit,
    values: torch.Tensor,
    good: list[tuple[BlockRun, int]],
    stored: BlockShape,
    geo: Geometry,
    stage: Stage,
    heads: range,
    caches: dict[int, torch.Tensor],
    layout: Layout,
) -> None:
    """Copy the first `n` rows of each run (values of the `stored` shape), every layer
    this rank (`stage`, `heads`; `caches` by global layer index, in `layout`) holds, into the
    cache: one convert_blocks call per layer and engine-block-sized piece of a row."""
    bs, ebs = geo.block_size, geo.engine_block_size
    dtype = getattr(torch, geo.dtype)
    head_args: dict[str, range] = {}
    if not geo.mla and unit.heads != heads:
        lo, hi = max(unit.heads.start, heads.start), min(unit.heads.stop, heads.stop)
        head_args["src_heads"] = range(lo - unit.heads.start, hi - unit.heads.start)
        head_args["dst_heads"] = range(lo - heads.start, hi - heads.start)
    moves = scatter_moves(good, geo)
    layers = range(
        max(unit.stage.layers.start, stage.layers.start),
        min(unit.stage.layers.stop, stage.layers.stop),
    )
    for g in layers:
        view = layer_view(values, stored, g - unit.stage.layers.start, dtype)
        shape = stored
        if stored.k_order and bs > ebs:  # K and V orders differ: unsplit, then cut
            shape = replace(stored, order=KV_ORDER, k_order="")
            view = converted(view, range(view.shape[0]), stored, shape)
        for tokens, src, dst, num_tokens in moves:
            convert_blocks(
                token_slice(view, shape, tokens),
                caches[g],
                src,
                dst,
                src_layout=shape.layout,
                dst_layout=layout,
                num_tokens=num_tokens,
                **head_args,
            )
