"""P2pNcclConnector's scheduler side: which requests P saves in a step, which D loads.

P: a request with `do_remote_decode` (or a vLLM P2P request id) is saved in the step its
prompt completes; P copies the KV out, so it never holds blocks, and `request_finished` returns
the params D needs. D: a request with `do_remote_prefill` (or a vLLM P2P request id on a
consumer) loads the prompt: synchronously in PUT modes (the KV was pushed before D saw the
request, as in vLLM's connector) and asynchronously with GET.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import kvx
from kvx import RequestStatus
from kvx.plugins.p2p.addresses import (
    AddressError,
    decode_address_of,
    format_address,
    parse_address,
    parse_legacy_request_id,
)
from kvx.plugins.p2p.config import P2pConfig
from kvx.plugins.p2p.discovery import start_announcer
from kvx.plugins.p2p.metadata import LoadSpec, P2pMetadata, SaveSpec

logger = logging.getLogger(__name__)
FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
MAX_TP = 1 << 10


@dataclass
class Source:
    """Where D's request loads from."""

    remote_request_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int
    num_tokens: int
    mode: str
    ports: list[int]


@dataclass
class Saving:
    """P: a request being prefilled for a remote decode."""

    num_prompt_tokens: int
    block_ids: list[int]
    mode: str
    decode: tuple[str, int] | None
    saved: bool = False


def load_source(
    request: kvx.Request, config: kvx.KVTransferConfig, options: P2pConfig, ctx: kvx.EngineContext
) -> Source | None:
    """D: where `request` loads from, or None (not a remote prefill, or unusable params: logged)."""
    params = request.kv_transfer_params or {}
    try:
        if params.get("do_remote_prefill"):
            host, port = parse_address(params.get("remote_address"), "remote_address", True)
            ports = _ports(params.get("remote_worker_ports", []))
            if port == 0 and not ports:
                raise ValueError("remote_address has port 0 and no remote_worker_ports")
            return Source(
                _str(params, "remote_request_id"),
                host,
                port,
                _int(params, "remote_tp_size", 1, MAX_TP),
                _int(params, "remote_pp_size", 1, MAX_TP),
                _int(params, "remote_num_tokens", 0, 1 << 31),
                _mode(params.get("send_type", options.send_type)),
                ports,
            )
        if params or not config.is_kv_consumer:
            return None
        legacy = parse_legacy_request_id(request.request_id)
    except (AddressError, ValueError) as exc:
        logger.error("request %s: cannot load its KV: %s", request.request_id, exc)
        return None
    if legacy is None:
        return None
    (host, port), _ = legacy  # vLLM's form: same id, same TP/PP on both sides
    p = ctx.parallel
    return Source(
        request.request_id,
        host,
        port,
        p.tp_size,
        p.pp_size,
        request.num_prompt_tokens,
        options.send_type,
        [],
    )


def _str(params: dict[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= 512:
        raise ValueError(f"kv_transfer_params.{key}: {value!r} is not a string of 1-512 chars")
    return value


def _int(params: dict[str, Any], key: str, low: int, high: int) -> int:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"kv_transfer_params.{key}: {value!r} is not an integer {low}-{high}")
    return value


def _ports(value: Any) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_TP
        or not all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535 for v in value
        )
    ):
        raise ValueError(
            f"kv_transfer_params.remote_worker_ports: {str(value)[:80]} is not a list of ports"
        )
    return list(value)


def _mode(value: Any) -> str:
    if value not in ("PUT", "PUT_ASYNC", "GET"):
        raise ValueError(f"kv_transfer_params.send_type: {value!r} is not PUT, PUT_ASYNC or GET")
    return str(value)


class P2pScheduler(kvx.ConnectorScheduler):
    handshake_type = kvx.WorkerAddress  # the port each worker listens on

    def __init__(self, options: P2pConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext):
        self.options, self.config, self.ctx = options, config, ctx
        self.block_size = ctx.cache.block_size
        self._saving: dict[str, Saving] = {}
        self._saves: list[SaveSpec] = []
        self._loads: list[LoadSpec] = []
        self._discards: list[str] = []
        self._loading: set[str] = set()
        self._local_hits: dict[str, int] = {}
        """D: the block-aligned local prefix hit vLLM offered with each remote prefill (where
        its load starts)."""
        self._worker_ports: dict[tuple[int, int], int] = {}
        """(pp_rank, tp_rank) -> the port each worker listens on (from its handshake)."""
        self._announcer = start_announcer(options, config)  # xPyD discovery, if configured

    def set_handshake_metadata(self, metadata: dict[tuple[int, int], kvx.WorkerAddress]) -> None:
        self._worker_ports = {ranks: address.port for ranks, address in metadata.items()}

    # -- P ----------------------------------------------------------------------------------

    def on_new_request(self, request: kvx.Request) -> None:
        if not self.config.is_kv_producer:
            return
        params = request.kv_transfer_params or {}
        try:
            legacy = parse_legacy_request_id(request.request_id)
            if not params.get("do_remote_decode") and legacy is None:
                return
            mode = self.options.send_type
            decode = None
            if mode != "GET":
                decode = decode_address_of(
                    request.request_id, params, self.options.default_decode_address
                )
                if decode is None:
                    raise AddressError(
                        f"send_type {mode} needs a decode instance: set "
                        "kv_transfer_params.decode_address, use vLLM's "
                        "'___prefill_addr_..___decode_addr_..' request id, or configure "
                        "default_decode_address"
                    )
        except AddressError as exc:
            logger.error("request %s: its KV will not be sent: %s", request.request_id, exc)
            return
        self._saving[request.request_id] = Saving(request.num_prompt_tokens, [], mode, decode)

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> P2pMetadata:
        starts = {n.req_id: n.num_computed_tokens for n in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, block_ids, full in kvx.yield_req_data(scheduler_output):
            saving = self._saving.get(req_id)
            if saving is None or saving.saved:
                continue
            if full:
                saving.block_ids = []
            if block_ids:
                saving.block_ids.extend(block_ids[0])
            done = starts[req_id] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if done >= saving.num_prompt_tokens:
                saving.saved = True
                n = saving.num_prompt_tokens
                host, port = saving.decode or ("", 0)
                blocks = saving.block_ids[: -(-n // self.block_size)]
                self._saves.append(SaveSpec(req_id, blocks, n, saving.mode, host, port))
        meta = P2pMetadata(self._saves, self._loads, self._discards)
        self._saves, self._loads, self._discards = [], [], []
        return meta

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._local_hits.pop(req_id, None)
        if req_id in self._loading:
            self._loading.discard(req_id)
        else:
            self._pending_load(request)
        saving = self._saving.pop(req_id, None)
        if saving is None:
            return False, None
        if request.status not in FINISHED_OK or not saving.saved:
            self._discards.append(req_id)
            return False, None
        p = self.ctx.parallel
        return False, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": req_id,
            "remote_address": format_address(self.config.kv_ip, self.config.kv_port),
            "remote_tp_size": p.tp_size,
            "remote_pp_size": p.pp_size,
            "remote_num_tokens": saving.num_prompt_tokens,
            "send_type": saving.mode,
            "remote_worker_ports": self._advertised_ports(),
        }

    def _advertised_ports(self) -> list[int]:
        """With `kv_port` 0 (GET only) every worker listens on a port the OS picked: D gets
        them all, by `pp_rank * tp_size + tp_rank`."""
        if self.config.kv_port != 0:
            return []
        tp = self.ctx.parallel.tp_size
        return [
            port
            for (pp, rank), port in sorted(
                self._worker_ports.items(), key=lambda kv: kv[0][0] * tp + kv[0][1]
            )
        ]

    def _pending_load(self, request: kvx.Request) -> bool:
        """D: a request that ends before its load was queued: drop what was pushed for it."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and isinstance(params.get("remote_request_id"), str):
            self._discards.append(params["remote_request_id"])
            return True
        return False

    # -- D ----------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.config.is_kv_consumer or request.request_id in self._loading:
            return 0, False
        source = load_source(request, self.config, self.options, self.ctx)
        if source is None:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        if source.mode == "GET":  # async: vLLM recomputes the last token once the load is in
            count = max(0, request.num_prompt_tokens - num_computed_tokens)
            return count, count > 0
        # A synchronous load must leave vLLM at least one prompt token to compute.
        return max(0, request.num_prompt_tokens - 1 - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        start = self._local_hits.pop(request.request_id, None)
        if num_external_tokens <= 0 or start is None or request.request_id in self._loading:
            return
        source = load_source(request, self.config, self.options, self.ctx)
        if source is None:
            return
        self._loading.add(request.request_id)
        if request.kv_transfer_params:
            request.kv_transfer_params["do_remote_prefill"] = False  # load once
        # The load starts after the local hit vLLM offered (block-aligned). Not from the count
        # of hashed blocks: a synchronous load's blocks are hashed as soon as they are
        # allocated, which would put the load's start after its own blocks.
        # Blocks before `skipped` are null (outside a sliding window): nothing is loaded there.
        table = blocks.get_block_ids()[0]
        end_token = start + num_external_tokens
        first = max(start // self.block_size, kvx.skipped_blocks(table))
        start = min(max(start, first * self.block_size), end_token)
        end = -(-end_token // self.block_size)
        self._loads.append(
            LoadSpec(
                request.request_id,
                source.remote_request_id,
                list(table[first:end]),
                start,
                end_token - start,
                source.mode,
                source.host,
                source.port,
                source.tp_size,
                source.pp_size,
                source.ports,
            )
        )

    def shutdown(self) -> None:
        if self._announcer is not None:
            self._announcer.stop()
