"""KVOutputAggregator: vLLM's merge of every worker's connector output (reference section 3.4)."""

from __future__ import annotations

from typing import Any

import pytest

from kvx import (
    BlockStored,
    EngineContext,
    ForwardContext,
    KVCacheSpec,
    KVConnectorBase_V1,
    KVConnectorKVEvents,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    KVTransferConfig,
)
from kvx.engine import KVOutputAggregator


def out(**fields: Any) -> KVConnectorOutput:
    return KVConnectorOutput(**fields)


class CountedConnector(KVConnectorBase_V1):
    """A connector that asks for a fixed number of finished reports (None = every worker)."""

    finished_count: int | None = None

    def get_finished_count(self) -> int | None:
        return self.finished_count

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


def counted(count: int | None) -> CountedConnector:
    ctx = EngineContext("e", "m", KVCacheSpec(("l0",), 2, 8, 16))
    config = KVTransferConfig(kv_connector="CountedConnector", kv_role="kv_both")
    connector = CountedConnector(config, KVConnectorRole.SCHEDULER, ctx)
    connector.finished_count = count
    return connector


class MetaSet(KVConnectorWorkerMetadata):
    def __init__(self, ids: set[str]) -> None:
        self.ids = set(ids)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, MetaSet)
        return MetaSet(self.ids | other.ids)


class OtherStats(KVConnectorStats):
    pass


def test_finished_only_when_every_worker_reported_in_the_same_step() -> None:
    agg = KVOutputAggregator(3)
    merged = agg.aggregate(
        [
            out(finished_sending={"a", "b"}, finished_recving={"x"}),
            out(finished_sending={"a"}, finished_recving={"x"}),
            out(finished_sending={"a", "b"}, finished_recving={"x"}),
        ]
    )
    assert merged is not None
    assert merged.finished_sending == {"a"}
    assert merged.finished_recving == {"x"}
    assert agg.pending() == {"sending": {"b": 1}, "recving": {}}


def test_finished_across_steps_and_reported_once() -> None:
    agg = KVOutputAggregator(2)
    first = agg.aggregate([out(finished_sending={"a"}), out()])
    assert first is not None and first.finished_sending is None
    second = agg.aggregate([out(), out(finished_sending={"a"}, finished_recving={"r"})])
    assert second is not None and second.finished_sending == {"a"}
    assert second.finished_recving is None
    third = agg.aggregate([out(finished_recving={"r"}), out()])
    assert third is not None and third.finished_recving == {"r"}
    assert third.finished_sending is None
    assert agg.pending() == {"sending": {}, "recving": {}}


def test_the_same_worker_reporting_twice_counts_twice() -> None:
    """The counter counts reports, like vLLM's (each worker reports a request once)."""
    agg = KVOutputAggregator(2)
    assert agg.aggregate([out(finished_sending={"a"})]).finished_sending is None  # type: ignore[union-attr]
    assert agg.aggregate([out(finished_sending={"a"})]).finished_sending == {"a"}  # type: ignore[union-attr]
    assert agg.violations == [
        "worker 0 reported request 'a' in finished_sending twice before every worker had "
        "reported it (each worker reports a request once)"
    ]


@pytest.mark.parametrize(("count", "world", "expected"), [(None, 4, 4), (1, 4, 1), (2, 8, 2)])
def test_from_connector_uses_get_finished_count(
    count: int | None, world: int, expected: int
) -> None:
    agg = KVOutputAggregator.from_connector(counted(count), world)
    assert agg.expected_finished_count == expected
    merged = None
    for i in range(expected):
        assert merged is None or merged.finished_sending is None, i
        merged = agg.aggregate([out(finished_sending={"r"})])
    assert merged is not None and merged.finished_sending == {"r"}


def test_expected_finished_count_override_from_a_worker_output() -> None:
    agg = KVOutputAggregator(4)
    merged = agg.aggregate([out(finished_sending={"a"}, expected_finished_count=2), out()])
    assert agg.expected_finished_count == 2
    assert merged is not None and merged.finished_sending is None
    merged = agg.aggregate([out(finished_sending={"a"}), out()])
    assert merged is not None and merged.finished_sending == {"a"}
    # 0 means "no change"
    agg.aggregate([out(expected_finished_count=0), out()])
    assert agg.expected_finished_count == 2
    # the override applies to the reports of the same call
    merged = agg.aggregate([out(finished_recving={"b"}, expected_finished_count=1), out()])
    assert merged is not None and merged.finished_recving == {"b"}


def test_expected_finished_count_must_be_positive() -> None:
    with pytest.raises(ValueError, match="expected_finished_count must be >= 1, got 0"):
        KVOutputAggregator(0)


def test_invalid_block_ids_are_unioned() -> None:
    agg = KVOutputAggregator(3)
    merged = agg.aggregate([out(invalid_block_ids={1, 2}), out(invalid_block_ids={2, 7}), out()])
    assert merged is not None and merged.invalid_block_ids == {1, 2, 7}
    assert agg.aggregate([out(), out(), out()]).invalid_block_ids == set()  # type: ignore[union-attr]


def test_stats_are_merged_with_aggregate() -> None:
    agg = KVOutputAggregator(3)
    merged = agg.aggregate(
        [
            out(),
            out(kv_connector_stats=KVConnectorStats({"n": 2, "ms": [1.0]})),
            out(kv_connector_stats=KVConnectorStats({"n": 3, "ms": [2.5], "x": 1})),
        ]
    )
    assert merged is not None and merged.kv_connector_stats is not None
    assert type(merged.kv_connector_stats) is KVConnectorStats
    assert merged.kv_connector_stats.data == {"n": 5, "ms": [1.0, 2.5], "x": 1}
    assert agg.aggregate([out(), out(), out()]).kv_connector_stats is None  # type: ignore[union-attr]


def test_stats_of_different_types_do_not_merge() -> None:
    agg = KVOutputAggregator(2)
    with pytest.raises(TypeError, match="cannot aggregate OtherStats into KVConnectorStats"):
        agg.aggregate(
            [
                out(kv_connector_stats=KVConnectorStats({"n": 1})),
                out(kv_connector_stats=OtherStats({"n": 1})),
            ]
        )


def test_worker_meta_is_merged_with_aggregate() -> None:
    agg = KVOutputAggregator(3)
    merged = agg.aggregate(
        [
            out(kv_connector_worker_meta=MetaSet({"a"})),
            out(),
            out(kv_connector_worker_meta=MetaSet({"b", "c"})),
        ]
    )
    assert merged is not None and isinstance(merged.kv_connector_worker_meta, MetaSet)
    assert merged.kv_connector_worker_meta.ids == {"a", "b", "c"}


def test_events_are_concatenated_and_workers_counted() -> None:
    e1 = BlockStored((b"h1",), None, (1, 2), 16)
    e2 = BlockStored((b"h2",), b"h1", (3, 4), 16)
    agg = KVOutputAggregator(3)
    merged = agg.aggregate(
        [
            out(kv_cache_events=KVConnectorKVEvents([e1])),
            out(kv_cache_events=KVConnectorKVEvents([e2])),
            out(kv_cache_events=KVConnectorKVEvents([])),
        ]
    )
    assert merged is not None and merged.kv_cache_events is not None
    assert merged.kv_cache_events.get_all_events() == [e1, e2]
    assert merged.kv_cache_events.get_number_of_workers() == 3
    only_second = agg.aggregate([out(), out(kv_cache_events=KVConnectorKVEvents([e2])), out()])
    assert only_second is not None and only_second.kv_cache_events is not None
    assert only_second.kv_cache_events.get_all_events() == [e2]
    assert only_second.kv_cache_events.get_number_of_workers() == 1


def test_failed_recving_waits_until_finished_recving_from_every_worker() -> None:
    agg = KVOutputAggregator(2)
    both = {"finished_recving": {"q"}, "failed_recving": {"q"}}
    first = agg.aggregate([out(finished_recving={"r"}, failed_recving={"r"}), out(**both)])
    assert first is not None
    assert first.finished_recving is None and first.failed_recving == set()
    second = agg.aggregate([out(finished_recving={"q"}), out(finished_recving={"r"})])
    assert second is not None
    assert second.finished_recving == {"q", "r"} and second.failed_recving == {"q", "r"}
    # nothing is left pending: a later success of the same id is not reported as failed
    third = agg.aggregate([out(finished_recving={"r"}), out(finished_recving={"r"})])
    assert third is not None
    assert third.finished_recving == {"r"} and third.failed_recving == set()
    assert agg.violations == []


def test_a_failed_receive_missing_from_finished_is_recorded_then_counted_finished() -> None:
    """Rule failed-is-finished: a worker's failed receive is one of its finished receives too;
    the aggregator records the breach (never repairs it silently) and counts it finished."""
    agg = KVOutputAggregator(1)
    merged = agg.aggregate([out(failed_recving={"q"})])
    assert merged is not None
    assert merged.finished_recving == {"q"} and merged.failed_recving == {"q"}
    (violation,) = agg.violations
    assert violation.startswith(
        "rule failed-is-finished: worker 0 reported ['q'] in failed_recving but not in "
        "finished_recving"
    ), violation


def test_none_outputs_of_other_ranks_are_skipped() -> None:
    agg = KVOutputAggregator(2)
    merged = agg.aggregate(
        [out(finished_sending={"a"}, invalid_block_ids={3}), None, out(finished_sending={"a"})]
    )
    assert merged is not None
    assert merged.finished_sending == {"a"} and merged.invalid_block_ids == {3}


def test_none_when_the_output_rank_has_no_output() -> None:
    agg = KVOutputAggregator(2)
    assert agg.aggregate([None, out(finished_sending={"a"})]) is None
    assert agg.aggregate([out(), None], output_rank=1) is None
    assert agg.aggregate([]) is None
    merged = agg.aggregate([None, out()], output_rank=1)
    assert merged is not None and merged.is_empty()


def test_empty_sets_become_none() -> None:
    merged = KVOutputAggregator(1).aggregate([out(finished_sending=set(), finished_recving=set())])
    assert merged is not None
    assert merged.finished_sending is None and merged.finished_recving is None
    assert merged.failed_recving == set() and merged.invalid_block_ids == set()
    assert merged.is_empty()
