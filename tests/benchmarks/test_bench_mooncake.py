"""benchmarks/bench_mooncake.py runs end to end at a tiny size (so it cannot rot), in a
process that loads Mooncake's libibverbs and, where one can be made, a network namespace of
its own (tests/storage/test_mooncake.py says why)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvx_test_clusters import mooncake_env, own_network_namespace

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_mooncake.py"


@pytest.mark.timeout(200)
def test_bench_mooncake_quick_run() -> None:
    command = [sys.executable, str(BENCH), "--quick", "--rounds", "1"]
    result = subprocess.run(
        [*own_network_namespace(), *command],
        capture_output=True,
        text=True,
        timeout=190,
        env=mooncake_env(),
        check=False,
    )
    out = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, out
    assert "quick (not a result): " in out
    for variant in ("kvx mooncake", "mooncake raw", "kvx redis cluster", "kvx file"):
        for op in ("put", "get"):
            assert re.search(rf"^\| {re.escape(variant)} \| {op} \| [\d.]+ \| [\d.]+ \|", out, re.M)
    assert re.search(r"^\| kvx mooncake \| get \| .* \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
