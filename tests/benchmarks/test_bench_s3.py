"""benchmarks/bench_s3.py runs end to end at a tiny size (so it cannot rot)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest


@pytest.mark.timeout(120)
def test_bench_s3_quick_run(run_bench: Callable[..., str]) -> None:
    out = run_bench("bench_s3.py", "--quick", "--rounds", "1", timeout=110)
    assert "quick (not a result): " in out
    for variant in ("kvx s3://", "s3fs"):
        for op in ("put", "get"):
            assert re.search(rf"^\| {re.escape(variant)} \| {op} \| [\d.]+ \| [\d.]+ \|", out, re.M)
    assert re.search(r"^\| kvx s3:// \| get \| .* \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
