"""Lifecycle details beyond the conformance suite, in one process (real NIXL, real engines):
D's heartbeats keep P's lease while D has no room yet, D's prefix hit ending inside one of P's
larger blocks, and no thread or socket left after shutdown."""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from kvx.engine.disagg import DisaggregatedPair, baseline_tokens, pd_configs
from kvx.engine.engine import EngineConfig
from kvx.engine.server import LocalEngine

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=128)


def kv(**extra: Any) -> dict[str, Any]:
    options = {"kv_lease_duration": 5, "handshake_timeout_s": 2, "transfer_timeout_s": 5}
    return {"kv_connector": "NixlConnector", "kv_connector_extra_config": {**options, **extra}}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(BASE.vocab_size) for _ in range(n)]


def connector_stats(engine: Any) -> dict[str, int]:
    assert isinstance(engine, LocalEngine)
    totals: dict[str, int] = {}
    for stats in engine.engine.kv_stats:
        for key, value in stats.to_dict().items():
            totals[key] = totals.get(key, 0) + (len(value) if isinstance(value, list) else value)
    return totals


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(120)
def test_heartbeats_keep_the_lease_while_decode_is_full() -> None:
    """D is full with a long local request; the remote request waits there for several
    leases. D's scheduler heartbeats keep P's blocks: no lease expires, output exact."""
    lease = 1.0
    p, d = pd_configs(BASE, kv(kv_lease_duration=lease))
    d = d.__class__(**{**d.__dict__, "num_blocks": 14})
    local, remote = prompt(180, 1), prompt(40, 2)
    expected = baseline_tokens(BASE, {"l": local}, 30) | baseline_tokens(BASE, {"r": remote}, 4)
    with DisaggregatedPair(p, d, processes=False) as pair:
        pair.run({"warm": prompt(20, 3)}, 2)  # D shakes hands with P first
        pair.submit_local("local", local, 30, expected["l"])
        pair.step()
        pair.submit("remote", remote, 4, expected["r"])
        start = time.monotonic()
        while not pair.finished():
            assert time.monotonic() - start < 60
            pair.step()
            time.sleep(0.1)  # steps slow enough that the wait spans several leases
        waited = time.monotonic() - start
        assert waited > 2 * lease, f"the request only waited {waited:.2f}s"
        assert pair.results["remote"].tokens == expected["r"]
        assert pair.results["local"].tokens == expected["l"]
        assert not pair.kv_mismatches
        stats = connector_stats(pair.prefill)
        assert stats.get("num_kv_expired_reqs", 0) == 0
        assert stats.get("num_notifications_after_expiry", 0) == 0


@pytest.mark.timeout(120)
def test_decode_prefix_hit_inside_a_larger_prefill_block() -> None:
    """P has 32-token blocks, D 16: D's 48-token prefix hit ends halfway through P's second
    block, so D stages P's blocks from token 32 and keeps only what it lacks."""
    shared = prompt(48, 4)
    first, second = [*shared, 7], [*shared, *prompt(37, 5)]
    expected = baseline_tokens(BASE, {"f": first, "s": second}, 3)
    p, d = pd_configs(BASE, kv(), block_sizes=(32, 16))
    with DisaggregatedPair(p, d, processes=False) as pair:
        pair.submit_local("first", first, 3, expected["f"])
        pair.run_until_finished(timeout_s=30)
        report = pair.run({"second": second}, 3)
        assert report.decode_stats["prefix_hit_tokens"] >= 48
        assert report.results["second"].tokens == expected["s"]
        assert not report.kv_mismatches


@pytest.mark.timeout(120)
def test_shutdown_leaves_no_thread_or_socket() -> None:
    threads, files = {t.ident for t in threading.enumerate()}, fds()
    p, d = pd_configs(BASE, kv(), tp=(2, 1), block_sizes=(16, 32))
    with DisaggregatedPair(p, d, processes=False) as pair:
        report = pair.run({"a": prompt(50, 6), "b": prompt(9, 7)}, 3)
        assert report.all_identical
    deadline = time.monotonic() + 5
    while True:
        leaked = [t.name for t in threading.enumerate() if t.ident not in threads]
        opened = fds() - files
        if (not leaked and not opened) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked
    assert not opened, [os.readlink(f"/proc/self/fd/{fd}") for fd in opened if fd != "x"]


GROUPS = replace(BASE, kv_groups=2, sliding_window=32)
"""Two KV-cache groups (full attention, a 32-token window): P hands D one table per group."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("engine", "tamper", "loaded"),
    [
        (BASE, {"remote_block_ids": [9999, 1]}, True),  # reaches D's worker: load errors
        (BASE, {"remote_port": "x"}, False),  # malformed: D does not load, computes the prompt
        # two groups: a block outside P's in the window group's table is a load error; one
        # table, or a flat list, for two groups is malformed
        (GROUPS, {"remote_block_ids": [[0, 1], [9999, 2]]}, True),
        (GROUPS, {"remote_block_ids": [[0, 1]]}, False),
        (GROUPS, {"remote_block_ids": [0, 1]}, False),
    ],
)
def test_tampered_params_are_load_errors_or_ignored(
    engine: EngineConfig, tamper: dict[str, Any], loaded: bool
) -> None:
    text = prompt(30, 8)
    expected = baseline_tokens(engine, {"t": text}, 3)["t"]
    p, d = pd_configs(engine, {**kv(kv_lease_duration=1), "kv_load_failure_policy": "recompute"})
    with DisaggregatedPair(p, d, processes=False) as pair:
        pair.prefill.add_request("t", text, 1, {"do_remote_decode": True})
        outputs: list[Any] = []
        while not outputs:
            outputs = [o for o in pair.prefill.step()[0] if o.finished]
        params = {**outputs[0].kv_transfer_params, **tamper}
        pair.decode.add_request("t", text, 3, params)
        tokens: list[int] = []
        deadline = time.monotonic() + 30
        pending = True
        while pending:
            assert time.monotonic() < deadline
            outs, pending = pair.decode.step()
            tokens = next((o.output_token_ids for o in outs if o.finished), tokens)
            pending = pair.prefill.step()[1] or pending
        stats = pair.decode.last_stats
        assert stats["held_blocks"] == 0 and pair.prefill.last_stats["held_blocks"] == 0
        assert (stats["load_errors"] > 0) is loaded, stats
        assert not pair.decode.check_kv()
    assert tokens == expected


def nixl_worker(engine: Any) -> Any:
    """The NixlConnector worker of an in-process engine's only worker."""
    assert isinstance(engine, LocalEngine)
    connector = engine.engine.workers[0].connector
    return connector._worker  # type: ignore[union-attr]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preconnect", [True, False])
def test_preconnect_spares_the_first_request_its_handshake(preconnect: bool) -> None:
    """D given P's side channel in `preconnect` shakes hands at start-up, before any request:
    the first request reads P's KV without a handshake of its own. Without it the first
    request makes one (the counter's teeth)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p, _ = pd_configs(BASE, kv(side_channel_port=port))
    _, d = pd_configs(BASE, kv(preconnect=[f"localhost:{port}"] if preconnect else []))
    first = prompt(70, 6)
    expected = baseline_tokens(BASE, {"first": first}, 3)
    with DisaggregatedPair(p, d, processes=False) as pair:
        worker = nixl_worker(pair.decode)
        deadline = time.monotonic() + 30
        while preconnect and not worker._peers.remotes:
            assert time.monotonic() < deadline, "D did not pre-connect to P"
            time.sleep(0.05)
        report = pair.run({"first": first}, 3)
        assert report.results["first"].tokens == expected["first"]
        assert not report.kv_mismatches
        stats = connector_stats(pair.decode)
        assert stats.get("transfer_duration") == 1, stats  # P's KV was READ, not recomputed
        assert stats.get("num_handshakes", 0) == (0 if preconnect else 1), stats
        assert stats.get("num_preconnects", 0) == (1 if preconnect else 0), stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at_bind", [True, False])
def test_reads_start_when_the_metadata_is_bound(at_bind: bool) -> None:
    """With a CPU KV cache and `start_reads_at_bind`, D's worker starts the step's loads from
    `bind_connector_metadata`, before the forward pass (vLLM 0.32 calls `start_load_kv` after
    it); exactly once a step either way, and the bytes are the same."""
    p, d = pd_configs(BASE, kv(start_reads_at_bind=at_bind))
    first = prompt(70, 7)
    expected = baseline_tokens(BASE, {"first": first}, 3)
    with DisaggregatedPair(p, d, processes=False) as pair:
        assert isinstance(pair.decode, LocalEngine)
        connector = pair.decode.engine.workers[0].connector
        worker = nixl_worker(pair.decode)
        callers: list[str] = []
        start = worker.start_load_kv

        def recording(meta: Any) -> None:  # a spy: the real call follows
            callers.append(sys._getframe(1).f_code.co_name)
            start(meta)

        worker.start_load_kv = recording
        binds = 0
        bind = connector.bind_connector_metadata

        def counting(meta: Any) -> None:
            nonlocal binds
            binds += 1
            bind(meta)

        connector.bind_connector_metadata = counting  # type: ignore[method-assign]
        report = pair.run({"first": first}, 3)
        assert report.results["first"].tokens == expected["first"]
        assert not report.kv_mismatches
        want = "bind_connector_metadata" if at_bind else "start_load_kv"
        assert callers == [want] * binds, callers
        assert connector_stats(pair.decode).get("transfer_duration") == 1
