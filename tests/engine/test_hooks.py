"""run_connector_step / connector_forward: the worker-side hook order of vLLM's model runner
(reference section 4.1, step 2)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvx import (
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
    KVTransferResults,
    SchedulerOutput,
)
from kvx.engine import LayerHooks, connector_forward, run_connector_step

LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")
CTX = EngineContext("e", "m", KVCacheSpec(LAYERS, 2, 8, 16))


class StepMeta(KVConnectorMetadata):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag


class WorkerMeta(KVConnectorWorkerMetadata):
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self


class RecordingConnector(KVConnectorBase_V1):
    """Appends the name of every hook call (with its interesting arguments) to `calls`."""

    def __init__(self, results: KVTransferResults | None = None) -> None:
        super().__init__(
            KVTransferConfig(kv_connector="RecordingConnector", kv_role="kv_both"),
            KVConnectorRole.WORKER,
            CTX,
        )
        self.calls: list[tuple[Any, ...]] = []
        self.results = results or KVTransferResults()
        self.load_errors: set[int] = set()
        self.stats = KVConnectorStats({"n": 1})
        self.events = KVConnectorKVEvents([])
        self.worker_meta = WorkerMeta()

    def _rec(self, *call: Any) -> None:
        self.calls.append(call)

    # worker side
    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        self._rec("handle_preemptions", frozenset(preempted_req_ids), self.has_connector_metadata())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._rec("bind_connector_metadata", connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._rec("clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._rec("start_load_kv", self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._rec("wait_for_layer_load", layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._rec("save_kv_layer", layer_name, attn_metadata)

    def wait_for_save(self) -> None:
        self._rec("wait_for_save", self.has_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVTransferResults:
        self._rec("get_transfer_results", frozenset(finished_req_ids))
        return self.results

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._rec("get_block_ids_with_load_errors")
        return set(self.load_errors)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        self._rec("get_kv_connector_stats")
        return self.stats

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        self._rec("get_kv_connector_kv_cache_events")
        return self.events

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self._rec("build_connector_worker_meta", self.has_connector_metadata())
        return self.worker_meta

    def finish_forward(self) -> None:
        self._rec("finish_forward")

    # scheduler side (unused here)
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return StepMeta()


def names(connector: RecordingConnector) -> list[str]:
    return [c[0] for c in connector.calls]


def sched_out(
    tokens: dict[str, int] | None = None,
    *,
    preempted: set[str] | None = None,
    finished: set[str] | None = None,
    meta: Any = None,
) -> SchedulerOutput:
    return SchedulerOutput(
        num_scheduled_tokens=dict(tokens or {}),
        preempted_req_ids=set(preempted or ()),
        finished_req_ids=set(finished or ()),
        kv_connector_metadata=StepMeta("m") if meta is None else meta,
    )


def two_layer_forward(hooks: LayerHooks) -> None:
    for name in LAYERS:
        hooks.before_attention(name)
        hooks.after_kv_write(name, torch.zeros(1))


RESULTS = [
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "finish_forward",
]


def test_hook_order_of_a_step_with_a_forward() -> None:
    connector = RecordingConnector()
    attn = object()
    so = sched_out({"r": 5}, finished={"f"})
    run_connector_step(connector, so, ForwardContext(attn_metadata=attn), two_layer_forward)
    assert names(connector) == [
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        *RESULTS,
    ]
    calls = connector.calls
    assert calls[0] == ("bind_connector_metadata", so.kv_connector_metadata)
    assert calls[1] == ("start_load_kv", so.kv_connector_metadata)  # bound when loading starts
    assert calls[2:6] == [
        ("wait_for_layer_load", LAYERS[0]),
        ("save_kv_layer", LAYERS[0], attn),
        ("wait_for_layer_load", LAYERS[1]),
        ("save_kv_layer", LAYERS[1], attn),
    ]
    assert calls[6] == ("wait_for_save", True)  # metadata still bound
    assert calls[7] == ("get_transfer_results", frozenset({"f"}))
    assert ("build_connector_worker_meta", True) in calls
    assert not connector.has_connector_metadata()


def test_handle_preemptions_runs_first_only_when_requests_were_preempted() -> None:
    connector = RecordingConnector()
    run_connector_step(connector, sched_out({"r": 1}, preempted={"p", "q"}), ForwardContext(), None)
    assert connector.calls[0] == ("handle_preemptions", frozenset({"p", "q"}), False)
    assert names(connector)[1] == "bind_connector_metadata"
    connector.calls.clear()
    run_connector_step(connector, sched_out({"r": 1}), ForwardContext(), None)
    assert "handle_preemptions" not in names(connector)


def test_no_forward_step_still_runs_load_save_and_results() -> None:
    connector = RecordingConnector(KVTransferResults(finished_recving={"a"}))
    forwards: list[int] = []

    def forward(hooks: LayerHooks) -> None:
        forwards.append(1)
        two_layer_forward(hooks)

    output = run_connector_step(connector, sched_out({}), ForwardContext(), forward)
    assert forwards == []
    assert names(connector) == [
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_save",
        *RESULTS,
    ]
    assert output.finished_recving == {"a"}


def test_a_forward_that_raises_still_collects_results_and_clears_metadata() -> None:
    connector = RecordingConnector(KVTransferResults(finished_sending={"s"}))
    connector.load_errors = {4}

    def boom(hooks: LayerHooks) -> None:
        hooks.before_attention(LAYERS[0])
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError, match="forward failed"):
        run_connector_step(connector, sched_out({"r": 2}), ForwardContext(), boom)
    assert names(connector)[:4] == [
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_layer_load",
        "wait_for_save",
    ]
    assert RESULTS[:-1] == names(connector)[4:10]
    assert not connector.has_connector_metadata()

    connector = RecordingConnector(KVTransferResults(finished_sending={"s"}))
    connector.load_errors = {4}
    output = KVConnectorOutput()
    with (
        pytest.raises(RuntimeError, match="forward failed"),
        connector_forward(connector, sched_out({"r": 2}), ForwardContext(), output),
    ):
        raise RuntimeError("forward failed")
    assert output.finished_sending == {"s"}
    assert output.invalid_block_ids == {4}
    assert not connector.has_connector_metadata()


@pytest.mark.parametrize("bad", [None, {"reqs": []}, "meta"])
def test_metadata_that_is_not_connector_metadata_is_refused(bad: Any) -> None:
    connector = RecordingConnector()
    so = SchedulerOutput(num_scheduled_tokens={"r": 1}, kv_connector_metadata=bad)
    with pytest.raises(TypeError) as info:
        run_connector_step(connector, so, ForwardContext(), None)
    assert str(info.value) == (
        "scheduler_output.kv_connector_metadata must be the KVConnectorMetadata built by the "
        f"scheduler-side connector, got {type(bad).__name__}"
    )
    assert "bind_connector_metadata" not in names(connector)
    assert "start_load_kv" not in names(connector)
    assert not connector.has_connector_metadata()


def test_output_fields_come_from_the_connector() -> None:
    connector = RecordingConnector(
        KVTransferResults(finished_sending={"s"}, finished_recving={"ok"}, failed_recving={"bad"})
    )
    connector.load_errors = {3, 9}
    output = run_connector_step(connector, sched_out({"r": 1}), ForwardContext(), None)
    assert output.finished_sending == {"s"}
    assert output.finished_recving == {"ok"}  # as reported: the aggregator checks the rule
    assert output.failed_recving == {"bad"}
    assert output.invalid_block_ids == {3, 9}
    assert output.kv_connector_stats is connector.stats
    assert output.kv_cache_events is connector.events
    assert output.kv_connector_worker_meta is connector.worker_meta
    assert output.expected_finished_count == 0


def test_failed_recving_alone_is_passed_on_as_reported() -> None:
    """Not repaired here: the output aggregator records rule failed-is-finished for it."""
    connector = RecordingConnector(KVTransferResults(failed_recving={"bad"}))
    output = run_connector_step(connector, sched_out({}), ForwardContext(), None)
    assert output.finished_recving is None and output.failed_recving == {"bad"}


def test_empty_results_become_none() -> None:
    connector = RecordingConnector()
    output = run_connector_step(connector, sched_out({"r": 1}), ForwardContext(), None)
    assert output.finished_sending is None and output.finished_recving is None
    assert output.failed_recving == set() and output.invalid_block_ids == set()


def test_default_get_transfer_results_wraps_get_finished() -> None:
    """A connector that only implements the legacy get_finished still reports through it."""

    class Legacy(RecordingConnector):
        def get_transfer_results(self, finished_req_ids: set[str]) -> KVTransferResults:
            return KVConnectorBase_V1.get_transfer_results(self, finished_req_ids)

        def get_finished(self, finished_req_ids: set[str]) -> tuple[Any, Any]:
            self._rec("get_finished", frozenset(finished_req_ids))
            return {"s"}, None

    connector = Legacy()
    output = run_connector_step(connector, sched_out({}, finished={"s"}), ForwardContext(), None)
    assert ("get_finished", frozenset({"s"})) in connector.calls
    assert output.finished_sending == {"s"} and output.finished_recving is None
