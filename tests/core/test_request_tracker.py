"""RequestTracker: each scheduled request's block table kept from the scheduler outputs
(whole tables for new and resumed requests, new blocks for running ones, none while
preempted), and each step's recorded loads handed to the right request once; PlanningScheduler,
the scheduler half built on it; LoadsAndStores, the metadata most planners send."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvx import (
    CachedRequestData,
    KVCacheBlocks,
    KVConnectorMetadata,
    LoadsAndStores,
    NewRequestData,
    PlanningScheduler,
    Request,
    RequestTracker,
    ScheduledRequest,
    SchedulerOutput,
)
from kvx.engine.metadata_wire import decode_metadata, encode_metadata


def new(req_id: str, blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, [1, 2, 3], (blocks,), computed)


def test_block_tables_follow_new_running_preempted_and_resumed_requests() -> None:
    tracker = RequestTracker[str]("test", lambda n: f"state of {n.req_id}")
    tracker.record_load("a", 32)
    tracker.record_load("b", 16)
    tracker.record_load("b", 0)  # allocated again without a load: the earlier one is void
    first = tracker.scheduled(
        SchedulerOutput(
            scheduled_new_reqs=[new("a", [4, 5], computed=32), new("b", [6])],
            num_scheduled_tokens={"a": 8, "b": 16},
        )
    )
    assert [(s.req_id, s.block_ids, s.state) for s in first] == [
        ("a", [4, 5], "state of a"),
        ("b", [6], "state of b"),
    ]
    assert [(s.num_computed_tokens, s.num_scheduled_tokens) for s in first] == [(32, 8), (0, 16)]
    assert [s.num_external_tokens for s in first] == [32, 0]
    assert not any(s.resumed for s in first)

    running = CachedRequestData(req_ids=["a"], new_block_ids=[([7],)], num_computed_tokens=[40])
    second = tracker.scheduled(
        SchedulerOutput(
            scheduled_cached_reqs=running,
            num_scheduled_tokens={"a": 1},
            preempted_req_ids={"b"},
        )
    )
    assert [(s.req_id, s.block_ids, s.num_external_tokens) for s in second] == [("a", [4, 5, 7], 0)]
    assert tracker.requests["b"].block_ids == []  # preempted: its blocks are gone

    resumed = CachedRequestData(
        req_ids=["b", "ghost"],
        resumed_req_ids={"b"},
        new_block_ids=[([9, 8],), ([1],)],
        num_computed_tokens=[0, 0],
    )
    third = tracker.scheduled(SchedulerOutput(scheduled_cached_reqs=resumed))
    assert [(s.req_id, s.block_ids, s.resumed) for s in third] == [("b", [9, 8], True)]

    tracker.forget("b")
    assert list(tracker.requests) == ["a"]


def test_only_tracked_requests_without_start_and_stray_loads_are_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracker = RequestTracker[int]("kvx test")
    tracker.track("kept", [3], 7)
    tracker.record_load("kept", 16)
    tracker.record_load("never-scheduled", 48)
    out = SchedulerOutput(scheduled_new_reqs=[new("kept", [3, 4]), new("untracked", [5])])
    with caplog.at_level(logging.WARNING, logger="kvx.contract.planning"):
        steps = tracker.scheduled(out)
    assert [(s.req_id, s.block_ids, s.state, s.num_external_tokens) for s in steps] == [
        ("kept", [3, 4], 7, 16)
    ]
    assert "kvx test: loads of unscheduled requests dropped: {'never-scheduled': 48}" in caplog.text
    assert tracker.scheduled(out)[0].num_external_tokens == 0  # handed out once


def test_planning_scheduler_plans_each_scheduled_request_once_per_step() -> None:
    @dataclass
    class Plan(KVConnectorMetadata):
        planned: list[tuple[str, list[int], int]] = field(default_factory=list)

    class Planner(PlanningScheduler[str, Plan]):  # metadata_type: Plan, from the type argument
        def __init__(self) -> None:  # "x" is not followed
            self.requests = RequestTracker("planner", lambda n: None if n.req_id == "x" else "s")
            self.steps_planned = 0

        def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
            return 0, False

        def plan(self, meta: Plan, step: ScheduledRequest[str]) -> None:
            meta.planned.append((step.req_id, step.block_ids, step.num_external_tokens))

        def step_planned(self) -> None:
            self.steps_planned += 1

    planner = Planner()
    request = Request("a", [1] * 40)
    planner.update_state_after_alloc(request, KVCacheBlocks(([1, 2, 3],)), 32)
    out = SchedulerOutput(scheduled_new_reqs=[new("a", [1, 2, 3], 32), new("x", [4])])
    meta = planner.build_connector_meta(out)
    assert isinstance(meta, Plan) and meta.planned == [("a", [1, 2, 3], 32)]
    assert planner.steps_planned == 1


def test_loads_and_stores_is_plain_fields_that_cross_a_process_boundary() -> None:
    @dataclass
    class Steps(LoadsAndStores[str, int]):
        held: list[str] = field(default_factory=list)

    first, second = Steps(), Steps()
    first.loads.append("a")
    assert second.loads == [] and second.stores == []  # no list shared between steps
    meta = Steps(["a"], [1, 2], ["r"])  # loads, stores, then the subclass's own fields
    copy = decode_metadata(encode_metadata(meta), meta)
    assert copy == meta and copy is not meta and copy.stores is not meta.stores
