"""benchmarks/bench_lookup.py runs end to end at a tiny size (so it cannot rot)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest


@pytest.mark.timeout(90)
def test_bench_lookup_tiny_run(run_bench: Callable[..., str]) -> None:
    out = run_bench("bench_lookup.py", "--requests", "4", "--repeat", "1", "--redis")
    rows = re.findall(r"^\| (file|redis):// \| (.+?) \| [\d.]+ \(", out, re.M)
    assert rows == [
        (store, case)
        for store in ("file", "redis")
        for case in ("kvx hits", "kvx misses", "one check per value (8)")
    ], out
