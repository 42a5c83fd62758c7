"""Load planning, with no IO: which stored values a step's loads read, grouped into units
read and scattered together, and which engine blocks each value lands in.

A load's values may come from writers of other PP and TP splits (`stages[j]`, `shards[j]` of
its spec); each is read per writer stage and head shard that overlaps this rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvx.plugins.storage.blockformat import BlockShape
from kvx.plugins.storage.keys import Geometry, Stage, shard_ranges
from kvx.plugins.storage.metadata import LoadSpec


@dataclass
class Load:
    """One request's load on this rank and its first bad stored block."""

    spec: LoadSpec
    bad: int = field(init=False)

    def __post_init__(self) -> None:
        self.bad = len(self.spec.keys)


@dataclass
class BlockRun:
    """Consecutive stored blocks `first ...` of a load, held by `rows` of a unit."""

    load: Load
    first: int
    rows: range


@dataclass
class Unit:
    """Values of one writer stage and head shard read and scattered together: runs of
    one or more loads (one convert_blocks call per layer for all of them)."""

    stage: Stage
    heads: range
    shape: BlockShape
    capacity: int  # rows at most
    runs: list[BlockRun] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # per row, the stored block's key


def unit_key(unit: Unit) -> tuple[range, bytes, range]:
    """What identifies a unit's writer: its layers, layer set and head shard."""
    return (unit.stage.layers, unit.stage.layer_set, unit.heads)


def overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


def plan_units(
    loads: list[Load],
    geo: Geometry,
    own: Stage,
    heads: range,
    shape_of: Callable[[Stage, range], BlockShape],
    unit_bytes: Callable[[Unit, int], int],
) -> list[Unit]:
    """Every value the loads need on the rank of stage `own` and head range `heads`, grouped
    per writer stage and head shard into units of up to `unit_bytes(unit, units so far)` (a
    run starts on an engine block when engine blocks hold several stored blocks). A load
    whose values of another writer begin inside an engine block is cut there (`bad`)."""
    bs, ebs = geo.block_size, geo.engine_block_size
    align = ebs // bs if ebs > bs else 1
    units: list[Unit] = []
    open_units: dict[tuple[range, bytes, range], Unit] = {}
    # per (PP, TP) split of writers: the (unit key, stage, head shard) of each overlapping one
    writers: dict[tuple[int, int], list[tuple[tuple[range, bytes, range], Stage, range]]] = {}
    for load in loads:
        spec = load.spec
        keys, stages_of, shards_of = spec.keys, spec.stages, spec.shards
        j = 0
        while j < len(keys):
            if j % align:  # another writer's values begin inside an engine block
                load.bad = min(load.bad, j - j % align)  # rare: that block is recomputed
                break
            stage_split, shard_split = stages_of[j], shards_of[j]
            end = j + 1
            while (
                end < len(keys) and stages_of[end] == stage_split and shards_of[end] == shard_split
            ):
                end += 1
            part = (stage_split, shard_split)
            writer = writers.get(part)
            if writer is None:  # the same for every load of a step, nearly always
                writer = writers[part] = [
                    ((s.layers, s.layer_set, h), s, h)
                    for s in geo.stages(stage_split)
                    if overlap(s.layers, own.layers)
                    for h in shard_ranges(geo.total_heads, shard_split)
                    if overlap(h, heads)
                ]
            for key, stage, shard in writer:
                at = j
                while at < end:
                    unit = open_units.get(key)
                    room = 0 if unit is None else unit.capacity - len(unit.keys)
                    take = min(end - at, room // align * align)
                    if take <= 0:
                        shape = shape_of(stage, shard)
                        unit = Unit(stage, shard, shape, 0)
                        per = max(1, unit_bytes(unit, len(units)) // shape.value_bytes)
                        unit.capacity = max(align, per // align * align)
                        open_units[key] = unit
                        units.append(unit)
                        continue
                    assert unit is not None
                    rows = range(len(unit.keys), len(unit.keys) + take)
                    unit.runs.append(BlockRun(load, at, rows))
                    unit.keys.extend(keys[at : at + take])
                    at += take
            j = end
    return units


def targets(unit: Unit, geo: Geometry) -> list[int | None]:
    """Per row of a unit (a stored block that is an engine block, or a piece of one when
    stored blocks are smaller), the block it loads into, or None when it holds no token the
    load needs. Pieces: engine block `b`'s piece `s` is block `b * pieces + s`."""
    bs, ebs = geo.block_size, geo.engine_block_size
    pieces = max(1, ebs // bs)
    out: list[int | None] = [None] * len(unit.keys)
    for span in unit.runs:
        spec = span.load.spec
        t0 = (spec.first_block + span.first) * bs
        first, n = t0 - spec.start, len(span.rows)
        if bs == ebs and first >= 0 and first + (n - 1) * bs < spec.num_tokens:
            # every row is an engine block of the load, in order (nearly always)
            blocks = spec.block_ids[first // ebs : first // ebs + n]
            if len(blocks) == n:
                out[span.rows.start : span.rows.stop] = blocks
                continue
        for k, row in enumerate(span.rows):
            t = t0 + k * bs
            if spec.start <= t < spec.start + spec.num_tokens:
                block = spec.block_ids[(t - spec.start) // ebs]
                out[row] = block * pieces + (t - spec.start) % ebs // bs
    return out


def valid_tokens(load: Load, block_size: int) -> int:
    """Tokens the load placed before its first bad stored block."""
    spec = load.spec
    end = (spec.first_block + load.bad) * block_size
    return max(0, min(spec.num_tokens, end - spec.start))


def failed_blocks(load: Load, geo: Geometry) -> list[int]:
    """The engine blocks from the one holding the first bad stored block on (none if the
    load is whole)."""
    spec = load.spec
    if load.bad >= len(spec.keys):
        return []
    bad_token = max(spec.start, (spec.first_block + load.bad) * geo.block_size)
    return spec.block_ids[(bad_token - spec.start) // geo.engine_block_size :]


Move = tuple[slice, list[int], list[int], int | None]
"""Rows of a unit copied into engine blocks in one call: (the tokens of each row, the rows,
their engine blocks, the tokens per row or None for whole blocks)."""


def scatter_moves(good: list[tuple[BlockRun, int]], geo: Geometry) -> list[Move]:
    """Where the first `n` rows of each run land: one move per engine-block-sized piece
    of a row (stored blocks larger than engine blocks), or per set of rows that fill whole
    engine blocks (smaller ones; a run that ends inside one gets its own move)."""
    bs, ebs = geo.block_size, geo.engine_block_size
    moves: dict[object, Move] = {}
    for index, (span, n) in enumerate(good):
        spec = span.load.spec
        t0 = (spec.first_block + span.first) * bs  # request position of the run
        rows = list(span.rows[:n])
        if ebs > bs:  # rows fill engine blocks in order (a run starts on one)
            e0 = (t0 - spec.start) // ebs
            dst = spec.block_ids[e0 : e0 - (-(n * bs) // ebs)]
            whole = n * bs % ebs == 0  # whole engine blocks: one call with the others
            key: object = "whole" if whole else ("part", index)
            move = moves.setdefault(key, (slice(None), [], [], None if whole else n * bs))
            move[1].extend(rows)
            move[2].extend(dst)
            continue
        for s in range(bs // ebs):  # piece `s` of a row is one engine block (or outside)
            move = moves.setdefault(s, (slice(s * ebs, (s + 1) * ebs), [], [], None))
            for r, row in enumerate(rows):
                t = t0 + r * bs + s * ebs
                if spec.start <= t < spec.start + spec.num_tokens:
                    move[1].append(row)
                    move[2].append(spec.block_ids[(t - spec.start) // ebs])
    return [move for move in moves.values() if move[1]]
