"""P's side of a hand-off: each finished prompt's blocks are held under a lease until D's
`done` notifications arrive (as many as D ranks read this rank) or the lease expires; D's
heartbeats extend it (matches the producer side of vLLM's `NixlConnectorWorker`, in
`kv_connector/v1/nixl_connector.py`).

D's notifications are untrusted: each reader (NIXL agent) counts once per request, the number
of readers expected only ever grows (a later `count` of 1 cannot shorten a wait for 2), and
ids P does not hold yet are remembered for one lease, at most `MAX_EARLY` of them."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from kvx.plugins.nixl.handshake import Notification
from kvx.plugins.nixl.stats import NixlKVConnectorStats

logger = logging.getLogger(__name__)
EXPIRED_MEMORY = 4096
"""How many expired request ids are remembered to recognise late notifications."""
MAX_EARLY = 4096
"""How many not-yet-held request ids are remembered (the oldest is forgotten first)."""


@dataclass
class SendState:
    deadline: float
    since: float
    readers: set[str] = field(default_factory=set)
    expected: int | None = None


@dataclass
class Early:
    """`done` notifications for a request P does not hold (yet)."""

    seen: float
    expected: int
    readers: set[str] = field(default_factory=set)


class Leases:
    """Tracks the requests one P worker holds; `take_finished()` gives those to free."""

    def __init__(self, lease_s: float, stats: NixlKVConnectorStats) -> None:
        self.lease_s = lease_s
        self.stats = stats
        self._sending: dict[str, SendState] = {}
        self._early: OrderedDict[str, Early] = OrderedDict()
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._finished: set[str] = set()

    def hold(self, req_id: str, lease_s: float, now: float) -> None:
        """Start the lease of a request P's scheduler finished."""
        state = SendState(now + lease_s, now)
        self._sending[req_id] = state
        early = self._early.pop(req_id, None)
        if early is not None:  # D's reads finished before this step's metadata came
            state.expected, state.readers = early.expected, early.readers
            self._check_done(req_id, state)

    def drop(self, req_id: str) -> None:
        """P aborted the request: stop tracking it."""
        self._sending.pop(req_id, None)

    def on_notification(self, note: Notification, now: float, sender: str = "") -> None:
        """Apply one decoded notification from NIXL agent `sender`."""
        for req_id in note.request_ids:
            state = self._sending.get(req_id)
            if note.kind == "heartbeat":
                if state is not None:
                    state.deadline = max(state.deadline, now + self.lease_s)
            elif state is not None:
                state.expected = max(state.expected or 0, note.count)
                state.readers.add(sender)
                self._check_done(req_id, state)
            elif req_id in self._expired:
                self._late(req_id)
            else:  # may precede this step's metadata: kept for one lease
                early = self._early.get(req_id)
                if early is None:
                    early = self._early[req_id] = Early(now, note.count)
                    if len(self._early) > MAX_EARLY:
                        self._early.popitem(last=False)
                        self.stats.count("num_unknown_notifications_dropped")
                early.expected = max(early.expected, note.count)
                early.readers.add(sender)

    def expire(self, now: float) -> None:
        for req_id, state in list(self._sending.items()):
            if now > state.deadline:
                logger.warning("request %s: lease expired before D read it; freeing", req_id)
                del self._sending[req_id]
                self._finished.add(req_id)
                self.stats.count("num_kv_expired_reqs")
                self._expired[req_id] = None
                while len(self._expired) > EXPIRED_MEMORY:
                    self._expired.popitem(last=False)
        while self._early:
            req_id, early = next(iter(self._early.items()))
            if now - early.seen <= self.lease_s:
                break
            del self._early[req_id]
            self._late(req_id)

    @property
    def holding(self) -> bool:
        """Whether any request's blocks are held for D."""
        return bool(self._sending)

    def held(self, now: float) -> tuple[int, float]:
        """How many requests are held for D, and for how long the oldest has been (seconds)."""
        oldest = min((s.since for s in self._sending.values()), default=now)
        return len(self._sending), now - oldest

    def take_finished(self) -> set[str]:
        finished, self._finished = self._finished, set()
        return finished

    def _check_done(self, req_id: str, state: SendState) -> None:
        if state.expected is not None and len(state.readers) >= state.expected:
            del self._sending[req_id]
            self._finished.add(req_id)

    def _late(self, req_id: str) -> None:
        logger.error(
            "request %s: a read finished after P's lease expired; its KV blocks may have "
            "been reused (raise kv_lease_duration)",
            req_id,
        )
        self.stats.count("num_notifications_after_expiry")
