"""benchmarks/bench_stats.py runs end to end with one round (so it cannot rot)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest


@pytest.mark.timeout(120)
def test_bench_stats_one_round(run_bench: Callable[..., str]) -> None:
    out = run_bench("bench_stats.py", "--rounds", "1", timeout=110)
    for case in ("file:// save + load", "offload CPU store + load"):
        paired = r": stats on [\d.]+ ms, off [\d.]+ ms, paired on/off [\d.]+ "
        paired += r"\(95% CI [\d.]+-[\d.]+\)"
        assert re.search(re.escape(case) + paired, out), out
        assert re.search(rf"{re.escape(case)}: recording calls per round .+ = \d+ us", out), out
    assert re.search(r"Per-request facts \(.+\): [\d.]+ us CPU per request", out), out


def test_bench_stats_refuses_no_rounds(run_bench: Callable[..., str]) -> None:
    with pytest.raises(AssertionError, match="--rounds: 0 is not allowed"):
        run_bench("bench_stats.py", "--rounds", "0")
