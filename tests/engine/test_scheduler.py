"""The reference scheduler's lifecycle semantics (reference sections 4.2-4.5 and the checklist of
section 8): P-side delayed frees, D-side WAITING_FOR_REMOTE_KVS, preemption, chunked prefill,
prefix caching and request validation. Load failures (4.7): test_load_failures.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvx import (
    KVConnectorOutput,
    Request,
    RequestStatus,
)
from kvx.engine import (
    RequestOutput,
    Scheduler,
    SchedulerConfig,
)

from ._scheduler_kit import (
    BS,
    TOKEN,
    ScriptedConnector,
    baseline,
    is_empty,
    make_engine,
    prompt,
    remote,
    run,
    sched_conn,
    scheduled_history,
    scheduler,
    status,
    step,
)

# -- P side (reference 4.2) ------------------------------------------------------------------


def test_p_side_blocks_are_held_until_finished_sending() -> None:
    s, conn = scheduler(num_blocks=8)
    s.add_request(Request("r", prompt(40), max_tokens=1, kv_transfer_params={"hold": True}))
    first, outputs = step(s)
    assert first.num_scheduled_tokens == {"r": 40}
    blocks = first.scheduled_new_reqs[0].block_ids[0]
    assert len(blocks) == 3  # 2.5 blocks
    assert [(o.request_id, o.finished, o.status) for o in outputs] == [
        ("r", True, RequestStatus.FINISHED_LENGTH_CAPPED)
    ]
    assert outputs[0].new_token_ids == [TOKEN] and outputs[0].output_token_ids == [TOKEN]
    assert outputs[0].kv_transfer_params == {"remote_block_ids": blocks, "remote_request_id": "p-1"}
    assert [c for c in conn.calls if c[0] == "finished"] == [
        ("finished", "r", RequestStatus.FINISHED_LENGTH_CAPPED, blocks)
    ]
    assert "r" not in s.running and "r" not in s.waiting
    assert s.held_blocks() == {"r": blocks}
    assert [s.pool.ref_cnt[b] for b in blocks] == [1, 1, 1]
    assert s.pool.num_free_blocks == 5
    assert s.has_pending_work()
    s.abort_request("r")  # finished already: an abort changes nothing, the blocks stay held
    assert s.held_blocks() == {"r": blocks}

    second, outputs = step(s)
    assert second.finished_req_ids == {"r"} and outputs == []
    assert second.num_scheduled_tokens == {}
    third, _ = step(s)
    assert third.finished_req_ids == set()  # exactly once
    assert [s.pool.ref_cnt[b] for b in blocks] == [1, 1, 1]
    assert s.has_pending_work()

    _, outputs = step(s, KVConnectorOutput(finished_sending={"r"}))
    assert outputs == []
    assert is_empty(s)


def test_p_side_short_prompt_holds_one_block() -> None:
    s, _ = scheduler(num_blocks=4)
    s.add_request(Request("r", prompt(5), max_tokens=1, kv_transfer_params={"hold": True}))
    _, outputs = step(s)
    (held,) = s.held_blocks().values()
    assert len(held) == 1 and outputs[0].kv_transfer_params["remote_block_ids"] == held  # type: ignore[index]
    assert s.pool.ref_cnt[held[0]] == 1 and s.pool.num_free_blocks == 3
    step(s, KVConnectorOutput(finished_sending={"r"}))
    assert is_empty(s)


def test_p_side_prefix_hit_still_sends_every_block() -> None:
    s, _ = scheduler(num_blocks=8)
    s.add_request(Request("warm", prompt(40), max_tokens=1))
    step(s)
    s.add_request(Request("r", prompt(40), max_tokens=1, kv_transfer_params={"hold": True}))
    out, outputs = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32  # 2 blocks hit locally
    assert out.num_scheduled_tokens == {"r": 8}
    assert s.stats["prefix_hit_tokens"] == 32
    assert len(outputs[0].kv_transfer_params["remote_block_ids"]) == 3  # type: ignore[index]
    step(s, KVConnectorOutput(finished_sending={"r"}))
    assert is_empty(s)


def test_p_side_abort_frees_at_once_and_is_reported() -> None:
    s, conn = scheduler(num_blocks=8)
    s.add_request(Request("r", prompt(40), max_tokens=5, kv_transfer_params={"hold": True}))
    step(s)
    s.abort_request("r")
    assert s.held_blocks() == {} and s.pool.num_free_blocks == 8
    out, outputs = step(s)
    assert out.finished_req_ids == {"r"}
    assert [(o.request_id, o.finished, o.status, o.kv_transfer_params) for o in outputs] == [
        ("r", True, RequestStatus.FINISHED_ABORTED, None)
    ]
    assert [c[:3] for c in conn.calls if c[0] == "finished"] == [
        ("finished", "r", RequestStatus.FINISHED_ABORTED)
    ]
    s.abort_request("r")  # a second abort is a no-op
    assert step(s)[1] == []
    assert is_empty(s)


def test_p_side_finished_sending_from_every_worker_with_tp2() -> None:
    engine = make_engine(tp_size=2)
    try:
        engine.add_request("r", prompt(40), 1, {"hold": True})
        (out,) = engine.step()
        assert out.finished and out.kv_transfer_params is not None
        held = engine.scheduler.held_blocks()
        assert list(held) == ["r"] and len(held["r"]) == 3
        assert engine.check_kv() == []  # held blocks still hold the prompt's KV
        assert engine.step() == []  # both workers report "r" sent in this step
        assert engine.scheduler.held_blocks() == {}
        assert not engine.has_pending_work()
        assert engine.scheduler.pool.num_free_blocks == 32
    finally:
        engine.shutdown()


# -- D side (reference 4.3) ------------------------------------------------------------------


@pytest.mark.parametrize("length", [40, 32])
def test_d_side_waits_for_remote_kvs_then_recomputes_the_last_token(length: int) -> None:
    s, conn = scheduler(num_blocks=8)
    s.add_request(Request("d", prompt(length), max_tokens=2, kv_transfer_params=remote()))
    s.add_request(Request("n", prompt(20, 500), max_tokens=3))
    first, _ = step(s)
    assert first.num_scheduled_tokens == {"n": 20}  # the normal request runs meanwhile
    assert status(s, "d") is RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = s.blocks_of("d")
    assert len(blocks) == math.ceil(length / BS)
    assert [s.pool.ref_cnt[b] for b in blocks] == [1] * len(blocks)
    assert not any(s.pool.is_cached(b) for b in blocks)  # no spurious prefix caching
    assert ("alloc", "d", length) in conn.calls and ("alloc", "n", 0) in conn.calls
    (load,) = first.kv_connector_metadata.loads
    assert (load.req_id, load.block_ids, load.start, load.end) == ("d", blocks, 0, length)

    for _ in range(3):  # never scheduled before finished_recving
        out, _ = step(s)
        assert "d" not in out.num_scheduled_tokens
        assert status(s, "d") is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert not any(s.pool.is_cached(b) for b in blocks)
    out, _ = step(s, KVConnectorOutput(finished_recving={"d"}))
    assert "d" not in out.num_scheduled_tokens
    assert not any(s.pool.is_cached(b) for b in blocks)

    promoted, outputs = step(s)
    assert promoted.num_scheduled_tokens["d"] == 1
    (new,) = [n for n in promoted.scheduled_new_reqs if n.req_id == "d"]
    assert new.num_computed_tokens == length - 1
    assert new.block_ids == (blocks,)  # no extra block for the recomputed token
    assert [s.pool.is_cached(b) for b in blocks] == [True] * (length // BS) + [False] * (
        len(blocks) - length // BS
    )
    assert [c for c in conn.calls if c[:2] == ("alloc", "d")] == [
        ("alloc", "d", length),
        ("alloc", "d", 0),  # called again after the load, with nothing to load
    ]
    assert [(o.request_id, o.output_token_ids) for o in outputs if o.request_id == "d"] == [
        ("d", [TOKEN])
    ]
    for _ in range(5):
        step(s)
    assert status(s, "d") is RequestStatus.FINISHED_LENGTH_CAPPED
    assert is_empty(s)


def test_d_side_request_that_never_receives_stays_waiting() -> None:
    s, _ = scheduler(num_blocks=8)
    s.add_request(Request("d", prompt(40), max_tokens=2, kv_transfer_params=remote()))
    for _ in range(10):
        out, outputs = step(s)
        assert out.num_scheduled_tokens == {} and outputs == []
    assert status(s, "d") is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.has_pending_work() and s.pool.num_free_blocks == 5


def test_d_side_abort_while_waiting_keeps_blocks_until_finished_recving() -> None:
    s, conn = scheduler(num_blocks=8)
    s.add_request(Request("d", prompt(40), max_tokens=2, kv_transfer_params=remote()))
    step(s)
    blocks = s.blocks_of("d")
    s.abort_request("d")
    assert [c[:3] for c in conn.calls if c[0] == "finished"] == [
        ("finished", "d", RequestStatus.FINISHED_ABORTED)
    ]
    assert s.held_blocks() == {"d": blocks}  # the read may still land in them
    assert [s.pool.ref_cnt[b] for b in blocks] == [1, 1, 1]
    out, outputs = step(s)
    assert out.finished_req_ids == {"d"}
    assert [(o.request_id, o.status) for o in outputs] == [("d", RequestStatus.FINISHED_ABORTED)]
    step(s)
    assert s.held_blocks() == {"d": blocks} and s.has_pending_work()
    _, outputs = step(s, KVConnectorOutput(finished_recving={"d"}))
    assert outputs == []
    assert is_empty(s)


def test_d_side_abort_after_recv_before_promotion_frees_at_once() -> None:
    s, _ = scheduler(num_blocks=8)
    s.add_request(Request("d", prompt(40), max_tokens=2, kv_transfer_params=remote()))
    step(s)
    step(s, KVConnectorOutput(finished_recving={"d"}))
    s.abort_request("d")
    assert s.held_blocks() == {}
    step(s)
    assert is_empty(s)


def test_d_side_cannot_allocate_for_the_load_then_succeeds_later() -> None:
    s, _ = scheduler(num_blocks=4)
    s.add_request(Request("n", prompt(30, 500), max_tokens=2))  # 2 blocks
    s.add_request(Request("d", prompt(40), max_tokens=2, kv_transfer_params=remote()))  # 3
    step(s)
    assert status(s, "d") is RequestStatus.WAITING and s.blocks_of("d") == []
    step(s)  # "n" finishes
    assert status(s, "n") is RequestStatus.FINISHED_LENGTH_CAPPED
    step(s)
    assert status(s, "d") is RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, KVConnectorOutput(finished_recving={"d"}))
    for _ in range(3):
        step(s)
    assert status(s, "d") is RequestStatus.FINISHED_LENGTH_CAPPED
    assert is_empty(s)


def test_d_side_out_of_blocks_after_recv_waits_and_does_not_leak() -> None:
    """Checklist: "cannot schedule after recv when out of KV blocks -> request waits (not lost)".

    "d" loads 32 of its 40 prompt tokens; when the load finishes every block is taken by "n",
    so promotion cannot grow "d" by the block its last 8 tokens need."""
    s, _ = scheduler(num_blocks=4)
    s.add_request(Request("d", prompt(40), max_tokens=2, kv_transfer_params=remote(load=32)))
    s.add_request(Request("n", prompt(20, 500), max_tokens=6))
    step(s)
    assert status(s, "d") is RequestStatus.WAITING_FOR_REMOTE_KVS
    d_blocks = s.blocks_of("d")
    assert len(d_blocks) == 2 and s.pool.num_free_blocks == 0
    step(s, KVConnectorOutput(finished_recving={"d"}))
    for _ in range(12):
        step(s)
        if not s.has_pending_work():
            break
    assert status(s, "d") is RequestStatus.FINISHED_LENGTH_CAPPED
    assert status(s, "n") is RequestStatus.FINISHED_LENGTH_CAPPED
    assert is_empty(s), f"ref counts after both requests finished: {s.pool.ref_cnt}"


# -- preemption (reference 4.5) --------------------------------------------------------------


def test_preemption_resumes_with_full_block_table_and_same_outputs() -> None:
    prompts = {f"r{i}": prompt(30, 100 * i) for i in range(3)}
    expected = baseline(prompts, 20)
    engine = make_engine("fail", num_blocks=6)
    try:
        for rid, p in prompts.items():
            engine.add_request(rid, p, 20)
        final = run(engine)
        assert {rid: o.output_token_ids for rid, o in final.items()} == expected
        assert engine.stats()["preemptions"] > 0
        outs = sched_conn(engine).sched_outputs
        preempted = [o for o in outs if o.preempted_req_ids]
        resumed = [o for o in outs if o.scheduled_cached_reqs.resumed_req_ids]
        assert sum(len(o.preempted_req_ids) for o in preempted) == engine.stats()["preemptions"]
        assert resumed
        for out in resumed:
            cached = out.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                if rid not in cached.resumed_req_ids:
                    continue
                (table,) = cached.new_block_ids[i]  # type: ignore[misc]
                end = cached.num_computed_tokens[i] + out.num_scheduled_tokens[rid]
                assert len(table) == math.ceil(end / BS)
                assert rid not in {n.req_id for n in out.scheduled_new_reqs}
        # the worker side learns of preemptions before binding that step's metadata
        worker = engine.workers[0].connector
        assert isinstance(worker, ScriptedConnector)
        calls = [c for c in worker.calls if c[0] in ("handle_preemptions", "bind")]
        seen = [c[1] for c in calls if c[0] == "handle_preemptions"]
        assert seen == [frozenset(o.preempted_req_ids) for o in preempted]
        steps = [i for i, c in enumerate(calls) if c[0] == "bind"]
        assert len(steps) == len(outs)
        for i, c in enumerate(calls):
            if c[0] == "handle_preemptions":
                assert calls[i + 1][0] == "bind"
        # a preempted request is asked for external tokens again before it resumes
        sched_calls = sched_conn(engine).calls
        for rid in set().union(*(o.preempted_req_ids for o in preempted)):
            asked = [i for i, c in enumerate(sched_calls) if c[:2] == ("match", rid)]
            assert len(asked) >= 2
        assert engine.scheduler.pool.num_free_blocks == 6
    finally:
        engine.shutdown()


def test_preemption_without_connector_matches_baseline() -> None:
    prompts = {f"r{i}": prompt(30, 100 * i) for i in range(3)}
    expected = baseline(prompts, 20)
    engine = make_engine(None, num_blocks=6)
    try:
        for rid, p in prompts.items():
            engine.add_request(rid, p, 20)
        final = run(engine)
        assert {rid: o.output_token_ids for rid, o in final.items()} == expected
        assert engine.stats()["preemptions"] > 0
        assert engine.scheduler.pool.num_free_blocks == 6
    finally:
        engine.shutdown()


# -- chunked prefill, prefix caching, validation ---------------------------------------------


def test_chunked_prefill_under_the_token_budget() -> None:
    prompts = {"a": prompt(40), "b": prompt(10, 300)}
    expected = baseline(prompts, 3)
    engine = make_engine("fail", max_num_batched_tokens=16)
    try:
        engine.add_request("a", prompts["a"], 3)
        engine.add_request("b", prompts["b"], 3)
        final = run(engine)
        assert {rid: o.output_token_ids for rid, o in final.items()} == expected
        budgets = [o.num_scheduled_tokens for o in sched_conn(engine).sched_outputs]
        assert all(sum(b.values()) <= 16 for b in budgets)
        assert budgets[:4] == [{"a": 16}, {"a": 16}, {"a": 8, "b": 8}, {"a": 1, "b": 2}]
        assert scheduled_history(engine, "a")[:3] == [(0, 16), (16, 16), (32, 8)]
    finally:
        engine.shutdown()


def test_prefix_cache_hits() -> None:
    shared = prompt(40)
    expected = baseline({"second": [*shared, 5, 6, 7]}, 2)
    engine = make_engine(None)
    try:
        engine.add_request("first", shared, 2)
        run(engine)
        assert engine.stats()["prefix_hit_tokens"] == 0
        engine.add_request("second", [*shared, 5, 6, 7], 2)
        final = run(engine)
        assert engine.stats()["prefix_hit_tokens"] == 32
        assert final["second"].output_token_ids == expected["second"]
        # a whole-block prompt still computes its last token: one block fewer is hit
        engine.add_request("exact", shared[:32], 1)
        run(engine)
        assert engine.stats()["prefix_hit_tokens"] == 32 + 16
    finally:
        engine.shutdown()


def test_prefix_caching_disabled() -> None:
    engine = make_engine(None, enable_prefix_caching=False)
    try:
        for rid in ("a", "b"):
            engine.add_request(rid, prompt(40), 1)
            run(engine)
        assert engine.stats()["prefix_hit_tokens"] == 0
    finally:
        engine.shutdown()


def test_add_request_errors() -> None:
    s, _ = scheduler(num_blocks=4)
    s.add_request(Request("r", [1, 2, 3]))
    with pytest.raises(ValueError, match=r"^request id 'r' is already in use$"):
        s.add_request(Request("r", [4]))
    with pytest.raises(ValueError, match=r"^request 'e' has an empty prompt$"):
        s.add_request(Request("e", []))
    with pytest.raises(ValueError, match=r"^request 'z': max_tokens must be >= 1$"):
        s.add_request(Request("z", [1], max_tokens=0))
    with pytest.raises(ValueError) as info:
        s.add_request(Request("big", list(range(60)), max_tokens=5))
    assert str(info.value) == (
        "request 'big' needs up to 5 blocks but the engine has 4; shorten it or give the "
        "engine more blocks"
    )
    s.add_request(Request("fits", list(range(60)), max_tokens=4))  # exactly 4 blocks
    assert list(s.states) == ["r", "fits"] and s.waiting == ["r", "fits"]


def test_scheduler_config_errors() -> None:
    with pytest.raises(ValueError, match="kv_load_failure_policy must be 'fail' or 'recompute'"):
        Scheduler(SchedulerConfig(4, BS, kv_load_failure_policy="retry"))
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        Scheduler(SchedulerConfig(0, BS))


def test_scheduler_without_connector() -> None:
    s = Scheduler(SchedulerConfig(8, BS))
    s.add_request(Request("r", prompt(20), max_tokens=2))
    out, outputs = step(s)
    assert out.kv_connector_metadata is None and out.num_scheduled_tokens == {"r": 20}
    assert [o.output_token_ids for o in outputs] == [[TOKEN]]
    out, outputs = step(s)
    assert outputs[0].finished and outputs[0].status is RequestStatus.FINISHED_LENGTH_CAPPED
    step(s)
    assert not s.has_pending_work() and s.pool.num_free_blocks == 8


# -- randomised mixes ------------------------------------------------------------------------

KINDS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "async": {"load": "all", "async": True},
    "sync": {"load": "all"},
    "sync-part": {"load": 16},
    "async-bad": {"load": "all", "async": True, "bad": [1]},
    "sync-bad": {"load": "all", "bad": [0]},
    "fail": {"load": "all", "async": True, "fail": True},
}


def random_mix(seed: int) -> None:
    """Requests of every kind arrive over time; the engine must produce the baseline's tokens
    (or FINISHED_ERROR under the fail policy), pass every KV check and free every block."""
    import random

    rng = random.Random(seed)
    policy = rng.choice(["fail", "recompute"])
    requests: dict[str, tuple[list[int], int, dict[str, Any] | None]] = {}
    shared = prompt(40, 999)
    kinds = [k for k in KINDS if rng.random() < 0.5 or not (KINDS[k] or {}).get("async")]
    for i in range(rng.randint(1, 4)):
        tokens = [*shared[: rng.randint(0, 40)], *prompt(rng.randint(1, 30), 77 * i)][:60]
        params = KINDS[rng.choice(kinds)]
        requests[f"r{i}"] = (tokens, rng.randint(1, 12), dict(params) if params else None)
    sizes = [math.ceil((len(t) + m) / BS) for t, m, _ in requests.values()]
    need = sum(sizes)
    async_loads = any(p and p.get("async") for _, _, p in requests.values())
    # Preemption only without async loads: a preempted request at the head of the queue
    # waits for blocks a WAITING_FOR_REMOTE_KVS request behind it holds (as in vLLM).
    num_blocks = need if async_loads else rng.randint(max(sizes), need)
    engine = make_engine(
        policy,
        num_blocks=num_blocks,
        max_num_batched_tokens=rng.choice([8, 16, 512]),
        tp_size=rng.choice([1, 2]),
    )
    try:
        pending = list(requests)
        final: dict[str, RequestOutput] = {}
        for _ in range(400):
            if not pending and not engine.has_pending_work():
                break
            if pending and rng.random() < 0.6:
                rid = pending.pop(0)
                engine.add_request(rid, *requests[rid])
            for out in engine.step():
                assert out.request_id not in final
                if out.finished:
                    final[out.request_id] = out
            assert engine.check_kv() == []
        assert sorted(final) == sorted(requests)
        assert engine.scheduler.pool.num_free_blocks == num_blocks
    finally:
        engine.shutdown()
    for rid, out in final.items():
        tokens, max_tokens, params = requests[rid]
        if out.status is RequestStatus.FINISHED_ERROR:
            assert policy == "fail" and params and ("bad" in params or "fail" in params)
            continue
        assert out.status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert out.output_token_ids == baseline({rid: tokens}, max_tokens)[rid], (rid, params)


def test_random_mixes_match_the_baseline() -> None:
    for seed in range(40):
        try:
            random_mix(seed)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc
