"""benchmarks/bench_lookup.py runs end to end at a tiny size (so it cannot rot)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_lookup.py"


@pytest.mark.timeout(90)
def test_bench_lookup_tiny_run() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--requests", "4", "--repeat", "1", "--redis"],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    rows = re.findall(r"^\| (file|redis):// \| (.+?) \| [\d.]+ \(", out, re.M)
    assert rows == [
        (store, case)
        for store in ("file", "redis")
        for case in ("kvx hits", "kvx misses", "one check per value (8)")
    ], out
