"""Running a benchmark script end to end, as a user would."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def run_bench() -> Callable[..., str]:
    """`run_bench(script, *args, timeout=80)`: run `benchmarks/<script>` with this Python and
    return its stdout and stderr; it must exit 0."""

    def run(script: str, *args: str, timeout: float = 80) -> str:
        result = subprocess.run(
            [sys.executable, str(BENCHMARKS / script), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        out = result.stdout + result.stderr
        assert result.returncode == 0, out
        return out

    return run
