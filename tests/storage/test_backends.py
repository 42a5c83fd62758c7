"""Storage backends: the backend kit on every built-in backend (local files, fsspec's remote
path on memory://, Redis), then what the kit cannot see: atomic values under slow writes,
Redis round trips, TTL, unreachable servers, clean shutdown."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

import kvx
from kvx import ConfigError, KVTransferConfig, StorageBackend
from kvx.conformance.storage_backend import StorageBackendTests
from kvx.plugins.storage import worker as storage_worker
from kvx.plugins.storage.backends import local_files
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.fsspec_backend import FsspecBackend
from kvx.plugins.storage.backends.local_files import LocalFileBackend
from kvx.plugins.storage.backends.resp import RespConnection
from kvx.plugins.storage.keys import Stage, block_keys, chain_seed, layer_set_hash, value_key

MakeRig = Callable[..., Any]  # conftest's Rig factory
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")  # the rig's layers


class TestLocalFiles(StorageBackendTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[StorageBackend]:
        backend = LocalFileBackend(f"file://{tmp_path}/kv", BackendOptions())
        yield backend
        backend.close()


class TestFsspecMemory(StorageBackendTests):  # fsspec's file objects: the remote path
    @pytest.fixture
    def backend(self) -> Iterator[StorageBackend]:
        backend = FsspecBackend(f"memory://kvx-kit-{uuid.uuid4().hex}", BackendOptions())
        yield backend
        backend.close()


class TestRedis(StorageBackendTests):
    @pytest.fixture
    def backend(self, redis_url: str) -> Iterator[StorageBackend]:
        backend = kvx.open_storage_backend(redis_url, BackendOptions())
        yield backend
        backend.close()


def watch(read: Callable[[], bytes | None], done: threading.Event) -> list[bytes | None]:
    """Read until `done` is set (and once more), returning everything seen."""
    seen = []
    while not done.is_set():
        seen.append(read())
    seen.append(read())
    return seen


class SlowFile:
    """A writable file that trickles its bytes out, so a write takes a while."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        for i in range(0, len(view), 1 << 16):
            self.f.write(view[i : i + (1 << 16)])
            self.f.flush()
            time.sleep(0.005)
        return len(view)

    def __enter__(self) -> SlowFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def _size(path: Path) -> int:
    """`path`'s size, 0 if it is gone (renamed into place since it was listed)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


@pytest.mark.timeout(30)
def test_file_reader_never_sees_a_torn_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = LocalFileBackend(f"file://{tmp_path}", BackendOptions())

    def slow_write_all(fd: int, parts: list[bytes]) -> None:  # local files skip fs.open
        with SlowFile(open(os.dup(fd), "wb")) as f:
            f.write(b"".join(parts))

    monkeypatch.setattr(local_files, "_write_all", slow_write_all)
    old, new = b"a" * (1 << 20), b"b" * (2 << 20)
    backend.put_many([("ns/k", old)])
    done = threading.Event()
    writer = threading.Thread(target=lambda: (backend.put_many([("ns/k", new)]), done.set()))
    partial: list[int] = []
    seen: list[bytes | None] = []
    writer.start()
    while not done.is_set():
        seen.append(backend.get_many(["ns/k"], 4 << 20)[0])
        partial += [size for p in (tmp_path / "ns").glob("k.tmp-*") if (size := _size(p))]
    writer.join()
    seen.append(backend.get_many(["ns/k"], 4 << 20)[0])
    assert any(0 < n < len(new) for n in partial), "the write was not observed in progress"
    assert set(seen) <= {old, new} and seen[-1] == new
    assert not list((tmp_path / "ns").glob("k.tmp-*"))


@pytest.mark.timeout(30)
def test_redis_reader_never_sees_a_torn_value(redis_url: str) -> None:
    backend = kvx.open_storage_backend(redis_url, BackendOptions())
    try:
        values = [bytes([i]) * (4 << 20) for i in range(1, 4)]
        done = threading.Event()

        def write() -> None:
            for v in values:
                backend.put_many([("ns/k", v)])
            done.set()

        writer = threading.Thread(target=write)
        writer.start()
        seen = watch(lambda: backend.get_many(["ns/k"], 8 << 20)[0], done)
        writer.join()
        assert set(seen) <= {None, *values} and seen[-1] == values[-1]
    finally:
        backend.close()


@pytest.mark.timeout(30)
def test_file_writes_survive_a_pruned_store_and_read_into_buffers(tmp_path: Path) -> None:
    backend = LocalFileBackend(f"file://{tmp_path}/kv", BackendOptions())
    backend.put_many([("ns/ab/x", b"first")])
    shutil.rmtree(tmp_path / "kv")  # someone prunes the store while the engine runs
    backend.put_many([("ns/ab/y", memoryview(b"second"))])  # the directory is made again
    bufs = [memoryview(bytearray(6)) for _ in range(3)]
    assert backend.get_into(["ns/ab/y", "ns/ab/x", "ns/ab/y"], [*bufs[:2], bufs[2][:5]]) == [
        6,
        None,
        6,  # a value of another size is reported, not read
    ]
    assert bytes(bufs[0]) == b"second" and bytes(bufs[2]) == bytes(6)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_vectored_io_takes_views_of_any_element_type(scheme: str, tmp_path: Path) -> None:
    url = f"file://{tmp_path}" if scheme == "file" else f"memory://kvx-vec-{uuid.uuid4().hex}"
    backend = (LocalFileBackend if scheme == "file" else FsspecBackend)(url, BackendOptions())
    src = torch.arange(1000, dtype=torch.float32)
    backend.put_vectored([("ns/k", [src[:300].numpy().data, src[300:].numpy().data])])
    dst = torch.zeros(1000, dtype=torch.float32)
    parts = [dst[:10].numpy().data, dst[10:].numpy().data]
    assert backend.get_vectored(["ns/k"], [parts]) == [4000]  # bytes, not elements
    assert torch.equal(dst, src)
    short = torch.zeros(999, dtype=torch.float32)
    (size,) = backend.get_vectored(["ns/k"], [[short.numpy().data]])
    assert size is not None and size > short.numel() * 4  # longer (remote: read to total + 1)
    assert not short.any()  # a value of another size leaves the buffers untouched


def test_memory_backend_is_shared_within_a_process() -> None:
    a = kvx.open_storage_backend("memory://kvx-shared-test", BackendOptions())
    b = kvx.open_storage_backend("memory://kvx-shared-test", BackendOptions())
    a.put_many([("x/y", b"value")])
    assert b.get_many(["x/y", "x/z"], 100) == [b"value", None]
    assert b.exists_many(["x/y", "x/z"]) == [True, False]


@pytest.mark.timeout(30)
def test_unreachable_redis_is_a_clear_error(make_rig: MakeRig) -> None:
    with pytest.raises(ConfigError) as info:  # a start-up failure names the key
        make_rig("redis://127.0.0.1:1/0", extra={"timeout_s": 2.0})
    message = str(info.value)
    assert "kv_connector_extra_config.storage_url: cannot open 'redis://127.0.0.1:1/0'" in message
    assert "redis-server" in message


@pytest.mark.timeout(30)
def test_ttl_is_set_on_every_value(redis_url: str, make_rig: MakeRig) -> None:
    tokens = list(range(40))
    make_rig(redis_url, extra={"redis_ttl_s": 120}).prefill("p", tokens)
    client = redis.Redis.from_url(redis_url)
    keys = client.keys("kvx/*")
    assert len(keys) == 2  # 2 full blocks x 1 stage (both layers) x 1 shard
    assert all(0 < client.ttl(k) <= 120 for k in keys)
    client.close()


@pytest.mark.timeout(30)
def test_redis_client_setting_reaches_the_backend(redis_url: str, make_rig: MakeRig) -> None:
    """`redis_client: "redis-py"` in the connector's config: values still round trip, and
    no RESP connection was pooled (a RESP save keeps one)."""
    tokens = list(range(40))
    for client, pooled in (("redis-py", 0), ("resp", 1)):
        extra = {"redis_client": client, "namespace": client}
        make_rig(redis_url, extra=extra).prefill("p", tokens)
        rig = make_rig(redis_url, extra=extra)
        run = rig.prefill("d", tokens, compute=False)
        assert run.num_external == 32 and run.errors == [set()]
        rig.check(tokens, run.block_ids, 32)
        idle = [len(worker.worker.backend._idle) for worker, _, _ in rig.workers]
        assert idle == [pooled], client


@pytest.mark.timeout(30)
@pytest.mark.parametrize("group", [None, 5])
def test_redis_does_one_round_trip_per_block_group(
    redis_url: str, make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch, group: int | None
) -> None:
    tokens = list(range(16 * 12 + 5))  # 12 full blocks
    value_bytes = 64 + 2 * 16 * 2 * 2 * 8 * 4  # header + 2 layers x [16 tokens, K|V, 2 heads, 8]
    if group is not None:  # at most `group` values per round trip
        monkeypatch.setattr(storage_worker, "GROUP_BYTES", group * value_bytes)  # writes
        monkeypatch.setattr(storage_worker, "READ_BYTES", group * value_bytes)  # reads
    groups = [12] if group is None else [5, 5, 2]
    rig = make_rig(redis_url, tp=2, num_blocks=40)
    calls: list[int] = []
    real = redis.client.Pipeline.execute

    def counted(self: redis.client.Pipeline, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(self.command_stack))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted)
    # Values go through the vectored RESP client (the scheduler's lookups through redis-py).
    for method in ("set_vectored", "get_vectored"):
        real_vectored = getattr(RespConnection, method)

        def vectored(
            self: RespConnection, first: Any, *args: Any, _real: Any = real_vectored
        ) -> Any:
            calls.append(len(first))
            return _real(self, first, *args)

        monkeypatch.setattr(RespConnection, method, vectored)
    rig.prefill("p", tokens)
    # Scheduler: block 0's values under its own partition (1 stage x 2 shards) and the first
    # value under each other one (PP 1 or 2 x 1, 2 or 4 shards), absent: nothing more asked.
    # Each rank: one pipelined batch of SETs per group of blocks, each value holding both layers.
    assert calls[0] == 2 + (2 * 3 - 1)
    assert sorted(calls[1:]) == sorted(groups * 2)
    client = redis.Redis.from_url(redis_url)
    assert len(client.keys("kvx/*")) == 12 * 2  # one value per block and head shard
    # ... which is what `kvx list` says of the backend (PP 1 here: one stage)
    summary = kvx.get_registry().storage_backend("redis").spec.summary
    assert "one value per block, PP stage and head shard under kvx/<key>" in summary
    assert {len(client.get(k) or b"") for k in client.keys("kvx/*")} == {value_bytes}
    client.close()
    calls.clear()
    reader = make_rig(redis_url, tp=2, num_blocks=40)
    calls.clear()
    run = reader.prefill("d", tokens, compute=False)
    assert run.num_external == 192
    reader.check(tokens, run.block_ids, 192)
    # Scheduler: block 0 as above, found under its own partition, then blocks 1-11 under it
    # (2 shards each). Workers: one pipelined batch of GETs per group; no stores (the partial
    # block is never stored).
    assert calls[:2] == [2 + (2 * 3 - 1), 11 * 2]
    assert sorted(calls[2:]) == sorted(groups * 2)


@pytest.mark.timeout(30)
def test_shutdown_leaves_no_threads(
    storage_url: str, make_rig: MakeRig, no_new_threads: None
) -> None:
    rig = make_rig(storage_url, tp=2)
    rig.prefill("p", list(range(50)))
    assert any(t.name.startswith("kvx-storage-io") for t in threading.enumerate())
    rig.shutdown()


@pytest.mark.timeout(30)
def test_write_failures_are_counted_not_raised(tmp_path: Path, make_rig: MakeRig) -> None:
    rig = make_rig(f"file://{tmp_path}")
    for worker, _, _ in rig.workers:
        backend = worker.worker.backend

        def fail(*args: Any) -> None:
            raise OSError("disk full")

        backend.put_many = backend.put_vectored = backend.put_blocks_hashed = fail
    rig.prefill("p", list(range(40)))
    stats = rig.workers[0][0].get_kv_connector_stats()
    assert stats is not None and stats.data["save_errors"] == 1  # one per group of blocks


def test_backends_are_registered_by_scheme() -> None:
    registry = kvx.get_registry()
    assert registry.connector("ExampleConnector").name == "SharedStorageConnector"
    for url, name in [
        ("file:///tmp/x", "file"),
        ("/tmp/x", "file"),
        ("memory://x", "fsspec"),
        ("s3://bucket/x", "fsspec"),  # not listed: fsspec's own registry knows it
        ("webdav://host/x", "fsspec"),
        ("redis://h:1/0", "redis"),
    ]:
        assert registry.storage_backend_for_url(url).name == name
    assert "s3" not in registry.storage_backends()["fsspec"].spec.schemes
    assert registry.storage_backends()["redis"].spec.requires == ("redis",)
    with pytest.raises(kvx.RegistryError, match=r"scheme 'nosuch'.*\(and those 'fsspec' knows\)"):
        registry.storage_backend_for_url("nosuch://x")


def test_value_keys_are_per_block_stage_and_shard() -> None:
    keys = block_keys(list(range(40)), 16, chain_seed("ns", 16))
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    stage = Stage(range(4, 8), layer_set_hash(["a/b.4", "a/b.5", "a/b.6", "a/b.7"]))
    assert len(stage.layer_set) == 8
    assert value_key("ns", 16, keys[0], stage, range(2, 4)) == (
        f"ns/b16/{keys[0][:2]}/{keys[0]}.l4-8.{stage.layer_set.hex()}.h2-4"
    )
    # Another model's layer names, or another split of the same layers, is another value.
    other = Stage(range(4, 8), layer_set_hash(["x.4", "x.5", "x.6", "x.7"]))
    assert value_key("ns", 16, keys[0], other, range(2, 4)) != value_key(
        "ns", 16, keys[0], stage, range(2, 4)
    )


def test_connector_config_round_trips_through_kvx_validate(tmp_path: Path) -> None:
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        }
    )
    extra = config.kv_connector_extra_config
    assert extra["storage_url"].startswith("file://") and extra["verify_checksums"] is True
    assert kvx.get_registry().resolve_connector_class(config).__name__ == "SharedStorageConnector"


@pytest.mark.timeout(60)
def test_a_backend_without_hashed_io_stores_and_loads_through_the_connector(
    make_rig: MakeRig,
) -> None:
    """`kvx.SupportsHashedIO` is optional: a backend that does not declare it (fsspec's
    memory://, its values checksummed by the connector instead) saves and loads every block
    through the connector's vectored path."""
    url = f"memory://kvx-plain-{uuid.uuid4().hex}"
    tokens = [(5 * i) % 997 for i in range(50)]
    producer = make_rig(url)
    for worker, _, _ in producer.workers:
        backend = worker.worker.backend
        assert not kvx.supports_hashed_io(backend) and not hasattr(backend, "put_blocks_hashed")
    producer.prefill("p", tokens)
    consumer = make_rig(url)
    loaded = consumer.prefill("d", tokens, compute=False)
    assert loaded.num_external == 48 and loaded.errors == [set()]
    consumer.check(tokens, loaded.block_ids, 48)
