"""The Redis backend on real 3 masters + 3 replicas clusters (Redis and Valkey): discovery from
any node, slot routing of every call including the RESP fast path, MOVED/ASK during a real
slot migration, a master killed while requests run, and the conformance suite. Every byte is
checked."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from kvx_test_clusters import STORE_REUSE_SCENARIOS, ClusterProcesses

import kvx
from kvx import ConfigError, StorageBackend
from kvx.conformance import run_suite
from kvx.conformance.runner import FAILED, PASSED
from kvx.conformance.storage_backend import StorageBackendTests
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.redis_backend import KEY_PREFIX, RedisBackend
from kvx.plugins.storage.backends.resp import RespConnection, RespReplyError


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ClusterProcesses]:
    with ClusterProcesses("redis") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[ClusterProcesses]:
    with ClusterProcesses("valkey") as cluster:
        yield cluster


@pytest.fixture(params=["redis", "valkey"])
def cluster(request: pytest.FixtureRequest) -> ClusterProcesses:
    return request.getfixturevalue(f"{request.param}_cluster")  # type: ignore[no-any-return]


def replica_url(cluster: ClusterProcesses) -> str:
    """A URL naming the last node (a replica): discovery must find the masters."""
    scheme = cluster.url.partition("://")[0]
    return f"{scheme}://127.0.0.1:{cluster.ports[-1]}"


class TestRedisClusterKit(StorageBackendTests):
    @pytest.fixture
    def backend(self, redis_cluster: ClusterProcesses) -> Iterator[StorageBackend]:
        backend = kvx.open_storage_backend(replica_url(redis_cluster), BackendOptions())
        yield backend
        backend.close()


class TestValkeyClusterKit(StorageBackendTests):
    @pytest.fixture
    def backend(self, valkey_cluster: ClusterProcesses) -> Iterator[StorageBackend]:
        backend = kvx.open_storage_backend(replica_url(valkey_cluster), BackendOptions())
        yield backend
        backend.close()


def values(n: int, prefix: str) -> list[tuple[str, list[bytes]]]:
    """n keys, each value three random buffers of uneven sizes."""
    return [
        (f"{prefix}/k{i}", [os.urandom(64), os.urandom(4096 + i), os.urandom(777)])
        for i in range(n)
    ]


def empty_like(items: list[tuple[str, list[bytes]]]) -> list[list[memoryview]]:
    return [[memoryview(bytearray(len(p))) for p in parts] for _, parts in items]


def masters(cluster: ClusterProcesses) -> list[int]:
    ports = []
    for port in cluster.live_ports():
        client = redis.Redis(port=port)
        if client.execute_command("ROLE")[0] in (b"master", "master"):
            ports.append(port)
        client.close()
    return ports


def test_one_node_url_reaches_every_master_through_the_fast_path(
    cluster: ClusterProcesses,
) -> None:
    b = RedisBackend(replica_url(cluster), BackendOptions())
    try:
        assert b._resp and b._routes is not None
        items = values(120, f"spread-{os.urandom(4).hex()}")
        b.put_vectored(items)
        per_master = {}
        for port in masters(cluster):
            client = redis.Redis(port=port)
            mine = [
                k
                for k, _ in items
                if client.execute_command("CLUSTER KEYSLOT", KEY_PREFIX + k) in owned_slots(client)
            ]
            per_master[port] = len(mine)
            client.close()
        assert len(per_master) == 3 and all(n > 10 for n in per_master.values()), per_master
        out = empty_like(items)
        assert b.get_vectored([k for k, _ in items], out) == [sum(map(len, p)) for _, p in items]
        for (_, parts), bufs in zip(items, out, strict=True):
            assert [bytes(v) for v in bufs] == parts
        # the plain calls (redis-py's cluster pipeline) see the same values
        keys = [k for k, _ in items[:20]] + ["absent/key"]
        assert b.get_many(keys, 1 << 20) == [b"".join(p) for _, p in items[:20]] + [None]
        assert b.exists_many(keys) == [True] * 20 + [False]
        # one RESP connection per master was pooled: the fast path went to each directly
        assert len({c.address for c in b._idle}) == 3
    finally:
        b.close()


def owned_slots(client: redis.Redis) -> set[int]:
    me = client.execute_command("CLUSTER MYID")
    me = me.decode() if isinstance(me, bytes) else me
    slots: set[int] = set()
    for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
        node_id = master[2].decode() if isinstance(master[2], bytes) else master[2]
        if node_id == me:
            slots.update(range(start, end + 1))
    return slots


def node_id(port: int) -> str:
    client = redis.Redis(port=port, decode_responses=True)
    try:
        return str(client.execute_command("CLUSTER MYID"))
    finally:
        client.close()


def test_moved_and_ask_during_a_real_slot_migration_are_followed(
    cluster: ClusterProcesses,
) -> None:
    """Slot S moves from its master to another one while the backend holds the old map: ASK
    while the slot migrates, MOVED after; every value still comes back byte-exact."""
    tag = f"mig-{os.urandom(4).hex()}"
    old_key, new_key, late_key = f"{{{tag}}}/old", f"{{{tag}}}/new", f"{{{tag}}}/late"
    slot = redis.crc.key_slot((KEY_PREFIX + old_key).encode())
    src = cluster.master_of(KEY_PREFIX + old_key)
    dst = next(p for p in masters(cluster) if p != src)
    b = RedisBackend(replica_url(cluster), BackendOptions())
    s, d = redis.Redis(port=src), redis.Redis(port=dst)
    try:
        old = [os.urandom(3000), os.urandom(5)]
        b.put_vectored([(old_key, old)])
        d.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", node_id(src))
        s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", node_id(dst))
        # migrating: a new key is written on the target (src answers ASK), the old one read
        new = [os.urandom(2000)]
        b.put_vectored([(new_key, new)])
        assert d.execute_command("ASKING") and d.get(KEY_PREFIX + new_key) == new[0]
        out = empty_like([(old_key, old), (new_key, new)])
        assert b.get_vectored([old_key, new_key], out) == [3005, 2000]
        assert [bytes(v) for v in out[0]] == old and bytes(out[1][0]) == new[0]
        # migrated: the old key moves, the slot is the target's; the backend's map is stale
        s.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", KEY_PREFIX + old_key)
        for port in masters(cluster):
            c = redis.Redis(port=port)
            c.execute_command("CLUSTER SETSLOT", slot, "NODE", node_id(dst))
            c.close()
        late = [os.urandom(100), os.urandom(100)]
        b.put_vectored([(late_key, late)])  # MOVED, then written on the target
        assert d.get(KEY_PREFIX + late_key) == b"".join(late)
        out = empty_like([(old_key, old), (new_key, new), (late_key, late)])
        assert b.get_vectored([old_key, new_key, late_key], out) == [3005, 2000, 200]
        assert [bytes(v) for v in out[0]] == old and bytes(out[1][0]) == new[0]
        assert [bytes(v) for v in out[2]] == late
        # the map followed the move: the next call goes to the target directly
        assert b._by_node([KEY_PREFIX + old_key]) == {("127.0.0.1", dst): [0]}
    finally:
        # give the slot back, so later tests see the cluster as created
        for key in (old_key, new_key, late_key):
            d.delete(KEY_PREFIX + key)
        for port in masters(cluster):
            c = redis.Redis(port=port)
            c.execute_command("CLUSTER SETSLOT", slot, "NODE", node_id(src))
            c.close()
        s.close()
        d.close()
        b.close()


def test_a_single_node_client_on_a_cluster_would_fail(redis_cluster: ClusterProcesses) -> None:
    """Why routing is needed: the RESP client sending every key to one node gets MOVED."""
    port = masters(redis_cluster)[0]
    conn = RespConnection("127.0.0.1", port)
    items = values(30, f"one-{os.urandom(4).hex()}")
    with pytest.raises(RespReplyError, match="MOVED") as exc:
        conn.set_vectored([(KEY_PREFIX + k, [memoryview(p) for p in v]) for k, v in items], None)
    assert 0 < len(exc.value.failed) < 30
    conn.close()


def test_a_cluster_has_only_database_zero(redis_cluster: ClusterProcesses) -> None:
    with pytest.raises(ConfigError, match="only database 0"):
        kvx.open_storage_backend(f"redis://127.0.0.1:{redis_cluster.ports[0]}/3", BackendOptions())


REQUESTS = 64
KEYS_PER_REQUEST = 8


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flavour", ["redis", "valkey"])
def test_killing_a_master_mid_run_costs_misses_never_wrong_bytes(flavour: str) -> None:
    """64 requests, 4 at a time, each loading its 8 values (spread over the masters) and on a
    miss or error recomputing and saving them; a master is SIGKILLed after a few. Every
    request completes, every loaded byte is right, and the replica takes over."""
    with ClusterProcesses(flavour) as cluster:
        b = RedisBackend(replica_url(cluster), BackendOptions(timeout_s=2.0))
        prefix = f"fo-{os.urandom(4).hex()}"
        truth = {r: values(KEYS_PER_REQUEST, f"{prefix}/r{r}") for r in range(REQUESTS)}
        for r in range(REQUESTS):  # each request's KV was saved once before
            b.put_vectored(truth[r])
        victim = cluster.master_of(KEY_PREFIX + truth[0][0][0])
        counts = {"loaded": 0, "recomputed": 0, "errors": 0, "wrong_bytes": 0}
        lock = threading.Lock()
        failed_at: list[float] = []
        recovered_at: list[float] = []
        started = threading.Event()

        def request(r: int) -> str:
            items = truth[r]
            out = empty_like(items)
            if r == 8:
                started.set()
            try:
                sizes = b.get_vectored([k for k, _ in items], out)
            except (ConnectionError, TimeoutError, redis.RedisError, RespReplyError):
                sizes = None
                with lock:
                    counts["errors"] += 1
                    failed_at.append(time.monotonic())
            if sizes is not None and all(s == sum(map(len, p)) for s, (_, p) in zip(sizes, items)):
                wrong = sum(
                    bytes(v) != p
                    for (_, parts), bufs in zip(items, out)
                    for v, p in zip(bufs, parts)
                )
                with lock:
                    counts["wrong_bytes"] += wrong
                    counts["loaded"] += 1
                    if failed_at:
                        recovered_at.append(time.monotonic())
                return "loaded"
            with lock:
                counts["recomputed"] += 1
            # recompute = the values are known; save them again (may fail too)
            with contextlib.suppress(
                ConnectionError, TimeoutError, redis.RedisError, RespReplyError
            ):
                b.put_vectored(items)
            return "recomputed"

        def run_all() -> list[str]:
            with ThreadPoolExecutor(4) as pool:
                return list(pool.map(request, range(REQUESTS)))

        def slow_request(r: int) -> str:
            out = request(r)
            time.sleep(0.3)  # so the run spans the outage (~3-4 s)
            return out

        try:
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(slow_request, r) for r in range(REQUESTS)]
                started.wait(30)
                killed = time.monotonic()
                cluster.kill(victim)
                outcomes = [f.result(timeout=120) for f in futures]
            during = dict(counts)
            # afterwards: the replica serves the victim's slots, every request loads again
            promoted = (
                time.monotonic()
                - killed
                + cluster.wait_failover(KEY_PREFIX + truth[0][0][0], victim)
            )
            run_all()  # recomputes (and saves) any value the killed master had not replicated
            again = run_all()
        finally:
            b.close()
        outage = (max(failed_at) - killed) if failed_at else 0.0
        print(
            f"\n{flavour}: {REQUESTS} requests, a master killed after request 8: "
            f"{during['loaded']} loaded, {during['recomputed']} recomputed "
            f"({during['errors']} store errors, the last {outage:.2f}s after the kill); "
            f"replica promoted {promoted:.1f}s after the kill; then {again.count('loaded')}/"
            f"{REQUESTS} loaded; wrong bytes in all: {counts['wrong_bytes']}"
        )
        assert counts["wrong_bytes"] == 0
        assert len(outcomes) == REQUESTS and set(outcomes) <= {"loaded", "recomputed"}
        assert counts["errors"] > 0, "the kill was not seen: the test did not test failover"
        assert again == ["loaded"] * REQUESTS


CLAIMED = STORE_REUSE_SCENARIOS


@pytest.mark.timeout(400)
def test_conformance_on_redis_and_valkey_clusters(
    redis_cluster: ClusterProcesses, valkey_cluster: ClusterProcesses
) -> None:
    for cluster in (redis_cluster, valkey_cluster):
        results = run_suite(
            {
                "kv_connector": "SharedStorageConnector",
                "kv_connector_extra_config": {"storage_url": replica_url(cluster)},
            },
            only=sorted(CLAIMED),
            fault_timeout_s=20,
        )
        assert not {r.name: r.message for r in results if r.outcome == FAILED}, cluster.flavour
        assert {r.name for r in results if r.outcome == PASSED} == CLAIMED, cluster.flavour
