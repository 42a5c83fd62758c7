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
    saved = tmp_path / "rows.json"
    args = ["--quick", "--repeat", "1", "--no-peers", "--dir", str(tmp_path), "--json", str(saved)]
    out = run(*args)
    ratio = r"\*\*[\d.]+\*\* \([\d.]+-[\d.]+\)"  # a median and its range
    # every row: ratios to the raw file, no ExampleConnector (no peers), the CPU tier's ratios
    row = rf"^\| (\d+L b\d+ \d+MiB \w+) \| .*{ratio}.*\| - \| {ratio} \| {ratio} \|$"
    assert re.findall(row, out, re.M)[-2:] == ["8L b16 8MiB short", "32L b16 8MiB long"], out
    # each shape's kvx cases ran in a process of their own, whose peak RSS is reported
    rss = re.findall(r"^\| (\d+L b\d+ 8MiB \w+) \| 8 \| (\d+) \| - \| - \|$", out, re.M)
    assert [label for label, _ in rss] == ["8L b16 8MiB short", "32L b16 8MiB long"], out
    assert all(100 < int(mib) < 2000 for _, mib in rss), out
    # the saved rows report again, merged, without measuring
    merged = run("--from-json", str(saved), "--from-json", str(saved))
    assert re.findall(row, merged, re.M) == ["8L b16 8MiB short", "32L b16 8MiB long"] * 2, merged


def test_bench_storage_sweep_refuses_a_bad_shape() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--shape", "32,16,256,medium"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--shape: '32,16,256,medium'" in result.stderr and "short or long" in result.stderr


def run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=80, check=False
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    return out
