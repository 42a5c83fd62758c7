"""A failover run shared by the store tests: requests load their values from a store while a
part of it is killed; a miss or an error recomputes (re-saves) the request's values. Counts what
was loaded, recomputed and wrong: a store may lose values, never serve wrong bytes."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvx import StorageBackend

Items = list[tuple[str, list[bytes]]]


def request_values(n: int, prefix: str) -> Items:
    """n keys, each value three random buffers of uneven sizes."""
    return [
        (f"{prefix}/k{i}", [os.urandom(64), os.urandom(4096 + i), os.urandom(777)])
        for i in range(n)
    ]


@dataclass
class FailoverCounts:
    loaded: int = 0
    recomputed: int = 0
    errors: int = 0
    misses: int = 0
    wrong_bytes: int = 0
    outcomes: list[str] = field(default_factory=list)
    last_error_after_kill_s: float = 0.0
    last_failure_after_kill_s: float = 0.0  # a miss or an error: the outage as requests saw it

    def line(self) -> str:
        return (
            f"{self.loaded} loaded, {self.recomputed} recomputed ({self.misses} misses, "
            f"{self.errors} store errors, the last {self.last_error_after_kill_s:.2f}s after "
            f"the kill; the last failed request ended {self.last_failure_after_kill_s:.2f}s "
            f"after it), wrong bytes: {self.wrong_bytes}"
        )


def run_requests(
    backend: StorageBackend,
    truth: Sequence[Items],
    errors: tuple[type[BaseException], ...],
    kill: Callable[[], None] | None = None,
    kill_after: int = 8,
    workers: int = 4,
    pace_s: float = 0.0,
) -> FailoverCounts:
    """Every request loads its values (`get_vectored`); a miss or one of `errors` makes it a
    recompute that saves the values again (its own errors ignored). With `kill`, it is called
    once request `kill_after` has started, while the others run; `pace_s` spaces each worker's
    requests so the run spans an outage. Every loaded byte is compared."""
    counts = FailoverCounts()
    lock = threading.Lock()
    started = threading.Event()
    killed_at: list[float] = []

    def request(r: int) -> str:
        items = truth[r]
        out = [[memoryview(bytearray(len(p))) for p in parts] for _, parts in items]
        if r == kill_after:
            started.set()
        try:
            sizes: list[int | None] | None = backend.get_vectored([k for k, _ in items], out)
        except errors:
            sizes = None
            with lock:
                counts.errors += 1
                if killed_at:
                    counts.last_error_after_kill_s = time.monotonic() - killed_at[0]
        whole = sizes is not None and all(
            s == sum(map(len, parts)) for s, (_, parts) in zip(sizes, items, strict=True)
        )
        if whole:
            wrong = sum(
                bytes(v) != p
                for (_, parts), bufs in zip(items, out, strict=True)
                for v, p in zip(bufs, parts, strict=True)
            )
            with lock:
                counts.wrong_bytes += wrong
                counts.loaded += 1
            outcome = "loaded"
        else:
            with lock:
                counts.recomputed += 1
                counts.misses += sizes is not None
                if killed_at:
                    counts.last_failure_after_kill_s = time.monotonic() - killed_at[0]
            with contextlib.suppress(*errors):
                backend.put_vectored(items)
            outcome = "recomputed"
        time.sleep(pace_s)
        return outcome

    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(request, r) for r in range(len(truth))]
        if kill is not None:
            if not started.wait(60):
                raise RuntimeError(f"request {kill_after} did not start within 60s")
            killed_at.append(time.monotonic())
            kill()
        counts.outcomes = [f.result(timeout=300) for f in futures]
    return counts
