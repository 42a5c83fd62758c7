"""Load planning without IO: which values a load reads, how they are grouped into units, and
which engine blocks each stored block lands in."""

from __future__ import annotations

from collections.abc import Callable

from kvx.plugins.storage.blockformat import BlockShape
from kvx.plugins.storage.keys import Geometry, Stage
from kvx.plugins.storage.load_plan import (
    Load,
    Unit,
    failed_blocks,
    plan_units,
    scatter_moves,
    targets,
    valid_tokens,
)
from kvx.plugins.storage.metadata import LoadSpec

LAYERS = tuple(f"model.layers.{i}.attn" for i in range(4))


def geometry(block_size: int, engine_block_size: int) -> Geometry:
    return Geometry("ns", block_size, engine_block_size, 4, 8, "bfloat16", False, LAYERS)


def shape_of(geo: Geometry) -> Callable[[Stage, range], BlockShape]:
    def shape(stage: Stage, heads: range) -> BlockShape:
        return BlockShape(
            geo.dtype,
            geo.block_size,
            2,
            geo.total_heads,
            heads,
            geo.head_size,
            layers=stage.layers,
            total_layers=len(LAYERS),
            layer_set=stage.layer_set,
        )

    return shape


def spec(n: int, *, start: int = 0, stages: int = 1, shards: int = 1, first: int = 0) -> LoadSpec:
    keys = [f"k{i}" for i in range(n)]
    return LoadSpec("r", list(range(100, 100 + n)), start, n * 16 - start, first, keys,
                    [stages] * n, [shards] * n)  # fmt: skip


def test_values_of_one_writer_fill_units_up_to_their_size() -> None:
    geo = geometry(16, 16)
    own = geo.stages(1)[0]
    loads = [Load(spec(5))]
    value = shape_of(geo)(own, range(4)).value_bytes
    units = plan_units(loads, geo, own, range(4), shape_of(geo), lambda u, i: 2 * value)
    assert [u.keys for u in units] == [["k0", "k1"], ["k2", "k3"], ["k4"]]
    assert all(u.stage == own and u.heads == range(4) for u in units)
    assert [span.rows for u in units for span in u.runs] == [range(2), range(2), range(1)]
    assert targets(units[1], geo) == [102, 103]
    assert loads[0].bad == 5 and failed_blocks(loads[0], geo) == []
    assert valid_tokens(loads[0], 16) == 80


def test_a_rank_reads_every_writer_stage_and_shard_that_overlaps_its_own() -> None:
    geo = geometry(16, 16)
    own = geo.stages(2)[1]  # layers 2-3, written by a PP-1 writer with 2 head shards
    loads = [Load(spec(3, stages=1, shards=2))]
    units = plan_units(loads, geo, own, range(0, 2), shape_of(geo), lambda u, i: 1 << 30)
    assert [(u.stage.layers, u.heads, u.keys) for u in units] == [
        (range(0, 4), range(0, 2), ["k0", "k1", "k2"])
    ]


def test_a_load_starting_inside_a_stored_block_skips_its_tokens() -> None:
    geo = geometry(32, 16)  # a stored block holds two engine blocks
    load = Load(spec(2, start=16, first=0))
    load.spec.block_ids, load.spec.num_tokens = [7, 8, 9], 48  # tokens 16..63
    units = plan_units([load], geo, geo.stages(1)[0], range(4), shape_of(geo), lambda u, i: 1 << 30)
    (unit,) = units
    moves = scatter_moves([(unit.runs[0], 2)], geo)
    # piece 0 of row 0 (tokens 0-15) is before the load; piece 1 -> block 7, row 1 -> 8, 9
    assert moves == [(slice(0, 16), [1], [8], None), (slice(16, 32), [0, 1], [7, 9], None)]


def test_a_bad_stored_block_fails_its_engine_blocks_and_the_rest() -> None:
    geo = geometry(16, 32)  # two stored blocks per engine block
    load = Load(spec(6))
    load.spec.block_ids = [4, 5, 6]
    load.bad = 3  # stored block 3 lies in engine block 1
    assert failed_blocks(load, geo) == [5, 6]
    assert valid_tokens(load, 16) == 48
    unit = Unit(geo.stages(1)[0], range(4), shape_of(geo)(geo.stages(1)[0], range(4)), 8)
    assert targets(unit, geo) == []  # an empty unit targets nothing


def test_each_row_targets_the_engine_block_of_its_first_token() -> None:
    """Rows of loads that need all of them, that start after a load's first stored block, and
    whose last block is partly needed."""
    geo = geometry(16, 16)
    whole, later, partial = spec(4), spec(3, start=16), spec(3)
    later.block_ids = [200, 201]  # tokens 16-47: row 0 holds none of them
    partial.num_tokens = 40  # row 2 (tokens 32-47) is needed for tokens 32-39
    loads = [Load(whole), Load(later), Load(partial)]
    (unit,) = plan_units(
        loads, geo, geo.stages(1)[0], range(4), shape_of(geo), lambda u, i: 1 << 30
    )
    assert targets(unit, geo) == [100, 101, 102, 103, None, 200, 201, 100, 101, 102]
