"""RequestTracker: each scheduled request's block table kept from the scheduler outputs
(whole tables for new and resumed requests, new blocks for running ones, none while
preempted), and each step's recorded loads handed to the right request once."""

from __future__ import annotations

import logging

import pytest

from kvx import CachedRequestData, NewRequestData, RequestTracker, SchedulerOutput


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
    with caplog.at_level(logging.WARNING, logger="kvx.rolesplit"):
        steps = tracker.scheduled(out)
    assert [(s.req_id, s.block_ids, s.state, s.num_external_tokens) for s in steps] == [
        ("kept", [3, 4], 7, 16)
    ]
    assert "kvx test: loads of unscheduled requests dropped: {'never-scheduled': 48}" in caplog.text
    assert tracker.scheduled(out)[0].num_external_tokens == 0  # handed out once
