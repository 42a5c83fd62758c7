"""The engines' KV events, received for KV-aware routing (`--kv-events SERVER=ENDPOINT`).

vLLM publishes them with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": ...}'`: a ZMQ PUB socket sending `[topic, sequence number (8 bytes, big
endian), msgpack batch]`, the batch `[ts, [event, ...], data_parallel_rank]`, each event a
map tagged by `type`: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`. A kvx connector's
events (`take_events`) reach the same publisher through vLLM's scheduler.

Events are untrusted: a frame over MAX_MESSAGE_BYTES makes libzmq drop the peer, each batch is
decoded into bounded types (no pickle), and a malformed one is counted and skipped. A gap in
the sequence numbers (lost events) is counted; a sequence that starts again (the engine
restarted) drops the server's index.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Annotated

import msgspec
import zmq

from kvx.discovery import BackgroundService
from kvx.proxy.prefix_index import PrefixIndex
from kvx.wire import WireError, decode

log = logging.getLogger("kvx.proxy")

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_EVENTS_PER_BATCH = 65536
MAX_BLOCKS_PER_EVENT = 8192
MAX_BLOCK_SIZE = 4096
MAX_HASH_BYTES = 64
POLL_MS = 200
LOG_EVERY_S = 10.0

Hash = int | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]
Hashes = Annotated[list[Hash], msgspec.Meta(max_length=MAX_BLOCKS_PER_EVENT)]


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: Hashes
    parent_block_hash: Hash | None
    token_ids: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]],
        msgspec.Meta(max_length=MAX_BLOCKS_PER_EVENT * MAX_BLOCK_SIZE),
    ]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"{len(self.token_ids)} token ids for {len(self.block_hashes)} blocks of "
                f"{self.block_size}"
            )


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: Hashes


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[
        list[BlockStored | BlockRemoved | AllBlocksCleared],
        msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH),
    ]
    data_parallel_rank: int | None = None


@dataclass
class EventCounts:
    batches: int = 0
    refused: int = 0
    """Messages that were not a well-formed batch."""
    lost: int = 0
    """Batches missing in a sequence (the index may miss or keep stale blocks)."""
    restarts: int = 0


@dataclass(frozen=True)
class EventSource:
    server: str
    """The server's URL, as in --prefill / --decode."""
    endpoint: str
    """Where its engine publishes, `tcp://HOST:PORT` or `ipc://PATH`."""


class KvEventListener(BackgroundService):
    """Subscribes to each source's publisher and feeds `index`, from a daemon thread."""

    def __init__(self, sources: tuple[EventSource, ...], index: PrefixIndex) -> None:
        self.sources, self.index = sources, index
        self.counts = EventCounts()
        self._last_seq: dict[str, int] = {}
        self._last_log = 0.0
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._sockets: dict[zmq.Socket[bytes], EventSource] = {}
        for source in sources:
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.RCVHWM, 10_000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(source.endpoint)
            self._sockets[sock] = source
        self._thread = threading.Thread(target=self._run, name="kvx-proxy-kv-events", daemon=True)

    def start(self) -> KvEventListener:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for sock in self._sockets:
            sock.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(POLL_MS):
                source = self._sockets[sock]
                while not self._stop.is_set():
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(source.server, frames)

    def handle(self, server: str, frames: list[bytes]) -> None:
        """One message of `server`'s publisher."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._refuse(server, f"{len(frames)} frames; expected topic, sequence, payload")
            return
        try:
            batch = decode(frames[2], EventBatch, MAX_MESSAGE_BYTES)
        except WireError as exc:
            self._refuse(server, str(exc))
            return
        self._sequence(server, int.from_bytes(frames[1], "big", signed=True))
        self.counts.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.stored(
                    server,
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                )
            elif isinstance(event, BlockRemoved):
                self.index.removed(server, event.block_hashes)
            else:
                self.index.cleared(server)

    def _sequence(self, server: str, seq: int) -> None:
        last = self._last_seq.get(server)
        self._last_seq[server] = seq
        if last is None or seq == last + 1:
            return
        if seq <= last:
            self.counts.restarts += 1
            self.index.cleared(server)
            log.info("KV events of %s start again at %d: its index is dropped", server, seq)
        else:
            self.counts.lost += seq - last - 1

    def _refuse(self, server: str, reason: str) -> None:
        self.counts.refused += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning("KV events of %s: a message refused: %s", server, reason[:300])
