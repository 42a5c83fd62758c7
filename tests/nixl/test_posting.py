"""D's per-request work on READs that repeats across requests is done once: which READs a
request makes and which remote regions land in which local ones (once per remote engine, one
pairing per remote worker and head count), and the `done`
notifications to P (one per poll, not per request). A step's READs are all made before the
first is posted (the copies then run back to back), and a post NIXL refuses fails only its
request. Real NIXL, real engines, one process."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kvx.engine.disagg import DisaggregatedPair, pd_configs
from kvx.engine.engine import EngineConfig
from kvx.engine.server import LocalEngine
from kvx.plugins.nixl.handshake import (
    MAX_IDS_PER_NOTIFICATION,
    AgentMetadata,
    Notification,
    open_notification,
)
from kvx.plugins.nixl.posting import DirectRead, GroupRegions, ReadJob, ReadPoster
from kvx.plugins.nixl.remote import RemoteEngine
from kvx.plugins.nixl.worker import NixlWorker

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=128)
KV = {
    "kv_connector": "NixlConnector",
    "kv_connector_extra_config": {"handshake_timeout_s": 2, "transfer_timeout_s": 5},
}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(BASE.vocab_size) for _ in range(n)]


@pytest.mark.timeout(120)
def test_region_pairing_is_worked_out_once_per_remote_worker(monkeypatch: Any) -> None:
    """P at TP 2, D at TP 1: D reads two head slices, one from each P rank. Over two
    batches of five requests the READs are planned once (not per request), the pairing runs
    once per P rank (two), and every byte is exact."""
    calls: list[tuple[int, int]] = []
    plans: list[int] = []
    pair_regions = ReadPoster._pair_regions
    direct_reads = ReadPoster._direct_reads

    def planned(self: ReadPoster, remote: RemoteEngine) -> list[DirectRead]:
        reads = direct_reads(self, remote)
        plans.append(len(reads))
        return reads

    def counted(self: ReadPoster, meta: AgentMetadata, num_heads: int) -> tuple[GroupRegions, ...]:
        calls.append((meta.tp_rank, num_heads))
        return pair_regions(self, meta, num_heads)

    monkeypatch.setattr(ReadPoster, "_pair_regions", counted)
    monkeypatch.setattr(ReadPoster, "_direct_reads", planned)
    p, d = pd_configs(BASE, KV, tp=(2, 1))
    with DisaggregatedPair(p, d, processes=False) as pair:
        first = pair.run({"a": prompt(50, 1), "b": prompt(33, 2)}, 3)
        second = pair.run({"c": prompt(70, 3), "d": prompt(17, 4), "e": prompt(40, 5)}, 3)
    assert first.all_identical and second.all_identical
    assert not first.kv_mismatches and not second.kv_mismatches
    assert sorted(calls) == [(0, 2), (1, 2)]
    assert plans == [2]  # one plan of two READs (one per P rank) for all five requests


@pytest.mark.timeout(120)
def test_reads_ending_together_are_told_to_p_in_one_notification(monkeypatch: Any) -> None:
    """Three requests loaded in one step end in D's next poll: P hears of all three in one
    `done` notification (not three), and still frees every block (no lease expires)."""
    done: list[list[str]] = []
    notify = NixlWorker._notify

    def counted(self: NixlWorker, remote: RemoteEngine, note: Notification) -> None:
        if note.kind == "done":
            done.append(list(note.request_ids))
        notify(self, remote, note)

    monkeypatch.setattr(NixlWorker, "_notify", counted)
    p, d = pd_configs(BASE, KV)
    with DisaggregatedPair(p, d, processes=False) as pair:
        pair.run({"warm": prompt(20, 6)}, 2)  # the handshake, so the next reads start at once
        done.clear()
        report = pair.run({"a": prompt(50, 7), "b": prompt(33, 8), "c": prompt(64, 9)}, 3)
        assert isinstance(pair.prefill, LocalEngine)
        stats = pair.prefill.engine.kv_stats
    assert report.all_identical and not report.kv_mismatches
    assert sorted(len(ids) for ids in done) == [3], done
    expired = sum(s.to_dict().get("num_kv_expired_reqs", 0) for s in stats)
    assert expired == 0


@pytest.fixture(scope="module")
def pair() -> Iterator[DisaggregatedPair]:
    """One in-process P/D pair (TP 1:1, policy `fail`) for the tests below, handshake done.
    P frees a failed read's blocks at lease expiry (D does not tell it), so the lease is short."""
    extra = {**KV["kv_connector_extra_config"], "kv_lease_duration": 2}
    kv = {**KV, "kv_connector_extra_config": extra, "kv_load_failure_policy": "fail"}
    p, d = pd_configs(BASE, kv)
    with DisaggregatedPair(p, d, processes=False) as handle:
        assert handle.run({"warm": prompt(20, 10)}, 2).all_identical
        yield handle


@pytest.mark.timeout(120)
def test_a_steps_reads_are_all_made_before_the_first_is_posted(
    pair: DisaggregatedPair, monkeypatch: Any
) -> None:
    """Three requests loaded in one step: D makes the three READs, then posts them, never a
    post between two makes; every byte is exact."""
    events: list[tuple[str, str]] = []
    make, post = ReadPoster.prepare_direct, ReadPoster.post

    def made(self: ReadPoster, job: ReadJob) -> None:
        make(self, job)
        events.append(("make", job.spec.request_id))

    def posted(self: ReadPoster, job: ReadJob) -> None:
        events.append(("post", job.spec.request_id))
        post(self, job)

    monkeypatch.setattr(ReadPoster, "prepare_direct", made)
    monkeypatch.setattr(ReadPoster, "post", posted)
    report = pair.run({"a": prompt(50, 11), "b": prompt(33, 12), "c": prompt(64, 13)}, 3)
    assert report.all_identical and not report.kv_mismatches
    kinds = [kind for kind, _ in events]
    assert kinds == ["make"] * 3 + ["post"] * 3, events
    assert sorted(rid for _, rid in events[:3]) == sorted(rid for _, rid in events[3:])


@pytest.mark.timeout(120)
def test_a_refused_post_fails_only_its_request(pair: DisaggregatedPair, monkeypatch: Any) -> None:
    """NIXL refuses the post of one of three READs made in the same step (a fake fault: a
    healthy peer cannot be made to refuse one post for real): that request ends in error
    (policy `fail`), the other two are loaded byte-exact, and D counts one failed transfer."""
    post = ReadPoster.post
    refused: list[str] = []

    def refusing(self: ReadPoster, job: ReadJob) -> None:
        if not refused:
            refused.append(job.spec.request_id)
            raise RuntimeError("NIXL refused to post a READ (fake fault)")
        post(self, job)

    monkeypatch.setattr(ReadPoster, "post", refusing)
    assert isinstance(pair.decode, LocalEngine)
    failed_before = _count(pair.decode, "num_failed_transfers")
    report = pair.run({"x": prompt(40, 14), "y": prompt(45, 15), "z": prompt(30, 16)}, 3)
    assert len(refused) == 1
    statuses = {rid: r.status for rid, r in report.results.items() if rid in "xyz"}
    victim = next(rid for rid in "xyz" if rid in refused[0])
    assert statuses[victim] == "finished_error", statuses
    for rid in set("xyz") - {victim}:
        assert report.results[rid].identical, report.results[rid]
    assert not report.kv_mismatches
    assert _count(pair.decode, "num_failed_transfers") == failed_before + 1


def _count(engine: LocalEngine, key: str) -> int:
    return sum(int(s.to_dict().get(key, 0)) for s in engine.engine.kv_stats)


@pytest.mark.timeout(120)
def test_a_notification_over_the_id_bound_goes_in_pieces_p_accepts(
    pair: DisaggregatedPair,
) -> None:
    """D heartbeats more request ids than one notification may carry: they go in pieces
    within the bound, so P refuses none (a piece over the bound is refused whole), and the
    pair keeps loading byte-exact."""
    assert isinstance(pair.decode, LocalEngine) and isinstance(pair.prefill, LocalEngine)
    worker = pair.decode.engine.workers[0].connector.worker
    assert isinstance(worker, NixlWorker)
    (remote,) = worker._peers.remotes.values()
    ids = [f"absent-{i}" for i in range(MAX_IDS_PER_NOTIFICATION + 5)]
    assert [
        len(open_notification(worker.secret, m).request_ids)
        for _, m in remote.sealed(Notification("heartbeat", ids), worker.secret)
    ] == [MAX_IDS_PER_NOTIFICATION, 5]
    refused_before = _count(pair.prefill, "num_refused_notifications")
    worker._notify(remote, Notification("heartbeat", ids))
    report = pair.run({"after": prompt(30, 17)}, 2)  # P polls its notifications meanwhile
    assert report.results["after"].identical and not report.kv_mismatches
    assert _count(pair.prefill, "num_refused_notifications") == refused_before
