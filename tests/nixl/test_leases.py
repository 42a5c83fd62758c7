"""P's lease bookkeeping on its own (pure logic, driven with explicit clocks)."""

from __future__ import annotations

from kvx.plugins.nixl.handshake import Notification
from kvx.plugins.nixl.leases import Leases
from kvx.plugins.nixl.stats import NixlKVConnectorStats


def leases() -> Leases:
    return Leases(10.0, NixlKVConnectorStats())


def test_freed_after_the_expected_number_of_done_notifications() -> None:
    lease = leases()
    lease.hold("r", 10.0, now=0.0)
    lease.on_notification(Notification("done", ["r"], 2), now=1.0, sender="d0")
    assert lease.take_finished() == set()
    lease.on_notification(Notification("done", ["r"], 2), now=1.1, sender="d1")
    assert lease.take_finished() == {"r"}


def test_notifications_before_the_metadata_count() -> None:
    lease = leases()
    lease.on_notification(Notification("done", ["r"], 1), now=0.0)
    lease.hold("r", 10.0, now=0.1)
    assert lease.take_finished() == {"r"}
    lease.expire(now=100.0)
    assert lease.stats.data["num_notifications_after_expiry"] == 0


def test_heartbeats_extend_and_expiry_frees_then_late_notifications_are_counted() -> None:
    lease = leases()
    lease.hold("r", 10.0, now=0.0)
    lease.on_notification(Notification("heartbeat", ["r"]), now=8.0)
    lease.expire(now=15.0)
    assert lease.take_finished() == set()
    lease.expire(now=18.5)
    assert lease.take_finished() == {"r"}
    assert lease.stats.data["num_kv_expired_reqs"] == 1
    lease.on_notification(Notification("done", ["r"], 1), now=19.0)
    assert lease.stats.data["num_notifications_after_expiry"] == 1
    assert lease.take_finished() == set()


def test_unknown_notification_is_late_after_one_lease_and_aborts_stop_tracking() -> None:
    lease = leases()
    lease.on_notification(Notification("done", ["ghost"], 1), now=0.0)
    lease.expire(now=10.5)
    assert lease.stats.data["num_notifications_after_expiry"] == 1
    lease.hold("aborted", 10.0, now=0.0)
    lease.drop("aborted")
    lease.expire(now=50.0)
    assert lease.take_finished() == set()


def test_stats_reduce_and_rebuild() -> None:
    stats = NixlKVConnectorStats()
    assert stats.is_empty()
    for ms in range(1, 11):
        stats.record_transfer(ms / 1e3, 0.0, 1 << 20, 4)
    stats.count("num_failed_handshakes")
    reduced = stats.reduce()
    assert reduced["Num successful transfers"] == 10
    assert reduced["P90 xfer time (ms)"] == 10.0
    assert reduced["Avg MB per transfer"] == 1.0
    assert reduced["Num failed transfers"] == 1
    rebuilt = NixlKVConnectorStats(stats.to_dict())
    assert rebuilt.to_dict() == stats.to_dict()
    clone = stats.clone_and_reset()
    assert stats.is_empty() and not clone.is_empty()
