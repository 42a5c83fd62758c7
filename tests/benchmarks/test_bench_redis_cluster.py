"""benchmarks/bench_redis_cluster.py runs end to end at a tiny size (so it cannot rot)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest


@pytest.mark.timeout(120)
def test_bench_redis_cluster_quick_run(run_bench: Callable[..., str]) -> None:
    out = run_bench("bench_redis_cluster.py", "--quick", "--rounds", "1", timeout=110)
    assert "quick (not a result): " in out
    for variant in ("kvx cluster", "kvx cluster, one tag", "redis-py cluster", "kvx node"):
        for op in ("put", "get"):
            assert re.search(rf"^\| {re.escape(variant)} \| {op} \| [\d.]+ \| [\d.]+ \|", out, re.M)
    assert re.search(r"^\| kvx cluster \| get \| .* \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
