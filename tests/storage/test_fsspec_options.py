"""fsspec's `storage_options` and `::` URL chaining pass through the shared-storage connector,
and a Redis password read from a file reaches a real password-protected redis-server."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kvx_test_services import RedisProcess

from kvx import StorageBackendOptions
from kvx.cli.commands import main
from kvx.plugins.storage.backends.fsspec_backend import FsspecBackend
from kvx.plugins.storage.keys import block_keys, chain_seed

from .conftest import NAMESPACE

MakeRig = Callable[..., Any]


def prompt(n: int) -> list[int]:
    return [(i * 7919 + 13) % 1000 for i in range(n)]


def cache_options(cache: Path) -> dict[str, Any]:
    return {"simplecache": {"cache_storage": str(cache)}}


def test_backend_opens_a_chain_with_its_options(tmp_path: Path) -> None:
    backend = FsspecBackend(
        f"simplecache::file://{tmp_path}/kv",
        StorageBackendOptions(storage_options=cache_options(tmp_path / "cache")),
    )
    try:
        value = bytes(range(256)) * 3
        backend.put_many([("a/b", value)])
        assert (tmp_path / "kv" / "a" / "b").read_bytes() == value  # written through
        assert backend.get_many(["a/b", "a/c"], len(value)) == [value, None]
        assert backend.exists_many(["a/b", "a/c"]) == [True, False]
        assert any((tmp_path / "cache").iterdir())  # read through fsspec's cache, as chained
    finally:
        backend.close()


@pytest.mark.timeout(60)
def test_connector_stores_and_loads_through_a_chain(tmp_path: Path, make_rig: MakeRig) -> None:
    url = f"simplecache::file://{tmp_path}/kv"
    extra = {"storage_options": cache_options(tmp_path / "cache")}
    tokens = prompt(40)
    producer = make_rig(url, extra=extra)
    stored = producer.prefill("p", tokens)
    producer.check(tokens, stored.block_ids, len(tokens))
    keys = block_keys(tokens, 16, chain_seed(NAMESPACE, 16))[:2]
    assert [s.keys for s in stored.metas[0].stores] == [keys]
    assert len([p for p in (tmp_path / "kv").rglob("*") if p.is_file()]) >= 2  # the real files
    consumer = make_rig(url, extra=extra)
    loaded = consumer.prefill("d", tokens, compute=False)
    assert loaded.num_external == 32 and loaded.errors == [set()]
    consumer.check(tokens, loaded.block_ids, 32)


def validate(
    capsys: pytest.CaptureFixture[str], extra: dict[str, Any], *flags: str
) -> tuple[int, str]:
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    code = main(["validate", *flags, "--kv-transfer-config", json.dumps(config)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"storage_url": "memory://kv", "storage_options": ["x"]},
            'storage_options: expected an object of any value, got ["x"] (array)',
        ),
        (
            {"storage_url": "simplecachx::memory://kv"},
            "storage_url: 'simplecachx::memory://kv': protocol 'simplecachx' is not known to "
            "fsspec (did you mean 'simplecache'?)",
        ),
        (
            {"storage_url": "simplecache::redis://127.0.0.1:6379/0"},
            "storage_url: 'simplecache::redis://127.0.0.1:6379/0': only fsspec URLs can be "
            "chained with '::'",
        ),
        (
            {"storage_url": "redis://127.0.0.1:6379/0", "storage_options": {}},
            "storage_options: fsspec's options; a redis:// storage_url takes none",
        ),
    ],
)
def test_bad_options_and_chains_name_the_key(
    capsys: pytest.CaptureFixture[str], extra: dict[str, Any], message: str
) -> None:
    code, err = validate(capsys, extra)
    assert code == 2
    assert f"kv_connector_extra_config.{message}" in err, err


def test_a_protocol_without_its_package_gets_the_install_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # gcsfs is in no kvx extra (s3fs is: the S3 tests run against a real server)
    assert importlib.util.find_spec("gcsfs") is None, "this test needs gcsfs to be absent"
    extra = {
        "storage_url": "simplecache::gcs://bucket/kv",
        "storage_options": {"gcs": {"token": "anon"}},
    }
    code, err = validate(capsys, extra)
    assert code == 0, err  # gcsfs may be installed where the config runs
    assert "note: kv_connector_extra_config.storage_url: needs a package to run:" in err
    assert "gcsfs" in err
    code, err = validate(capsys, extra, "--check")
    assert code == 2
    assert "kv_connector_extra_config.storage_url: cannot open" in err and "gcsfs" in err


@pytest.mark.timeout(60)
def test_redis_password_from_a_file_reaches_the_server(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    password = "kvx-test-redis-password"
    server = RedisProcess(password)
    try:
        path = tmp_path / "redis-password"
        path.write_text(password + "\n")
        path.chmod(0o600)
        url = server.url
        code, err = validate(
            capsys, {"storage_url": url, "redis_password": {"file": str(path)}}, "--check"
        )
        assert code == 0, err
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-password")
        wrong.chmod(0o600)
        code, err = validate(
            capsys, {"storage_url": url, "redis_password": {"file": str(wrong)}}, "--check"
        )
        assert code == 2
        assert "kv_connector_extra_config.storage_url: cannot open" in err
        assert "refused the credentials" in err and "not-the-password" not in err
    finally:
        server.kill()
