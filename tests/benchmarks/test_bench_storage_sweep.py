"""benchmarks/bench_storage_sweep.py runs end to end in its quick mode (so it cannot rot)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_storage_sweep.py"


@pytest.mark.timeout(90)
def test_bench_storage_sweep_quick_run(tmp_path: Path) -> None:
    args = ["--quick", "--repeat", "1", "--no-peers", "--dir", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=80, check=False
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    ratio = r"\*\*[\d.]+\*\* \([\d.]+-[\d.]+\)"  # a median and its range
    # every row: ratios to the raw file, no ExampleConnector (no peers), the CPU tier's ratios
    rows = re.findall(
        rf"^\| (\d+L b\d+ \d+MiB \w+) \| .*{ratio}.*\| - \| {ratio} \| {ratio} \|$", out, re.M
    )
    assert rows[-2:] == ["8L b16 8MiB short", "32L b16 8MiB long"], out
