"""`kvx store ls|info|evict` against values a real SharedStorageConnector saved, in real local
files, fsspec memory and a real Redis server: what it lists, what it reports, what it removes
(and, byte for byte, what it leaves)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvx
from kvx.cli.commands import main
from kvx.plugins.storage.keys import block_keys, chain_seed

from .test_connector import NAMESPACE, VALUE, prompt

pytestmark = pytest.mark.timeout(60)

MakeRig = Callable[..., Any]
VALUE_BYTES = 64 + 2 * 2 * 16 * 4 * 8 * 4  # header + 2 layers x K/V x 16 tokens x 4 heads x 8
KEEP = ("keep/me", b"not KV, must survive every eviction")


def kvx_store(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["store", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def listed(capsys: pytest.CaptureFixture[str], url: str) -> dict[str, dict[str, Any]]:
    code, out, err = kvx_store(capsys, "ls", url, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    return {row["key"]: row for row in rows}


def saved_keys(tokens: list[int]) -> list[str]:
    return [
        f"{NAMESPACE}/b16/{key[:2]}/{key}.{VALUE}"
        for key in block_keys(tokens, 16, chain_seed(NAMESPACE, 16))[:3]
    ]


def backend(url: str) -> kvx.StorageBackend:
    return kvx.open_storage_backend(url, kvx.StorageBackendOptions())


def test_ls_info_evict_values_the_connector_saved(
    storage_url: str, make_rig: MakeRig, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = prompt(50)
    store = backend(storage_url)
    store.put_many([KEEP])
    make_rig(storage_url).prefill("p", tokens)
    expected = saved_keys(tokens)

    rows = listed(capsys, storage_url)
    assert sorted(rows) == sorted([*expected, KEEP[0]])
    for key in expected:
        row = rows[key]
        assert (row["size"], row["namespace"], row["block_size"]) == (VALUE_BYTES, NAMESPACE, 16)
        knows_age = not storage_url.startswith("redis")
        assert (row["age_s"] is not None) == knows_age and (row["age_s"] or 0) < 60
    assert rows[KEEP[0]]["namespace"] is None and rows[KEEP[0]]["size"] == len(KEEP[1])

    code, out, err = kvx_store(capsys, "info", storage_url, expected[0])
    assert code == 0, err
    fields = dict(line.split(":", 1) for line in out.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    assert fields["dtype"] == "float32" and fields["block_size"] == "16 tokens"
    assert fields["heads"] == "0-4 of 4" and fields["layers"] == "0-2 of 2"
    assert fields["order"] == "kthd" and fields["checksum"].startswith("ok ("), out

    code, out, err = kvx_store(
        capsys, "evict", storage_url, "--prefix", f"{NAMESPACE}/", "--dry-run"
    )
    assert code == 0 and sorted(line.split()[2] for line in out.splitlines()) == sorted(expected)
    assert "would remove 3 values" in err
    assert sorted(listed(capsys, storage_url)) == sorted([*expected, KEEP[0]])

    code, out, err = kvx_store(capsys, "evict", storage_url, "--prefix", f"{NAMESPACE}/")
    assert code == 0 and f"removed 3 of 3 values, {3 * VALUE_BYTES} bytes" in err, err
    assert sorted(listed(capsys, storage_url)) == [KEEP[0]]
    assert store.get_many([KEEP[0]], 1000) == [KEEP[1]]
    assert make_rig(storage_url).prefill("d", tokens, compute=False).num_external == 0
    store.close()


def test_info_reports_a_corrupt_value(
    tmp_path: Path, make_rig: MakeRig, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}/kv"
    tokens = prompt(20, seed=3)
    make_rig(url).prefill("p", tokens)
    (key,) = saved_keys(tokens)[:1]
    path = tmp_path / "kv" / key
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    code, out, _ = kvx_store(capsys, "info", url, key)
    assert code == 0 and "checksum:     MISMATCH" in out, out
    code, _, err = kvx_store(capsys, "info", url, "test-ns/b16/00/absent")
    assert code == 2 and "'test-ns/b16/00/absent' is not stored" in err


def test_evict_older_than_removes_only_old_files(
    tmp_path: Path, make_rig: MakeRig, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}/kv"
    old_tokens, tokens = prompt(20, seed=5), prompt(50, seed=4)
    rig = make_rig(url)
    rig.prefill("old", old_tokens)  # its own segment file: one batch shares one file (links)
    rig.prefill("new", tokens)
    (old,), new = saved_keys(old_tokens)[:1], saved_keys(tokens)
    three_hours_ago = time.time() - 3 * 3600
    os.utime(tmp_path / "kv" / old, (three_hours_ago, three_hours_ago))
    before = {key: (tmp_path / "kv" / key).read_bytes() for key in new}

    code, out, err = kvx_store(capsys, "ls", url)
    assert code == 0 and "4 values" in err
    ages = {line.split()[-1]: line.split()[1] for line in out.splitlines()[1:]}
    assert ages[old] == "3h" and {ages[k] for k in new} == {"0s"}, out

    code, out, err = kvx_store(capsys, "evict", url, "--older-than", "2h")
    assert code == 0 and out.split() == ["remove", old, f"({VALUE_BYTES}", "bytes)"], out
    assert sorted(listed(capsys, url)) == sorted(new)
    assert {key: (tmp_path / "kv" / key).read_bytes() for key in new} == before


def test_redis_has_no_ages_to_evict_by(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = backend(redis_url)
    store.put_many([KEEP])
    code, _, err = kvx_store(capsys, "evict", redis_url, "--older-than", "1h")
    assert code == 2 and "does not record when values were written" in err, err
    assert store.get_many([KEEP[0]], 1000) == [KEEP[1]]
    store.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("ls", "file:///nonexistent-kvx-store"), "URL 'file:///nonexistent-kvx-store': no store"),
        (("ls", "bogus://x"), "URL 'bogus://x': no storage backend for URL scheme 'bogus'"),
        (("ls", "redis://u:hunter2@127.0.0.1:{port}/0"), "cannot reach the Redis server"),
        (("evict", "file:///tmp"), "evict needs a filter"),
        (("evict", "file:///tmp", "--older-than", "3x"), "'3x' is not allowed"),
        (("info", "file:///tmp"), "the following arguments are required: KEY"),
    ],
)
def test_bad_input_exits_2_naming_it(
    args: tuple[str, ...], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = tuple(a.format(port=_free_port()) for a in args)
    code, _, err = kvx_store(capsys, *args)
    assert code == 2 and needle in err, err
    assert "hunter2" not in err and "Traceback" not in err
    assert not Path("/nonexistent-kvx-store").exists()


def test_a_backend_that_cannot_list_is_refused(
    plugin_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the test plugin's third-party backend implements the four plain calls only
    code, _, err = kvx_store(capsys, "ls", "testmem://somewhere")
    assert code == 2 and "URL 'testmem://somewhere': this store" in err, err
    assert "cannot list keys" in err and "kvx.SupportsListing" in err


DOC = Path(__file__).resolve().parents[2] / "docs" / "connectors" / "shared-storage.md"


def test_the_docs_commands_run_as_written(tmp_path: Path, make_rig: MakeRig) -> None:
    text = DOC.read_text()
    block = text.split("<!-- kvx: store -->\n```bash\n", 1)[1].split("```", 1)[0]
    store = tmp_path / "kvx-kv"
    url = f"file://{store}"
    make_rig(url).prefill("p", prompt(50, seed=6))
    script = "set -euo pipefail\n" + block.replace("/tmp/kvx-kv", str(store))  # its own store
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=50, env=env, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checksum:     ok (" in result.stdout and "would remove 0 values" in result.stderr
    assert "3 values" in result.stderr and "Traceback" not in result.stderr
