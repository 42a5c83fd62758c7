"""NixlConnector's scheduler side: the P/D request lifecycle and P's side channel.

P: `request_finished` keeps a finished prompt's blocks and returns the params D needs to read
them; workers free them after D's notifications or at lease expiry. D: a request with
`do_remote_prefill` loads its prompt asynchronously; `update_state_after_alloc` queues the read
once. Matches vLLM's `NixlConnectorScheduler` (`kv_connector/v1/nixl_connector.py`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kvx
from kvx import AgentPayload, RequestStatus
from kvx.plugins.nixl.config import (
    MIN_SECRET_LENGTH,
    SECRET_KEY,
    NixlConfig,
    check_groups_supported,
    side_channel_address,
)
from kvx.plugins.nixl.handshake import (
    compatibility_factors,
    compatibility_hash,
)
from kvx.plugins.nixl.integrity import NixlWorkerMeta
from kvx.plugins.nixl.metadata import Heartbeat, NixlMetadata, RemoteRead
from kvx.plugins.nixl.remote import MAX_REMOTE_BLOCKS
from kvx.plugins.nixl.side_channel import SideChannelServer

logger = logging.getLogger(__name__)
FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
REQUIRED_PARAMS = {
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_block_ids": list,
    "remote_host": str,
    "remote_port": int,
    "tp_size": int,
}


def malformed_params(params: dict[str, Any], groups: int = 1) -> str | None:
    """Why `kv_transfer_params` cannot drive a read into an engine of `groups` KV-cache groups
    (its `remote_block_ids` then one list per group), or None when they can."""
    for key, kind in REQUIRED_PARAMS.items():
        value = params.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{key}={value!r} (expected {kind.__name__})"
    tables = params["remote_block_ids"]
    if groups == 1:
        tables = [tables]
    elif len(tables) != groups or not all(isinstance(t, list) for t in tables):
        return (
            f"remote_block_ids must be {groups} lists of block ids (one per KV-cache group), "
            f"got {len(tables)} entries"
        )
    for table in tables:
        if len(table) > MAX_REMOTE_BLOCKS:
            return f"remote_block_ids: {len(table)} blocks, at most {MAX_REMOTE_BLOCKS}"
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in table):
            return "remote_block_ids must be a list of ints" + (" per group" if groups > 1 else "")
    return None


class NixlScheduler(kvx.ConnectorScheduler):
    handshake_type = AgentPayload  # each worker's encoded AgentMetadata

    def __init__(self, options: NixlConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext):
        self.options = options
        self.secret = kvx.resolve_secret(
            options.shared_secret, SECRET_KEY, min_length=MIN_SECRET_LENGTH
        )
        self.address = side_channel_address(options)
        self.config = config
        self.ctx = ctx
        self.engine_id = str(config.engine_id)
        self.block_size = ctx.cache.block_size
        self.groups = ctx.cache.num_groups
        check_groups_supported(options, self.groups)
        self._server: SideChannelServer | None = None
        self._recv: list[RemoteRead] = []
        self._send: dict[str, float] = {}
        self._send_blocks: dict[str, list[int]] = {}
        self._not_processed: list[str] = []
        self._push = options.transfer_mode == "push"
        self._push_blocks: dict[str, list[int]] = {}
        self._queued: dict[str, RemoteRead] = {}  # D: waiting for blocks, not yet reading
        self._next_heartbeat = 0.0

    # -- side channel ---------------------------------------------------------------------

    def set_handshake_metadata(self, metadata: dict[tuple[int, int], AgentPayload]) -> None:
        """Start serving every worker's payload (once; in pull mode producers only, as only P
        is read from; in push mode consumers too, as P fetches D's to write into it)."""
        if self._server is not None or not (self.config.is_kv_producer or self._push):
            return
        payloads = {rank: meta.payload for rank, meta in metadata.items()}
        factors = compatibility_factors(self.ctx, self.options.transfer_mode)
        self._server = SideChannelServer(
            self.address.host,
            self.address.port,
            compatibility_hash(factors),
            factors,
            payloads,
            self.secret,
        )

    # -- D side ---------------------------------------------------------------------------

    def on_new_request(self, request: kvx.Request) -> None:
        """Remember a remote-prefill request so P's lease is extended while it waits here."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and malformed_params(params, self.groups) is None:
            self._queued[request.request_id] = self._read(request, params, [])

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        problem = malformed_params(params, self.groups)
        if problem is not None:
            logger.warning("request %s: bad kv_transfer_params, %s", request.request_id, problem)
            return 0, False
        count = max(0, request.num_prompt_tokens - num_computed_tokens)
        return count, count > 0

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # read once, even if called again
        self._queued.pop(request.request_id, None)
        if malformed_params(params, self.groups) is not None:
            return
        hashed = blocks.num_hashed_blocks or (0,) * len(blocks.block_ids)
        local = (
            [list(table[n:]) for table, n in zip(blocks.block_ids, hashed, strict=True)]
            if num_external_tokens > 0
            else []
        )
        self._recv.append(self._read(request, params, local))

    def _read(
        self, request: kvx.Request, params: dict[str, Any], local: list[list[int]]
    ) -> RemoteRead:
        """The read of P's blocks into `local` (per group the blocks D lacks; empty: free)."""
        remote = params["remote_block_ids"]
        hybrid = self.groups > 1
        tables = hybrid and bool(local)  # a free-only notice reads nothing
        return RemoteRead(
            request_id=request.request_id,
            local_block_ids=[b for table in local for b in table],
            local_groups=local if tables else [],
            remote_groups=[list(t) for t in remote] if tables else [],
            remote_engine_id=params["remote_engine_id"],
            remote_request_id=params["remote_request_id"],
            remote_block_ids=list(remote[0] if hybrid else remote),
            remote_num_tokens=int(params.get("remote_num_tokens", request.num_prompt_tokens)),
            remote_host=params["remote_host"],
            remote_port=params["remote_port"],
            remote_tp_size=params["tp_size"],
            remote_pp_size=int(params.get("pp_size", 1)),
        )

    # -- both -----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> NixlMetadata:
        meta = NixlMetadata(
            self._recv, self._send, self._not_processed, self._heartbeats(), self._send_blocks
        )
        self._recv, self._send, self._not_processed, self._send_blocks = [], {}, [], {}
        if self._push:
            meta.push_blocks, self._push_blocks = self._push_blocks, {}
            if self._server is not None:
                meta.side_channel = (self._server.host, self._server.port)
        return meta

    def update_connector_output(self, output: kvx.KVConnectorOutput) -> None:
        """P: serve the block digests the workers made of this step's hand-offs."""
        meta = output.kv_connector_worker_meta
        if isinstance(meta, NixlWorkerMeta) and self._server is not None:
            self._server.digests.put(meta.digests)

    def _heartbeats(self) -> list[Heartbeat]:
        """Every lease/6 seconds, the queued requests grouped by remote engine (vLLM's
        heartbeats, which keep P's lease alive while D has no room to read yet)."""
        now = time.monotonic()
        if not self._queued or now < self._next_heartbeat:
            return []
        self._next_heartbeat = now + self.options.kv_lease_duration / 6
        beats: dict[tuple[str, str, int, int, int], Heartbeat] = {}
        for r in self._queued.values():
            key = (
                r.remote_engine_id,
                r.remote_host,
                r.remote_port,
                r.remote_tp_size,
                r.remote_pp_size,
            )
            beat = beats.setdefault(key, Heartbeat(*key, []))
            beat.remote_request_ids.append(r.remote_request_id)
        return list(beats.values())

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.groups != 1:
            raise ValueError(
                f"request_finished got one block table; this engine has {self.groups} "
                "KV-cache groups (request_finished_all_groups gives one per group)"
            )
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: kvx.Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P keeps every group's prompt blocks (a sliding group's leading `NULL_BLOCK`s
        included: D reads none of them) until D's reads end or the lease runs out."""
        if len(block_ids) != self.groups:
            raise ValueError(
                f"block_ids: {len(block_ids)} tables for {self.groups} KV-cache groups"
            )
        params = request.kv_transfer_params or {}
        self._queued.pop(request.request_id, None)
        if params.get("do_remote_prefill"):
            # D aborted before the read was queued: tell P to free (vLLM 4.4) without reading.
            params["do_remote_prefill"] = False
            if malformed_params(params, self.groups) is None:
                self._recv.append(self._read(request, params, []))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in FINISHED_OK:
            self._not_processed.append(request.request_id)
            return False, None
        count = -(-request.num_prompt_tokens // self.block_size)
        tables = [list(table[:count]) for table in block_ids]
        prompt_blocks = tables[0]
        if not prompt_blocks or self._server is None:
            return False, None
        self._send[request.request_id] = self.options.kv_lease_duration
        if self.options.verify_transfers:
            self._send_blocks[request.request_id] = prompt_blocks
        if self._push:
            self._push_blocks[request.request_id] = prompt_blocks
        parallel = self.ctx.parallel
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": tables if self.groups > 1 else prompt_blocks,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self._server.host,
            "remote_port": self._server.port,
            "remote_num_tokens": request.num_prompt_tokens,
            "tp_size": parallel.tp_size,
            "pp_size": parallel.pp_size,
        }

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
