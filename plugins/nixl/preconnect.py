"""D's handshakes made before any request (`preconnect`): the P engines listed in the config are
fetched, checked and connected in a background thread at start-up, so a request's first READ
from them pays no side-channel round trip, agent load or UCX wire-up (~140 ms on the first
request otherwise, measured through `vllm serve`).

P's engine id and TP/PP size are not known in advance: they are read from P's worker (0, 0)
payload, then every worker this rank needs is fetched and checked exactly as a request's
handshake does (`remote.fetch_remote`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvx.plugins.nixl.handshake import AgentMetadata, HandshakeError, compatibility_hash
from kvx.plugins.nixl.metadata import RemoteRead
from kvx.plugins.nixl.remote import LocalView, RankKey, fetch_remote
from kvx.plugins.nixl.side_channel import fetch_payload
from kvx.wire import WireError, decode

logger = logging.getLogger(__name__)

RETRY_S = 1.0
"""Seconds between attempts while P is not answering yet (it may start after D)."""
WINDOW_S = 300.0
"""How long D keeps trying one address; after that the first request handshakes as usual."""

Fetched = tuple[RemoteRead, dict[RankKey, AgentMetadata]]


def fetch_address(
    local: LocalView,
    host: str,
    port: int,
    *,
    timeout_s: float,
    max_bytes: int,
    secret: str | None,
    enforce_compat: bool,
) -> Fetched:
    """Learn P's engine id and TP/PP size from its worker (0, 0), then fetch and check every
    worker this rank reads from or notifies. Raises `HandshakeError`."""
    reply = fetch_payload(host, port, 0, 0, timeout_s=timeout_s, max_bytes=max_bytes, secret=secret)
    if reply.compatibility_hash != compatibility_hash(local.factors) and enforce_compat:
        raise HandshakeError(f"{host}:{port}: compatibility hash mismatch (see the request log)")
    try:
        first = decode(reply.agent_metadata_bytes, AgentMetadata, max_bytes=max_bytes)
    except WireError as exc:
        raise HandshakeError(f"{host}:{port}: agent metadata: {exc}") from None
    spec = RemoteRead(
        request_id="",
        local_block_ids=[],
        remote_engine_id=first.engine_id,
        remote_request_id="",
        remote_block_ids=[],
        remote_num_tokens=0,
        remote_host=host,
        remote_port=port,
        remote_tp_size=first.tp_size,
        remote_pp_size=first.pp_size,
    )
    metas = fetch_remote(
        local,
        spec,
        timeout_s=timeout_s,
        max_bytes=max_bytes,
        secret=secret,
        enforce_compat=enforce_compat,
    )
    return spec, metas


class Preconnector:
    """A thread that fetches each address (retrying while P is not up, for `WINDOW_S`) and
    hands the result to `connect` (which adds the agents under the worker's lock)."""

    def __init__(
        self,
        addresses: list[tuple[str, int]],
        fetch: Callable[[str, int], Fetched],
        connect: Callable[[Fetched], None],
    ) -> None:
        self._addresses, self._fetch, self._connect = addresses, fetch, connect
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvx-nixl-preconnect", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for host, port in self._addresses:
            last: Exception | None = None
            for _ in range(int(WINDOW_S / RETRY_S)):
                if self._stop.is_set():
                    return
                try:
                    fetched = self._fetch(host, port)
                except HandshakeError as exc:
                    last = exc
                    self._stop.wait(RETRY_S)
                    continue
                try:
                    self._connect(fetched)
                except Exception as exc:  # an untrusted peer: the request path tries again
                    logger.warning("pre-connecting to %s:%d failed: %s", host, port, exc)
                break
            else:
                logger.warning("pre-connecting to %s:%d gave up: %s", host, port, last)

    def close(self) -> None:
        """Stop (a fetch in progress ends within its timeout) and wait for the thread."""
        self._stop.set()
        self._thread.join()
