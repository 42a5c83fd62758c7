"""benchmarks/bench_storage.py runs end to end at a tiny size (so it cannot rot)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.mark.timeout(90)
def test_bench_storage_tiny_run(tmp_path: Path, run_bench: Callable[..., str]) -> None:
    args = ["--layers", "2", "--requests", "2", "--tokens", "32", "--heads", "2"]
    args += ["--head-size", "16", "--repeat", "1", "--dir", str(tmp_path)]
    out = run_bench("bench_storage.py", *args)
    for case in ("raw file", "safetensors per layer", "raw redis", "copy_ (memcpy)"):
        assert case in out
    targets = re.findall(r"^target (.+?) >= ([\d.]+)x (.+?): save [\d.]+x, load [\d.]+x", out, re.M)
    assert [(t[0], t[2]) for t in targets] == [
        ("kvx file://", "raw file"),
        ("kvx file://", "safetensors per layer"),
        ("kvx redis://", "raw redis"),
        ("kvx offload CPU", "copy_ (memcpy)"),
    ]
    cpu = r"^  CPU time \(medians, this process, all threads\) (.+?) vs (.+?): save [\d.]+x, load"
    assert re.findall(cpu, out, re.M) == [(t[0], t[2]) for t in targets], out
    ab = r"^A/B RESP client vs redis-py .*: save [\d.]+x wall .*, [\d.]+x CPU .*; load [\d.]+x wall"
    assert re.search(ab, out, re.M), out
    assert "kvx redis:// redis-py" in out
    assert "every loaded byte matched the saved bytes" in out
    assert list(tmp_path.iterdir()) == []  # the benchmark cleaned up after itself
