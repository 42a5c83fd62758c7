"""What the reference engine checks beyond vLLM's own behaviour: ids in the finished sets that
name no transfer, per-worker metadata decoded from msgpack, and fragmented free lists."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import msgspec
import pytest

from kvx import KVConnectorMetadata
from kvx.contract.auxiliary import KVConnectorOutput
from kvx.contract.types import Request, SchedulerOutput
from kvx.engine import EngineConfig, Scheduler, SchedulerConfig
from kvx.engine.block_pool import BlockPool
from kvx.engine.metadata_wire import MetadataWireError, decode_metadata, encode_metadata
from kvx.engine.server import EngineProcess


@dataclass
class Child(KVConnectorMetadata):
    block_ids: list[int] = field(default_factory=list)
    leases: dict[str, float] = field(default_factory=dict)


class Frozen(msgspec.Struct, frozen=True):
    name: str
    ids: tuple[int, ...]


@dataclass
class Parent(KVConnectorMetadata):
    children: tuple[KVConnectorMetadata, ...] = ()  # typed with the marker base, like Multi's
    frozen: Frozen | None = None
    extra: set[str] = field(default_factory=set)


def test_metadata_is_rebuilt_from_bytes_with_its_classes() -> None:
    meta = Parent((Child([3, 1], {"r": 1.5}), KVConnectorMetadata()), Frozen("x", (1, 2)), {"a"})
    raw = encode_metadata(meta)
    first, second = decode_metadata(raw, meta), decode_metadata(raw, meta)
    assert first.children[0] == meta.children[0] and type(first.children[0]) is Child
    assert type(first.children[1]) is KVConnectorMetadata  # the field-less marker a skeleton sends
    assert first.frozen == meta.frozen and first.extra == meta.extra
    assert isinstance(first.frozen, Frozen) and first.frozen.ids == (1, 2)
    first.children[0].block_ids.clear()  # a worker mutating its copy
    first.extra.add("b")
    assert second.children[0].block_ids == [3, 1] and second.extra == {"a"}
    assert meta.children[0].block_ids == [3, 1]


def test_metadata_no_serialiser_can_send_fails_naming_its_type() -> None:
    @dataclass
    class WithLock(KVConnectorMetadata):
        lock: object = None

    with pytest.raises(MetadataWireError, match="metadata of type WithLock cannot be sent"):
        encode_metadata(WithLock(threading.Lock()))


def test_unknown_and_repeated_finished_ids_are_recorded_not_freed() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    scheduler.add_request(Request("r", [1, 2, 3], max_tokens=1))
    out = scheduler.schedule()
    kv = KVConnectorOutput(finished_sending={"ghost"}, finished_recving={"r"})
    scheduler.update_from_output(out, {"r": 7}, kv)
    violations = scheduler.take_violations()
    assert len(violations) == 2, violations
    assert "finished_sending names request 'ghost'" in violations[0]
    assert "finished_recving names request 'r', which is not loading" in violations[1]
    assert scheduler.take_violations() == []
    empty = scheduler.schedule()
    assert isinstance(empty, SchedulerOutput)
    assert scheduler.pool.num_free_blocks == 8


def test_load_errors_naming_blocks_no_load_wrote_into_are_recorded_and_ignored() -> None:
    """Rule load-errors-name-loaded-blocks: a request that loaded nothing keeps its computed
    tokens, as in vLLM, and the report is recorded with the blocks it named."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    scheduler.add_request(Request("r", [1, 2, 3, 4, 5], max_tokens=2))
    out = scheduler.schedule()
    own = scheduler.states["r"].blocks[0]
    stray = next(b for b in range(8) if b not in scheduler.states["r"].blocks)
    kv = KVConnectorOutput(invalid_block_ids={own, stray})
    scheduler.update_from_output(out, {"r": 7}, kv)
    (violation,) = scheduler.take_violations()
    assert "rule load-errors-name-loaded-blocks" in violation, violation
    assert f"blocks [{', '.join(map(str, sorted({own, stray})))}] (2 of 2)" in violation
    assert scheduler.states["r"].request.num_computed_tokens == 5  # nothing recomputed


def test_a_shuffled_free_list_scatters_blocks_reproducibly() -> None:
    blocks = BlockPool(64, shuffle_seed=5).allocate(8)
    assert blocks == BlockPool(64, shuffle_seed=5).allocate(8)
    assert blocks != sorted(blocks) and blocks != list(range(blocks[0], blocks[0] + 8))
    assert BlockPool(64).allocate(3) == [0, 1, 2]


@pytest.mark.timeout(120)
def test_an_engine_process_diagnoses_what_keeps_it_busy() -> None:
    engine = EngineProcess(EngineConfig(num_blocks=8, block_size=4), name="busy", timeout_s=60)
    try:
        engine.add_request("r", [1, 2, 3, 4, 5], 2)
        assert engine.diagnose() == ["request r waiting for free blocks (waiting)"]
        engine.step()
        (line,) = engine.diagnose()
        assert line.startswith("request r running with blocks [") and "(5 of 6 tokens)" in line
    finally:
        engine.close()
