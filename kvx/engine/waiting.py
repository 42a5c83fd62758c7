"""Waiting on a connector: step until done, sleep (not spin) while nothing happens, fail fast
with a diagnosis when nothing has happened for the stall limit, and say so during long waits.

One loop for every wait of the reference engine and the conformance suite: a P/D pair, a
single engine storing or loading, a fault being handled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from kvx.engine.server import EngineError

IDLE_SLEEP_FIRST_S = 0.001
IDLE_SLEEP_MAX_S = 0.02  # an idle wait steps ~50 times a second, not thousands
PROGRESS_EVERY_S = 5.0


class EngineStall(EngineError):
    """No engine made progress for the stall limit; the message says what is stuck."""


class IdleBackoff:
    """Sleeps that double (from 1 ms up to `max_s`) while a loop makes no progress, so the
    connector's own threads get the CPU and an idle engine does not spin; `reset()` on
    progress."""

    def __init__(self, first_s: float = IDLE_SLEEP_FIRST_S, max_s: float = IDLE_SLEEP_MAX_S):
        self.first_s, self.max_s = first_s, max_s
        self._next = first_s

    def reset(self) -> None:
        self._next = self.first_s

    def sleep(self) -> None:
        time.sleep(self._next)
        self._next = min(self._next * 2, self.max_s)


def wait_until(
    done: Callable[[], bool],
    step: Callable[[], bool],
    state: Callable[[], Hashable],
    what: str,
    describe: Callable[[], str],
    *,
    timeout_s: float,
    stall_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float = PROGRESS_EVERY_S,
) -> None:
    """Call `step()` (True when it produced output) until `done()`.

    A change of `state()` (block counts, loads, ...) also counts as progress. Raises
    `EngineStall` once `stall_s` seconds pass without progress and `EngineError` after
    `timeout_s`, both with `describe()` of what is stuck and `what` was awaited. Every
    `progress_every_s` seconds of waiting, `progress` (if given) gets a line saying so.
    """
    start = last_progress = time.monotonic()
    deadline, next_note = start + timeout_s, start + progress_every_s
    last_state = state()
    backoff = IdleBackoff()
    while not done():
        if time.monotonic() > deadline:
            raise EngineError(f"not reached within {timeout_s:.0f}s: {what}; {describe()}")
        produced = step()
        now, current = time.monotonic(), state()
        if produced or current != last_state:
            last_progress, last_state = now, current
            backoff.reset()
        elif stall_s is not None and now - last_progress > stall_s:
            raise EngineStall(
                f"no progress for {stall_s:.0f}s (waiting until {what}): {describe()}"
            )
        if progress is not None and now >= next_note:
            limit = f", stall limit {stall_s:.0f}s" if stall_s is not None else ""
            progress(
                f"waiting {now - start:.0f}s until {what} (last progress "
                f"{now - last_progress:.0f}s ago{limit})"
            )
            next_note = now + progress_every_s
        if not produced:
            backoff.sleep()
