"""Waits on a connector sleep instead of spinning, stall fast with a diagnosis, and say what
they wait for during long waits (kvx.engine.waiting)."""

from __future__ import annotations

import time

import pytest

from kvx.engine.server import EngineError
from kvx.engine.waiting import EngineStall, IdleBackoff, wait_until


def test_an_idle_wait_stalls_after_the_limit_without_spinning() -> None:
    steps = []
    start = time.monotonic()
    with pytest.raises(EngineStall, match=r"no progress for 1s \(waiting until x\): held 3"):
        wait_until(
            lambda: False,
            lambda: steps.append(1) is not None,  # never produces output
            lambda: 0,
            "x",
            lambda: "held 3",
            timeout_s=30,
            stall_s=1,
        )
    elapsed = time.monotonic() - start
    assert 1 <= elapsed < 3, elapsed
    # 1 ms doubling to 20 ms: about 55 steps in a second, not thousands (a spin did ~870).
    assert len(steps) < 120, len(steps)


def test_a_changing_state_is_progress_and_the_timeout_still_bounds_it() -> None:
    counter = iter(range(10**9))
    with pytest.raises(EngineError, match="not reached within 1s: y; busy"):
        wait_until(
            lambda: False,
            lambda: False,
            lambda: next(counter),  # changes every step: never a stall
            "y",
            lambda: "busy",
            timeout_s=1,
            stall_s=0.2,
        )


def test_long_waits_report_progress() -> None:
    lines: list[str] = []
    with pytest.raises(EngineStall):
        wait_until(
            lambda: False,
            lambda: False,
            lambda: 0,
            "the lease ran out",
            lambda: "",
            timeout_s=30,
            stall_s=1.3,
            progress=lines.append,
            progress_every_s=0.5,
        )
    assert len(lines) == 2, lines
    assert lines[0].startswith("waiting ") and "s until the lease ran out (last" in lines[0]
    assert "stall limit 1s" in lines[0], lines


def test_output_resets_the_backoff() -> None:
    backoff = IdleBackoff(first_s=0.001, max_s=0.004)
    for _ in range(4):
        backoff.sleep()
    assert backoff._next == 0.004
    backoff.reset()
    assert backoff._next == 0.001
