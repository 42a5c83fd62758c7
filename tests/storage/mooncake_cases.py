"""Mooncake Store cases, run by test_mooncake.py in a pytest process of their own whose
environment can load Mooncake (libibverbs.so.1 on LD_LIBRARY_PATH from the process start).
Real `mooncake_master`, real store clients over TCP on loopback; every byte checked."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvx_test_clusters import MooncakeMaster

import kvx
from kvx import StorageBackend
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


def test_a_url_without_metadata_is_refused(master: MooncakeMaster) -> None:
    with pytest.raises(kvx.ConfigError, match="has no metadata"):
        kvx.open_storage_backend(master.url.split("?")[0], BackendOptions())
