"""Keeps a producer's NIXL agent making progress while its engine does not poll.

D's READs from P complete only when P's UCX worker is progressed (measured: with an idle P the
bytes land but the READ stays `PROC` forever, over `cma` and over TCP alike; over TCP even the
connection set-up waits for P). The connector polls on every engine step, so an engine that
stops stepping (an idle offline engine, a long prefill forward pass, an engine that only steps
for its own requests) would stall every read of blocks it holds until D gives up.

`IdleProgress` is a thread that, while this worker holds blocks for D and the engine has not
polled for `idle_after_s`, polls the agent itself (`get_new_notifs`, which progresses UCX) and
keeps the notifications for the engine's next poll. While the engine steps it does nothing, and
while nothing is held it sleeps on an event, so it costs nothing on the hot path. NIXL's own
progress thread busy-spins (its delay is fixed at 0 by the Python API) and halved throughput on
few cores; see docs/connectors/nixl.md for the measurements.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)
MAX_BUFFERED_NOTIFS = 65536
"""Notifications kept for an engine that does not poll; more are dropped and counted."""


class IdleProgress:
    """The agent and every worker call that uses it share `lock`; the thread only ever takes
    it without blocking, so it never delays the engine by more than one poll."""

    def __init__(
        self,
        agent: Any,
        lock: threading.Lock,
        *,
        interval_s: float = 0.001,
        idle_after_s: float = 0.002,
    ) -> None:
        self._agent = agent
        self._lock = lock
        self._interval_s = interval_s
        self._idle_after_s = idle_after_s
        self._buffered: dict[str, list[bytes]] = {}
        self._count = 0
        self.dropped = 0
        self.polls = 0
        self._last_engine_poll = time.monotonic()
        self._wanted = threading.Event()
        self._holding = False
        self._until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvx-nixl-progress", daemon=True)
        self._thread.start()

    def set_wanted(self, holding: bool, until: float = 0.0) -> None:
        """Poll while this worker holds blocks D may read, and until monotonic time `until`
        (a notification just sent completes only while its agent progresses: UCX sets up a
        new connection in several round trips); sleep otherwise."""
        self._holding, self._until = holding, until
        wanted = holding or until > time.monotonic()
        if wanted != self._wanted.is_set():  # called every engine step: wake nobody needlessly
            if wanted:
                self._wanted.set()
            else:
                self._wanted.clear()

    def take_notifs(self) -> dict[str, list[bytes]]:
        """The engine's poll (caller holds the lock): what the thread kept, then what is new."""
        self._last_engine_poll = time.monotonic()
        notifs, self._buffered, self._count = self._buffered, {}, 0
        for sender, messages in self._agent.get_new_notifs().items():
            notifs.setdefault(sender, []).extend(messages)
        return notifs

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; it is a daemon and polls for at most one NIXL call, so the join is
        short. If it does not end in `timeout_s` it is left behind with a warning, never
        waited on."""
        self._stop.set()
        self._wanted.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the NIXL progress thread did not stop within %.1fs", timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._wanted.wait(timeout=1.0):
                continue
            if self._stop.wait(self._interval_s):
                return
            if time.monotonic() - self._last_engine_poll < self._idle_after_s:
                continue
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self._stop.is_set():
                    return
                self._poll()
                if not self._holding and time.monotonic() > self._until:
                    self._wanted.clear()
            except Exception as exc:  # the agent is shutting down or broken: stop quietly
                logger.warning("NIXL progress thread stopped: %s", exc)
                return
            finally:
                self._lock.release()

    def _poll(self) -> None:
        self.polls += 1
        for sender, messages in self._agent.get_new_notifs().items():
            room = MAX_BUFFERED_NOTIFS - self._count
            if len(messages) > room:
                self.dropped += len(messages) - room
                messages = messages[:room]
            if messages:
                self._buffered.setdefault(sender, []).extend(messages)
                self._count += len(messages)
