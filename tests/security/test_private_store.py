"""Stored KV is private by default: value files 0600, directories 0700, the default store in the
user's own directory; `permissions: "group"` opens them to the group only."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

import kvx
from kvx.plugins.storage.backends.base import BackendOptions
from kvx.plugins.storage.backends.local_files import LocalFileBackend
from kvx.plugins.storage.config import DEFAULT_STORAGE_URL, FILE_MODES
from kvx.storage.userdirs import make_private_dirs, user_cache_dir
from kvx_example_connector.config import ExamplePDConfig


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    ("permissions", "file_mode", "dir_mode"), [("owner", 0o600, 0o700), ("group", 0o640, 0o750)]
)
def test_stored_files_and_directories_are_private(
    tmp_path: Path, permissions: str, file_mode: int, dir_mode: int
) -> None:
    old = os.umask(0o022)
    try:
        root = tmp_path / "store" / "deeper"
        backend = LocalFileBackend(
            f"file://{root}", BackendOptions(file_mode=FILE_MODES[permissions])
        )
        backend.put_many([("ns/ab/value", b"v" * 100)])
        assert kvx.supports_hashed_io(backend)  # the connector writes blocks with it here
        region = memoryview(bytearray(4096))
        backend.put_blocks_hashed(["ns/cd/block"], [b"seed"], b"P" * 8, [(region, 0, 64, 64)], [3])
    finally:
        os.umask(old)
    for value in (root / "ns/ab/value", root / "ns/cd/block"):
        assert mode(value) == file_mode, oct(mode(value))
    for directory in (tmp_path / "store", root, root / "ns", root / "ns/ab", root / "ns/cd"):
        assert mode(directory) == dir_mode, (directory, oct(mode(directory)))


def test_default_stores_are_per_user_not_in_shared_tmp() -> None:
    shared = tempfile.gettempdir()
    assert "file://" + user_cache_dir("kv") == DEFAULT_STORAGE_URL
    assert not DEFAULT_STORAGE_URL.removeprefix("file://").startswith(shared + "/kvx-kv")
    assert ExamplePDConfig().directory == user_cache_dir("example-handoff")
    assert "/tmp/kvx-example-handoff" not in ExamplePDConfig().directory


def test_without_a_home_the_fallback_must_be_ours_and_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "no-such-home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fallback = tmp_path / f"kvx-{os.getuid()}"
    assert user_cache_dir("kv") == str(fallback / "kv")
    make_private_dirs(str(fallback / "kv"))
    assert mode(fallback) == 0o700
    fallback.chmod(0o777)  # as if someone else had planted it open
    with pytest.raises(PermissionError, match="closed to others"):
        make_private_dirs(str(fallback / "kv"))
