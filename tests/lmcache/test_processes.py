"""What one process leaves for the next: chunk keys that every process computes alike, and an
exit that prints no logging tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)

_KEYS = textwrap.dedent(
    """
    import json, sys
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.token_database import ChunkedTokenDatabase
    from kvx.plugins.lmcache.config import LMCacheConfig

    options = LMCacheConfig(chunk_size=16, **json.loads(sys.argv[1])).lmcache_options()
    db = ChunkedTokenDatabase(LMCacheEngineConfig.from_defaults(**options), None)
    print(json.dumps([int(r[2]) for r in db.process_tokens(list(range(48)), make_key=False)]))
    """
)


def _chunk_keys_in_two_processes(extra: dict[str, str]) -> tuple[list[int], list[int]]:
    """Chunk keys of the same 48 tokens, computed by two fresh processes at once."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # as a fresh shell
    cmd = [sys.executable, "-c", _KEYS, json.dumps(extra)]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    keys: list[list[int]] = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"computing LMCache chunk keys took over 240 s ({cmd[-1]})")
        assert proc.returncode == 0, err[-2000:]
        keys.append(json.loads(out.strip().splitlines()[-1]))
    return keys[0], keys[1]


def test_vllm_is_installed_beside_lmcache() -> None:
    """The case that matters: with vLLM importable, LMCache seeds its chunk keys from vLLM's."""
    import vllm  # noqa: F401


def test_two_processes_compute_the_same_chunk_keys() -> None:
    first, second = _chunk_keys_in_two_processes({})
    assert len(first) == 3
    assert first == second, "a chunk stored by one process would never be found by another"


def test_builtin_hash_differs_between_processes_which_is_why_it_is_not_the_default() -> None:
    first, second = _chunk_keys_in_two_processes({"pre_caching_hash_algorithm": "builtin"})
    assert first != second


_EXIT = textwrap.dedent(
    """
    import io, sys
    real = sys.stderr
    sys.stderr = io.StringIO()  # as under a test runner's capture: LMCache's handlers bind to it
    from kvx.plugins.lmcache import engine
    sys.stderr.close()
    sys.stderr = real
    engine._pool["left-over"] = engine._Pooled("kvx-no-such-instance", None, True)
    print("main done", flush=True)
    """
)


def test_exit_teardown_prints_no_logging_tracebacks() -> None:
    run = subprocess.run([sys.executable, "-c", _EXIT], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "main done" in run.stdout
    assert "Logging error" not in run.stderr, run.stderr[-2000:]
    assert "kvx-no-such-instance" in run.stderr  # LMCache's warning still reaches stderr
