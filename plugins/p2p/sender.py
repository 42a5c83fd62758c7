"""PUT_ASYNC's background sender on the NCCL plane (which delivers after each ack): one thread
per worker sends queued tensors in order; `drain` (from `wait_for_save`) waits until the queue
is empty, bounded in time, and `cancel` drops what has not started."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvx.plugins.p2p.affinity import leave_compute_cores

logger = logging.getLogger(__name__)


class AsyncSender:
    def __init__(self, send: Callable[..., None], name: str) -> None:
        self._send = send
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, *args: Any) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put(args)

    def _run(self) -> None:
        leave_compute_cores()
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._send(*item)
            except Exception as exc:  # the send itself logs and counts; never kill the thread
                logger.error("P2P background send failed: %s", exc)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """True once everything queued was sent (or failed); False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def cancel(self) -> int:
        """Drop every queued send that has not started; how many were dropped."""
        dropped, stop = 0, False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stop = True
            else:
                dropped += 1
        if stop:
            self._queue.put(None)
        with self._cond:
            self._pending -= dropped
            self._cond.notify_all()
        return dropped

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
