"""What P2pNcclConnector's scheduler side tells its workers each step (plain, msgpack-able)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvx import KVConnectorMetadata


@dataclass
class SaveSpec:
    """P: the prompt of `request_id` is complete after this step; send (PUT modes, to the
    decode instance at `decode_host:decode_port`, per worker `+ rank`) or store (GET) the
    KV of its first `num_tokens` tokens, held in `block_ids`."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    mode: str
    decode_host: str = ""
    decode_port: int = 0


@dataclass
class LoadSpec:
    """D: write tokens `start_token..start_token+num_tokens` of P's request
    `remote_request_id` into `block_ids` (starting at the block of `start_token`). `mode`
    PUT/PUT_ASYNC: the KV is pushed to this worker (a synchronous load); GET: pull it from P's
    workers at `prefill_host:prefill_port + rank` (asynchronous)."""

    request_id: str
    remote_request_id: str
    block_ids: list[int]
    start_token: int
    num_tokens: int
    mode: str
    prefill_host: str
    prefill_port: int
    remote_tp_size: int
    remote_pp_size: int
    remote_ports: list[int] = field(default_factory=list)
    """P's workers' ports by `pp_rank * tp_size + tp_rank` when P listens on ephemeral ports
    (`kv_port` 0); empty: `prefill_port + rank`."""


@dataclass
class P2pMetadata(KVConnectorMetadata):
    """`saves` (P), `loads` (D) and `discards`: request ids (P's) whose buffered KV the workers
    drop (the request ended without it being loaded)."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    discards: list[str] = field(default_factory=list)
