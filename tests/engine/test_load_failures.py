"""The reference scheduler under load failures (reference section 4.7): asynchronous and
synchronous loads with bad blocks, the recompute and fail policies, and failed receives.
"""

from __future__ import annotations

import pytest

from kvx import (
    RequestStatus,
)
from kvx.engine import (
    RequestOutput,
)

from ._scheduler_kit import (
    BS,
    baseline,
    make_engine,
    prompt,
    remote,
    run,
    sched_conn,
    scheduled_history,
)

# -- load failures (reference 4.7) -----------------------------------------------------------


LONG = prompt(60)  # 3 full blocks and a partial one


@pytest.fixture(scope="module")
def long_baseline() -> list[int]:
    return baseline({"d": LONG}, 3)["d"]


def test_async_load_failure_recompute_truncates_at_the_first_bad_block(
    long_baseline: list[int],
) -> None:
    engine = make_engine("recompute")
    try:
        engine.add_request("d", LONG, 3, remote(bad=[2, 3]))
        assert engine.step() == []  # load started, finished and failed in this step
        req = engine.scheduler.states["d"].request
        assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert req.num_computed_tokens == 2 * BS
        assert engine.stats()["load_errors"] == 1
        final = run(engine)
        assert final["d"].status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert final["d"].output_token_ids == long_baseline
        assert scheduled_history(engine, "d")[0] == (32, 28)  # the valid prefix is kept
        assert engine.scheduler.pool.num_free_blocks == 32
    finally:
        engine.shutdown()


def test_async_corruption_that_is_not_reported_changes_the_output(
    long_baseline: list[int],
) -> None:
    """The recompute test has teeth: the same corruption, unreported, is visible."""
    engine = make_engine("recompute")
    try:
        engine.add_request("d", LONG, 3, remote(bad=[2], silent=True))
        engine.step()
        engine.step()  # promoted: the last token is computed and sampled
        problems = engine.check_kv()
        assert len(problems) == 2  # one line per layer
        for layer, line in enumerate(problems):
            assert f"pp0/tp0 model.layers.{layer}.self_attn: request d position 32 (of 60)" in line
        final: dict[str, RequestOutput] = {}
        while engine.has_pending_work():
            final.update({o.request_id: o for o in engine.step() if o.finished})
        assert final["d"].output_token_ids != long_baseline
    finally:
        engine.shutdown()


def test_async_load_failure_fail_policy_finishes_with_error() -> None:
    engine = make_engine("fail")
    try:
        engine.add_request("d", LONG, 3, remote(bad=[1]))
        (out,) = engine.step()
        assert (out.request_id, out.finished, out.status) == (
            "d",
            True,
            RequestStatus.FINISHED_ERROR,
        )
        assert out.output_token_ids == []
        pool = engine.scheduler.pool
        assert not any(pool.is_cached(b) for b in range(pool.num_blocks))
        assert engine.step() == []
        assert not engine.has_pending_work() and pool.num_free_blocks == 32
    finally:
        engine.shutdown()


def test_sync_load_failure_recompute(long_baseline: list[int]) -> None:
    engine = make_engine("recompute")
    try:
        engine.add_request("d", LONG, 3, {"load": 48, "bad": [1]})
        assert engine.step() == []  # the step's sampled token is discarded
        req = engine.scheduler.states["d"].request
        assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == BS
        final = run(engine)
        assert final["d"].output_token_ids == long_baseline
        assert scheduled_history(engine, "d")[:2] == [(48, 12), (16, 44)]
    finally:
        engine.shutdown()


def test_sync_load_failure_fail_evicts_the_bad_and_later_blocks() -> None:
    engine = make_engine("fail")
    try:
        engine.add_request("d", LONG, 3, {"load": 48, "bad": [1]})
        (out,) = engine.step()
        assert (out.finished, out.status) == (True, RequestStatus.FINISHED_ERROR)
        blocks = sched_conn(engine).sched_outputs[0].scheduled_new_reqs[0].block_ids[0]
        pool = engine.scheduler.pool
        assert [pool.is_cached(b) for b in blocks] == [True, False, False, False]
        assert pool.num_free_blocks == 32
        # cache pollution prevention: the same prompt only hits the good first block
        engine.add_request("again", LONG, 1)
        engine.step()
        assert engine.stats()["prefix_hit_tokens"] == BS
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_recving_fails_the_whole_request(policy: str, long_baseline: list[int]) -> None:
    engine = make_engine(policy)
    try:
        engine.add_request("d", LONG, 3, remote(fail=True))
        outputs = engine.step()
        if policy == "fail":
            assert [(o.request_id, o.status) for o in outputs] == [
                ("d", RequestStatus.FINISHED_ERROR)
            ]
            assert engine.step() == []
            assert not engine.has_pending_work()
            assert engine.scheduler.pool.num_free_blocks == 32
            return
        assert outputs == []
        assert engine.scheduler.states["d"].request.num_computed_tokens == 0
        final = run(engine)
        assert final["d"].output_token_ids == long_baseline
        assert scheduled_history(engine, "d")[0] == (0, 60)  # retried from scratch
        assert engine.scheduler.pool.num_free_blocks == 32
    finally:
        engine.shutdown()


def test_d_side_async_load_with_engine_matches_baseline(long_baseline: list[int]) -> None:
    engine = make_engine("fail")
    try:
        engine.add_request("d", LONG, 3, remote())
        final = run(engine)
        assert final["d"].output_token_ids == long_baseline
        assert scheduled_history(engine, "d")[0] == (59, 1)
        assert engine.stats()["external_tokens"] == 60
        assert engine.stats()["external_blocks"] == 4
    finally:
        engine.shutdown()
