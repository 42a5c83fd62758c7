"""`s3://` through fsspec/s3fs on a real S3 server (SeaweedFS, `weed server -s3` on loopback):
the backend kit, credentials from the environment or a credentials file (never from the
config), multipart for a large value, the connector's byte-exact loads and corruption checks,
and the conformance suite. Every byte is checked."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs
from kvx_failover import request_values, run_requests
from kvx_seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedCluster, SeaweedS3

import kvx
from kvx import ConfigError, KVTransferConfig, StorageBackend
from kvx.conformance import run_suite
from kvx.conformance.runner import FAILED, PASSED
from kvx.conformance.storage_backend import StorageBackendTests
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.keys import Stage, block_keys, chain_seed, layer_set_hash, value_key

MakeRig = Callable[..., Any]
NAMESPACE = "test-ns"  # conftest's rig namespace
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedS3]:
    with SeaweedS3() as server:
        yield server


@pytest.fixture
def s3_env(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    """The server's credentials in the environment, as an operator gives them."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE", raising=False)
    return seaweed


def fresh_url(server: SeaweedS3) -> str:
    return f"s3://{server.bucket}/kv-{uuid.uuid4().hex[:12]}"


def options(server: SeaweedS3, **more: Any) -> BackendOptions:
    # a fresh s3fs instance per backend: credentials are read when it is made
    return BackendOptions(
        storage_options={**server.storage_options(), "skip_instance_cache": True, **more}
    )


class TestSeaweedS3Kit(StorageBackendTests):
    @pytest.fixture
    def backend(self, s3_env: SeaweedS3) -> Iterator[StorageBackend]:
        backend = kvx.open_storage_backend(fresh_url(s3_env), options(s3_env))
        yield backend
        backend.close()


def test_credentials_from_a_file(
    seaweed: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[default]\naws_access_key_id = {S3_ACCESS_KEY}\naws_secret_access_key = {S3_SECRET_KEY}\n"
    )
    creds.chmod(0o600)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    b = kvx.open_storage_backend(fresh_url(seaweed), options(seaweed))
    try:
        b.put_many([("k", b"from-file")])
        assert b.get_many(["k"], 100) == [b"from-file"]
    finally:
        b.close()


def test_wrong_credentials_are_refused_by_the_server(
    s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server really checks them (so the tests above prove the credentials were used)."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    b = kvx.open_storage_backend(fresh_url(s3_env), options(s3_env))
    try:
        with pytest.raises(PermissionError):
            b.put_many([("k", b"v")])
    finally:
        b.close()


def test_credentials_in_the_config_are_refused() -> None:
    for opts in (
        {"key": "AKIA", "secret": "s"},
        {"s3": {"client_kwargs": {"aws_secret_access_key": "s"}}},
    ):
        extra = {"storage_url": "s3://bucket/kv", "storage_options": opts}
        with pytest.raises(ConfigError, match=r"storage_options\..*credentials are not taken"):
            KVTransferConfig.from_dict(
                {
                    "kv_connector": "SharedStorageConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": extra,
                }
            )


def test_a_large_value_goes_up_in_parts_and_comes_back_whole(s3_env: SeaweedS3) -> None:
    url = fresh_url(s3_env)
    b = kvx.open_storage_backend(url, options(s3_env))
    try:
        value = os.urandom(40 << 20)  # 16 MiB parts: 3 of them
        b.put_vectored([("big", [value[: 1 << 20], value[1 << 20 :]])])
        out = [memoryview(bytearray(20 << 20)), memoryview(bytearray(20 << 20))]
        assert b.get_vectored(["big"], [out]) == [40 << 20]
        assert bytes(out[0]) + bytes(out[1]) == value
    finally:
        b.close()
    fs = s3fs.S3FileSystem(
        key=S3_ACCESS_KEY,
        secret=S3_SECRET_KEY,
        skip_instance_cache=True,
        **s3_env.storage_options(),  # type: ignore[arg-type]
    )
    etag = fs.info(url.removeprefix("s3://") + "/big")["ETag"]
    assert etag.strip('"').endswith("-3"), etag  # a multipart upload's ETag: <md5>-<parts>


def stored_value_path(url: str, tokens: list[int], block: int) -> str:
    key = block_keys(tokens, 16, chain_seed(NAMESPACE, 16))[block]
    stage = Stage(range(2), layer_set_hash(LAYERS))
    return url.removeprefix("s3://") + "/" + value_key(NAMESPACE, 16, key, stage, range(4))


def test_the_connector_loads_byte_exact_and_reports_a_corrupt_value(
    s3_env: SeaweedS3, make_rig: MakeRig
) -> None:
    url = fresh_url(s3_env)
    extra = {"storage_options": s3_env.storage_options()}
    tokens = [(i * 37) % 1000 for i in range(80)]
    producer = make_rig(url, extra=extra)
    stored = producer.prefill("p", tokens)
    producer.check(tokens, stored.block_ids, len(tokens))
    consumer = make_rig(url, extra=extra)
    loaded = consumer.prefill("d", tokens, compute=False)
    assert loaded.num_external == 64 and loaded.errors == [set()]
    consumer.check(tokens, loaded.block_ids, 64)
    # flip one payload byte of block 1's value on the server
    fs = s3fs.S3FileSystem(
        key=S3_ACCESS_KEY,
        secret=S3_SECRET_KEY,
        skip_instance_cache=True,
        **s3_env.storage_options(),  # type: ignore[arg-type]
    )
    path = stored_value_path(url, tokens, 1)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x40
    fs.pipe_file(path, bytes(data))
    rig = make_rig(url, extra=extra)
    run = rig.prefill("d2", tokens, compute=False)
    assert run.num_external == 64
    assert run.errors == [set(run.block_ids[1:4])]  # block 1 and every later one
    rig.check(tokens, run.block_ids[:1], 16, failed=run.block_ids[1:4])


CLAIMED = {  # tests/storage/test_engine.py's set, less the file-corruption scenario
    "idempotent_matching",
    "store_and_reuse",
    "stored_hetero_tp",
    "stored_block_size_mismatch",
    "stored_layout_conversion",
    "roles_store_reuse",
}


@pytest.mark.timeout(400)
def test_conformance_on_seaweedfs_s3(s3_env: SeaweedS3) -> None:
    results = run_suite(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {
                "storage_url": fresh_url(s3_env),
                "storage_options": s3_env.storage_options(),
            },
        },
        only=sorted(CLAIMED),
        fault_timeout_s=20,
    )
    assert not {r.name: r.message for r in results if r.outcome == FAILED}
    assert {r.name for r in results if r.outcome == PASSED} == CLAIMED


REQUESTS = 64
KEYS_PER_REQUEST = 8


@pytest.mark.timeout(300)
def test_killing_a_volume_server_then_the_leader_master_costs_no_wrong_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 3-master / 3-volume-server cluster, every volume on two servers: 64 requests, 4 at a
    time, load their 8 values each (a miss or error recomputes and saves them again); a volume
    server holding values is SIGKILLed after a few, then in a second run the raft leader
    master. Every request completes, no byte is wrong, and after both kills every request
    loads again."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    with SeaweedCluster() as cluster:
        b = kvx.open_storage_backend(fresh_url(cluster), options(cluster))
        try:
            prefix = f"fo-{os.urandom(4).hex()}"
            truth = [request_values(KEYS_PER_REQUEST, f"{prefix}/r{r}") for r in range(REQUESTS)]
            for items in truth:  # each request's KV was saved once before
                b.put_vectored(items)
            victim = "volume1"
            held = sum(f.stat().st_size for f in (cluster.dir / victim).glob("*.dat"))
            assert held > 0, "the volume server to kill holds nothing: nothing would be tested"
            volume = run_requests(
                b, truth, (OSError,), kill=lambda: cluster.kill(victim), pace_s=0.3
            )
            leader = cluster.leader()
            master = run_requests(
                b, truth, (OSError,), kill=lambda: cluster.kill(leader), pace_s=0.3
            )
            started = time.monotonic()
            new_leader = leader
            while new_leader == leader:  # a new leader is elected among the two masters left
                assert time.monotonic() - started < 60, f"no master replaced {leader} in 60s"
                time.sleep(0.5)
                with contextlib.suppress(RuntimeError):
                    new_leader = cluster.leader()
            run_requests(b, truth, (OSError,))  # recomputes whatever a kill lost
            again = run_requests(b, truth, (OSError,))
        finally:
            b.close()
    print(
        f"\nSeaweedFS 3 masters + 3 volume servers (replication 001), {REQUESTS} requests each "
        f"run:\n  {victim} killed ({held >> 10} KiB of volumes on it): {volume.line()}\n"
        f"  leader {leader} killed ({new_leader} elected): {master.line()}\n"
        f"  then {again.loaded}/{REQUESTS} loaded, wrong bytes {again.wrong_bytes}"
    )
    for run in (volume, master, again):
        assert run.wrong_bytes == 0
        assert len(run.outcomes) == REQUESTS and set(run.outcomes) <= {"loaded", "recomputed"}
    assert again.outcomes == ["loaded"] * REQUESTS


def test_kvx_store_lists_and_evicts_an_s3_store(
    s3_env: SeaweedS3, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvx store --storage-options` reaches an S3 store at its own endpoint."""
    from kvx.cli.commands import main

    url = fresh_url(s3_env)
    backend = kvx.open_storage_backend(url, options(s3_env))
    backend.put_many([("ns/b16/ab/old", b"x" * 100), ("keep", b"kept bytes")])
    flags = ["--storage-options", json.dumps(s3_env.storage_options())]
    assert main(["store", "ls", url, "--json", *flags]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["key"], r["size"], r["namespace"]) for r in rows} == {
        ("ns/b16/ab/old", 100, "ns"),
        ("keep", 10, None),
    }
    assert all(r["age_s"] is not None and r["age_s"] < 300 for r in rows)
    assert main(["store", "evict", url, "--prefix", "ns/", *flags]) == 0
    assert "removed 1 of 1 values, 100 bytes" in capsys.readouterr().err
    fresh = kvx.open_storage_backend(url, options(s3_env))
    assert fresh.get_many(["ns/b16/ab/old", "keep"], 100) == [None, b"kept bytes"]
    assert main(["store", "ls", url, "--storage-options", "[1]"]) == 2
    assert "'[1]' is not allowed: use a JSON object" in capsys.readouterr().err
    backend.close()
    fresh.close()
