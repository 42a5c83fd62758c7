"""Mooncake Store cases, run by test_mooncake.py in a pytest process of their own whose
environment can load Mooncake (libibverbs.so.1 on LD_LIBRARY_PATH from the process start).
Real `mooncake_master`, real store clients over TCP on loopback; every byte checked."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvx_failover import request_values, run_requests
from kvx_mooncake_ha import MooncakeHA
from kvx_test_clusters import STORE_REUSE_SCENARIOS, MooncakeMaster

import kvx
from kvx import StorageBackend
from kvx.conformance import run_suite
from kvx.conformance.options import SuiteOptions
from kvx.conformance.runner import PASSED
from kvx.conformance.storage_backend import StorageBackendTests
from kvx.plugins.storage.backends.base import BackendOptions

MakeRig = Callable[..., Any]


@pytest.fixture(scope="session")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as m:
        yield m


class TestMooncakeKit(StorageBackendTests):
    @pytest.fixture
    def backend(self, master: MooncakeMaster) -> Iterator[StorageBackend]:
        backend = kvx.open_storage_backend(
            master.url + "&segment_mib=64&buffer_mib=32", BackendOptions()
        )
        yield backend
        backend.close()

    def test_readers_never_see_a_torn_value_while_threads_write(
        self, backend: StorageBackend, ns: str
    ) -> None:
        """Mooncake's upsert makes a replaced key absent for a moment (found here): readers
        see a whole value or a miss, never a torn or foreign one. kvx keys name their
        content, so a replacement is rare and a miss costs only a recompute."""
        values = [bytes([i]) * (256 << 10) for i in range(1, 6)]
        keys = [f"{ns}/k{i}" for i in range(3)]
        backend.put_many([(key, values[0]) for key in keys])
        seen: list[bytes | None] = []
        errors: list[BaseException] = []

        def write(key: str) -> None:
            try:
                for value in values[1:]:
                    backend.put_vectored([(key, [value[:1000], value[1000:]])])
            except BaseException as exc:
                errors.append(exc)

        writers = [threading.Thread(target=write, args=(key,)) for key in keys]
        for thread in writers:
            thread.start()
        while any(t.is_alive() for t in writers):
            seen.extend(backend.get_many(keys, len(values[0])))
        for thread in writers:
            thread.join()
        assert not errors, errors
        assert set(seen) <= {*values, None}, "a reader saw a torn or foreign value"
        assert backend.get_many(keys, len(values[0])) == [values[-1]] * len(keys)


def test_values_held_by_one_client_are_read_by_another(master: MooncakeMaster) -> None:
    url = master.url + "&segment_mib=64&buffer_mib=32"
    holder = kvx.open_storage_backend(url, BackendOptions())
    reader = kvx.open_storage_backend(url, BackendOptions())
    try:
        values = [(f"x/{i}", os.urandom(100_000 + i)) for i in range(16)]
        holder.put_many(values)
        assert reader.get_many([k for k, _ in values], 1 << 20) == [v for _, v in values]
        assert reader.exists_many(["x/0", "x/none"]) == [True, False]
    finally:
        reader.close()
        holder.close()


def test_the_connector_loads_byte_exact_through_mooncake(
    master: MooncakeMaster, make_rig: MakeRig
) -> None:
    url = master.url + "&segment_mib=64&buffer_mib=32"
    tokens = [(i * 37) % 1000 for i in range(80)]
    producer = make_rig(url)
    stored = producer.prefill("p", tokens)
    producer.check(tokens, stored.block_ids, len(tokens))
    consumer = make_rig(url)
    loaded = consumer.prefill("d", tokens, compute=False)
    assert loaded.num_external == 64 and loaded.errors == [set()]
    consumer.check(tokens, loaded.block_ids, 64)


def test_a_load_larger_than_the_buffer_pool_is_read_in_batches(master: MooncakeMaster) -> None:
    """`get_vectored` reads values in place in the client's buffer pool (4 MiB here): 12 MiB
    of values arrive in batches that fit it, every byte where it belongs."""
    backend = kvx.open_storage_backend(
        master.url + "&segment_mib=64&buffer_mib=4", BackendOptions()
    )
    try:
        values = [(f"pool/{i}", os.urandom((1 << 20) + i)) for i in range(12)]
        backend.put_vectored([(k, [v[:100], v[100:]]) for k, v in values])
        into = [
            [memoryview(bytearray(100)), memoryview(bytearray(len(v) - 100))] for _, v in values
        ]
        sizes = backend.get_vectored([k for k, _ in values], into)
        assert sizes == [len(v) for _, v in values]
        assert [bytes(a) + bytes(b) for a, b in into] == [v for _, v in values]
    finally:
        backend.close()


def test_a_url_without_metadata_is_refused(master: MooncakeMaster) -> None:
    with pytest.raises(kvx.ConfigError, match="has no metadata"):
        kvx.open_storage_backend(master.url.split("?")[0], BackendOptions())


def test_an_unknown_ha_backend_is_refused(master: MooncakeMaster) -> None:
    with pytest.raises(kvx.ConfigError, match="ha='zookeeper': use etcd"):
        kvx.open_storage_backend(master.url + "&ha=zookeeper", BackendOptions())


@pytest.fixture(scope="session")
def held_master() -> Iterator[MooncakeMaster]:
    """A master with one `mooncake_client` storage node holding the values."""
    with MooncakeMaster() as m:
        m.add_holder(256)
        yield m


def test_values_of_a_client_without_a_segment_outlive_it(held_master: MooncakeMaster) -> None:
    """`segment_mib=0`: the client contributes no memory, its values live in the storage
    node and are read after it closed (as P/D through the store needs)."""
    url = held_master.url + "&segment_mib=0&buffer_mib=16"
    writer = kvx.open_storage_backend(url, BackendOptions())
    values = [(f"gone/{i}", os.urandom(50_000 + i)) for i in range(8)]
    try:
        writer.put_many(values)
    finally:
        writer.close()
    reader = kvx.open_storage_backend(url, BackendOptions())
    try:
        assert reader.get_many([k for k, _ in values], 1 << 20) == [v for _, v in values]
    finally:
        reader.close()


STORE_CLAIMS = STORE_REUSE_SCENARIOS
STORE_PD = {  # tests/conformance/test_store_teeth.py's P/D-through-the-store set
    "pd_long_prompts",
    "pd_prefix_hit_on_decode",
    "pd_block_multiple",
    "clean_shutdown",
    "matrix",
}


@pytest.mark.timeout(900)
def test_conformance_on_mooncake_with_pd_through_the_store(held_master: MooncakeMaster) -> None:
    """The store-reuse scenarios, and P/D through the store with P and D in separate
    processes, the leak check and one matrix cell: the engines contribute no memory, the
    storage node holds every value (so they outlive the process that saved them)."""
    started = time.monotonic()
    results = run_suite(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {
                "storage_url": held_master.url + "&segment_mib=0&buffer_mib=16"
            },
        },
        only=sorted(STORE_CLAIMS | STORE_PD),
        options=SuiteOptions(
            fault_timeout_s=20, stall_timeout_s=10, dtypes=("float32",), block_sizes=(16,)
        ),
        on_result=lambda r: print(f"  {r.name}: {r.outcome} {r.message[:300]}", flush=True),
    )
    print(f"\nMooncake: {len(results)} scenarios in {time.monotonic() - started:.0f}s")
    assert sorted((r.name, r.outcome, r.message) for r in results) == sorted(
        (name, PASSED, "") for name in STORE_CLAIMS | STORE_PD
    )


REQUESTS = 64
KEYS_PER_REQUEST = 8


@pytest.mark.timeout(300)
def test_losing_a_storage_node_mid_run_costs_misses_never_wrong_bytes() -> None:
    """Two storage nodes, every value on both (`replicas=2`): 64 requests, 4 at a time, load
    their 8 values each (a miss or error recomputes and saves them again); one node is
    SIGKILLed after a few. Reads that pick the dead node's copy miss until the master drops
    it (its client TTL); every request completes, no byte is wrong, and then every request
    loads again from the node left."""
    with MooncakeMaster() as m:
        m.add_holder(128)
        m.add_holder(128)
        b = kvx.open_storage_backend(
            m.url + "&segment_mib=0&buffer_mib=16&replicas=2", BackendOptions()
        )
        try:
            prefix = f"fo-{os.urandom(4).hex()}"
            truth = [request_values(KEYS_PER_REQUEST, f"{prefix}/r{r}") for r in range(REQUESTS)]
            for items in truth:
                b.put_vectored(items)
            killed = time.monotonic()
            during = run_requests(b, truth, (OSError,), kill=lambda: m.kill_holder(0), pace_s=0.3)
            run_s = time.monotonic() - killed
            run_requests(b, truth, (OSError,))  # recomputes whatever the loss cost
            again = run_requests(b, truth, (OSError,))
        finally:
            b.close()
    print(
        f"\nMooncake, 2 storage nodes, replicas=2, {REQUESTS} requests, a node killed after "
        f"request 8 ({run_s:.1f}s for the run): {during.line()}; then {again.loaded}/{REQUESTS} "
        f"loaded, wrong bytes {again.wrong_bytes}"
    )
    for run in (during, again):
        assert run.wrong_bytes == 0
        assert len(run.outcomes) == REQUESTS and set(run.outcomes) <= {"loaded", "recomputed"}
    assert during.recomputed > 0, "the loss was not seen: the test did not test failover"
    assert again.outcomes == ["loaded"] * REQUESTS


@pytest.mark.timeout(300)
def test_killing_the_leading_master_mid_run_costs_an_outage_never_wrong_bytes() -> None:
    """An HA master (etcd, two masters with `-enable_ha -enable_oplog`) and one storage node:
    64 requests, 4 at a time, load their 8 values each (a miss or error recomputes and saves
    them again); the leading master is SIGKILLed after a few. The standby restores the
    objects from the op log and takes over; requests during the outage miss, none is wrong,
    all complete, and then every request loads again."""
    with MooncakeHA() as ha:
        ha.add_holder(128)
        b = kvx.open_storage_backend(ha.url + "&segment_mib=0&buffer_mib=16", BackendOptions())
        try:
            prefix = f"ha-{os.urandom(4).hex()}"
            truth = [request_values(KEYS_PER_REQUEST, f"{prefix}/r{r}") for r in range(REQUESTS)]
            for items in truth:
                b.put_vectored(items)
            assert run_requests(b, truth, (OSError,)).outcomes == ["loaded"] * REQUESTS
            old = ha.leader()
            assert old is not None
            killed = time.monotonic()
            during = run_requests(
                b, truth, (OSError,), kill=lambda: ha.kill_master(old), pace_s=0.5
            )
            run_s = time.monotonic() - killed
            new = ha.leader()
            again = run_requests(b, truth, (OSError,))
        finally:
            closing = time.monotonic()
            b.close()
            close_s = time.monotonic() - closing
    print(
        f"\nMooncake HA master, {REQUESTS} requests, the leader (master {old}) killed after "
        f"request 8 ({run_s:.1f}s for the run, master {new} leads after): {during.line()}; "
        f"then {again.loaded}/{REQUESTS} loaded, wrong bytes {again.wrong_bytes}; the "
        f"client closed in {close_s:.1f}s"
    )
    assert new is not None and new != old
    for run in (during, again):
        assert run.wrong_bytes == 0
        assert len(run.outcomes) == REQUESTS and set(run.outcomes) <= {"loaded", "recomputed"}
    assert during.recomputed > 0, "the outage was not seen: the test did not test failover"
    assert again.outcomes == ["loaded"] * REQUESTS
