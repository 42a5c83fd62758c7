"""Faults under the reference engine: damaged stored values and a Redis server that dies or
freezes mid-run. Every fault is real (bytes cut or flipped in the store, a redis-server process
SIGKILLed or SIGSTOPped); only the moment of the kill is pinned, by a hook run right after the
loading engine's scheduler has planned its loads."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis

from kvx import (
    ConfigError,
    KVConnectorMetadata,
    KVTransferConfig,
    RequestStatus,
    SchedulerOutput,
)
from kvx.engine.disagg import baseline_tokens
from kvx.engine.engine import Engine, EngineConfig
from kvx.engine.scheduler import RequestOutput
from kvx.plugins.storage.backends import segments

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16)
MAX_TOKENS = 4
LENGTHS = (40, 70, 100)  # 2, 4 and 6 stored blocks of 16 tokens


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    return {
        f"r{i}": [rng.randrange(BASE.vocab_size) for _ in range(n)] for i, n in enumerate(LENGTHS)
    }


def _config(url: str, policy: str = "fail", timeout_s: float = 2.0) -> EngineConfig:
    ktc = KVTransferConfig.from_dict(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"storage_url": url, "timeout_s": timeout_s},
        }
    )
    return replace(BASE, kv_transfer_config=ktc)


def _run(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, RequestOutput]:
    """Run every prompt to the end, checking every computed KV byte after each step."""
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, MAX_TOKENS)
    done: dict[str, RequestOutput] = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        assert not engine.check_kv()
        if not engine.has_pending_work():
            return done
    pytest.fail(f"engine did not finish: {engine.stats()}")


def _store(url: str, prompts: dict[str, list[int]], baseline: dict[str, list[int]]) -> None:
    engine = Engine(_config(url))
    try:
        done = _run(engine, prompts)
    finally:
        engine.shutdown()
    assert {r: o.output_token_ids for r, o in done.items()} == baseline


def _kv_stat(engine: Engine, name: str) -> int:
    return sum(int(s.data.get(name, 0)) for s in engine.kv_stats)


def _expect_policy(
    policy: str, done: dict[str, RequestOutput], baseline: dict[str, list[int]], engine: Engine
) -> None:
    """`recompute`: every request ends as the baseline; `fail`: some end in error, the rest as
    the baseline. Either way the load errors were counted."""
    errors = engine.stats()["load_errors"]
    assert errors > 0
    assert set(done) == set(baseline)
    failed = {r for r, o in done.items() if o.status is RequestStatus.FINISHED_ERROR}
    if policy == "recompute":
        assert not failed
    else:
        assert failed and len(failed) == errors
    for req_id, out in done.items():
        if req_id not in failed:
            assert out.status is RequestStatus.FINISHED_LENGTH_CAPPED
            assert out.output_token_ids == baseline[req_id]


# -- damaged stored values ---------------------------------------------------------------------


def _truncate(value: bytes) -> bytes:
    return value[: len(value) // 2]


def _flip(value: bytes) -> bytes:
    """Flip 8 bytes in the middle of the stored payloads (a version-2 segment file keeps them
    after a hole, from its data_start on)."""
    data = bytearray(value)
    start = 0
    if data[:4] == segments.MAGIC:
        start = segments.V2_FIXED.unpack_from(data)[-1]
    middle = (start + len(data)) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    return bytes(data)


def _damage_files(root: Path, damage: Callable[[bytes], bytes]) -> int:
    """Damage every third stored file (sorted by name; a segment file holding several values
    under several names counts once); return how many."""
    inodes: dict[int, Path] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        inodes.setdefault(path.stat().st_ino, path)
    files = list(inodes.values())
    for path in files[::3]:
        path.write_bytes(damage(path.read_bytes()))
    return len(files[::3])


def _damage_redis(url: str, damage: Callable[[bytes], bytes]) -> int:
    client = redis.Redis.from_url(url)
    try:
        keys = sorted(client.keys("kvx/*"))
        for key in keys[::3]:
            client.set(key, damage(client.get(key)))
        return len(keys[::3])
    finally:
        client.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("damage", [_truncate, _flip], ids=["truncated", "bit-flipped"])
@pytest.mark.parametrize("backend", ["file", "redis"])
def test_damaged_values_are_load_errors(
    backend: str,
    damage: Callable[[bytes], bytes],
    policy: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    prompts = _prompts()
    baseline = baseline_tokens(BASE, prompts, MAX_TOKENS)
    url = f"file://{tmp_path}/kv" if backend == "file" else request.getfixturevalue("redis_url")
    _store(url, prompts, baseline)
    if backend == "file":
        damaged = _damage_files(tmp_path / "kv", damage)
    else:
        damaged = _damage_redis(url, damage)
    assert damaged > 0
    engine = Engine(_config(url, policy))
    try:
        done = _run(engine, prompts)  # every loaded KV byte is checked: nothing bad is served
        _expect_policy(policy, done, baseline, engine)
    finally:
        engine.shutdown()


# -- a Redis server that dies or hangs mid-run ---------------------------------------------------


def _after_planning(engine: Engine, fault: Callable[[], None]) -> None:
    """Run `fault` once, right after the scheduler side built the first step's metadata (the
    lookups are done; the workers have not loaded yet)."""
    connector = engine.scheduler_connector
    assert connector is not None
    build = connector.build_connector_meta

    def build_then_fault(out: SchedulerOutput) -> KVConnectorMetadata:
        meta = build(out)
        connector.build_connector_meta = build  # type: ignore[method-assign]
        fault()
        return meta

    connector.build_connector_meta = build_then_fault  # type: ignore[method-assign]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_redis_dies_between_lookup_and_load(fault: str, policy: str, own_redis: Any) -> None:
    prompts = _prompts()
    baseline = baseline_tokens(BASE, prompts, MAX_TOKENS)
    _store(own_redis.url, prompts, baseline)
    timeout_s = 0.5
    engine = Engine(_config(own_redis.url, policy, timeout_s))
    _after_planning(engine, own_redis.kill if fault == "killed" else own_redis.freeze)
    started = time.monotonic()
    try:
        done = _run(engine, prompts)
        _expect_policy(policy, done, baseline, engine)
        if policy == "fail":  # every request had blocks to load
            assert all(o.status is RequestStatus.FINISHED_ERROR for o in done.values())
        if policy == "recompute":  # the recomputed blocks could not be stored either
            assert _kv_stat(engine, "save_errors") > 0
    finally:
        engine.shutdown()
    # One failed read per step at most (later layers skip), saves bounded by the timeout.
    assert time.monotonic() - started < 20 * timeout_s


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_redis_dead_before_lookup_means_recompute(policy: str, own_redis: Any) -> None:
    """A store that cannot be asked is a miss: nothing loads, nothing fails, tokens match."""
    prompts = _prompts()
    baseline = baseline_tokens(BASE, prompts, MAX_TOKENS)
    _store(own_redis.url, prompts, baseline)
    engine = Engine(_config(own_redis.url, policy))
    try:
        own_redis.kill()
        done = _run(engine, prompts)
        assert {r: o.output_token_ids for r, o in done.items()} == baseline
        assert all(o.status is RequestStatus.FINISHED_LENGTH_CAPPED for o in done.values())
        assert engine.stats()["load_errors"] == 0
        assert engine.stats()["external_tokens"] == 0
        assert _kv_stat(engine, "save_errors") > 0
    finally:
        engine.shutdown()


@pytest.mark.timeout(30)
def test_redis_unreachable_at_start_is_a_clear_error(own_redis: Any) -> None:
    """A start-up failure is a config problem naming the key (exit 2 on the CLI)."""
    own_redis.kill()
    with pytest.raises(
        ConfigError, match=r"storage_url: cannot open .*cannot reach the Redis server"
    ):
        Engine(_config(own_redis.url))
