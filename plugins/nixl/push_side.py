"""Push mode inside one NIXL worker: its P role (`push_writer.py`) and its D role
(`push_receiver.py`; a kv_both engine has both), and the routing of push messages to them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvx.plugins.nixl.config import NixlConfig
from kvx.plugins.nixl.handshake import Notification
from kvx.plugins.nixl.integrity import PartDigests
from kvx.plugins.nixl.leases import Leases
from kvx.plugins.nixl.metadata import NixlMetadata, RemoteRead
from kvx.plugins.nixl.posting import ReadPoster
from kvx.plugins.nixl.push_receiver import PushReceiver
from kvx.plugins.nixl.push_wire import Heartbeat, Pushed, Register, Release, open_push
from kvx.plugins.nixl.push_writer import PushWriter
from kvx.plugins.nixl.remote import LocalView, RemoteEngine
from kvx.plugins.nixl.stats import NixlKVConnectorStats
from kvx.wire import WireError

logger = logging.getLogger(__name__)
SETTLE_S = 2.0
"""How long the agent keeps progressing after a notification was sent."""


class PushSide:
    def __init__(
        self,
        agent: Any,
        options: NixlConfig,
        secret: str | None,
        poster: ReadPoster,
        view: LocalView,
        leases: Leases,
        stats: NixlKVConnectorStats,
        roles: tuple[bool, bool],
        identity: tuple[str, int, int, int, int],
        complete: Callable[[RemoteRead], None],
        fail: Callable[[RemoteRead, list[int]], None],
        tables: list[Any] | None,
    ) -> None:
        """`roles`: (producer, consumer); `identity`: engine id, pp rank, tp rank, pp size,
        tp size of this worker; `complete` / `fail` end a D request as a finished read does;
        `tables` (`verify_transfers`): this worker's cache block by block, which D checks
        against P's digests."""
        o = options
        self.secret, self.leases, self.stats = secret, leases, stats
        self.writer = (
            PushWriter(
                agent,
                poster,
                view,
                leases,
                stats,
                secret=secret,
                handshake_timeout_s=o.handshake_timeout_s,
                transfer_timeout_s=o.transfer_timeout_s,
                max_handshake_bytes=o.max_handshake_bytes,
                enforce_compat=o.enforce_handshake_compat,
            )
            if roles[0]
            else None
        )
        self.receiver = (
            PushReceiver(
                agent,
                identity,
                stats,
                secret=secret,
                lease_s=o.kv_lease_duration,
                transfer_timeout_s=o.transfer_timeout_s,
                complete=complete,
                fail=fail,
                tables=tables,
            )
            if roles[1]
            else None
        )

    def wants_progress(self) -> tuple[bool, float]:
        """Whether this worker waits on a peer (D for WRITEs, P for writes it posted), and
        until when its agent must progress for the notifications it sent to go out."""
        sent = max(
            self.writer.last_sent if self.writer is not None else 0.0,
            self.receiver.last_sent if self.receiver is not None else 0.0,
        )
        waiting = (self.writer is not None and self.writer.busy) or (
            self.receiver is not None and self.receiver.busy
        )
        return waiting, sent + SETTLE_S

    def hold(self, meta: NixlMetadata, digests: dict[str, PartDigests]) -> None:
        """A step's metadata: P's handed-off blocks (and with `verify_transfers` their
        digests), D's side-channel address."""
        if self.writer is not None:
            self.writer.hold(meta.push_blocks, digests)
        if self.receiver is not None and meta.side_channel is not None:
            self.receiver.side_channel = meta.side_channel

    def start(self, spec: RemoteRead, remote: RemoteEngine, block_size: int) -> None:
        """D: the handshake with P is done; register the request's blocks."""
        if self.receiver is None:
            raise RuntimeError(f"request {spec.request_id}: a producer-only engine loads nothing")
        self.receiver.start(spec, remote, block_size)

    def heartbeat(self, remote: RemoteEngine, request_ids: list[str]) -> None:
        if self.receiver is not None:
            self.receiver.heartbeat(remote, request_ids)

    def poll(self, now: float) -> None:
        if self.writer is not None:
            self.writer.poll(now)
        if self.receiver is not None:
            self.receiver.poll(now)

    def forget(self, freed: set[str]) -> None:
        if self.writer is not None:
            self.writer.forget(freed)

    def on_message(self, data: bytes, sender: str, now: float) -> None:
        """Route one notification (in push mode every one is a push message)."""
        try:
            message = open_push(self.secret, data)
        except WireError as exc:
            logger.warning("ignoring a push message from %s: %s", sender, exc)
            self.stats.count("num_refused_notifications")
            return
        if isinstance(message, Pushed) and self.receiver is not None:
            self.receiver.on_pushed(message, sender)
        elif isinstance(message, Register) and self.writer is not None:
            self.writer.on_register(message, sender, now)
        elif isinstance(message, Heartbeat):
            self.leases.on_notification(Notification("heartbeat", message.request_ids), now)
        elif isinstance(message, Release):
            note = Notification("done", message.request_ids, message.count)
            self.leases.on_notification(note, now, sender)
        else:
            logger.warning("ignoring a %s from %s: not this engine's role", message, sender)
            self.stats.count("num_refused_notifications")

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.shutdown()
