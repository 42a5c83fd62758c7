"""A --quick benchmark run is labelled "quick (not a result)" and judges no target."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_layouts.py"


@pytest.mark.timeout(120)
def test_bench_layouts_quick_run_is_labelled_and_plots_on_a_log_axis(tmp_path: Path) -> None:
    png = tmp_path / "layouts.png"
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeat", "1", "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={"COLUMNS": "200", "PATH": ""},
    )
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, out
    assert "quick (not a result): kvx.layouts transforms" in out
    assert "(want >= 1.2) - quick (not a result)" in out
    assert " met" not in out
    assert png.stat().st_size > 0
