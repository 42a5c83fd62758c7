"""What NixlConnector's scheduler side tells its workers each step (plain, msgpack-able)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvx import KVConnectorMetadata


@dataclass
class RemoteRead:
    """D: read `remote_block_ids` (a `remote_num_tokens`-long prompt) of P's request into
    `local_block_ids` (the trailing blocks the prompt needs beyond D's own prefix hit; empty:
    only tell P it may free).

    An engine with several KV-cache groups (vLLM's hybrid allocator) reads each group's layers
    from P's table of that group into its own: `local_groups` / `remote_groups` hold one table
    per group, `local_block_ids` is then every group's local blocks and `remote_block_ids`
    group 0's P table."""

    request_id: str
    local_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[int]
    remote_num_tokens: int
    remote_host: str
    remote_port: int
    remote_tp_size: int
    remote_pp_size: int
    local_groups: list[list[int]] = field(default_factory=list)
    remote_groups: list[list[int]] = field(default_factory=list)

    def tables(self) -> list[tuple[list[int], list[int]]]:
        """(local blocks, P's blocks) per KV-cache group."""
        if not self.local_groups:
            return [(self.local_block_ids, self.remote_block_ids)]
        return list(zip(self.local_groups, self.remote_groups, strict=True))

    @property
    def frees_only(self) -> bool:
        """Nothing to read (D aborted the request before its blocks were allocated): only tell
        P to free. The engine is not waiting on this request, so it is never reported received
        (vLLM frees such a request at once and asserts on a later report)."""
        return not self.local_block_ids


@dataclass
class Heartbeat:
    """D: requests of one remote engine still queued on D; P should keep their blocks."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    remote_pp_size: int
    remote_request_ids: list[str]


@dataclass
class NixlMetadata(KVConnectorMetadata):
    """`reqs_to_recv` and `heartbeats` (D), `reqs_to_send` (P: request id -> lease seconds),
    `send_blocks` (P, with `verify_transfers`: the blocks of each to digest) and
    `reqs_not_processed` (P: aborted requests workers must stop tracking). Push mode:
    `push_blocks` (P: the prompt blocks of each request in `reqs_to_send`, the only blocks D
    may have written) and `side_channel` (D: where its scheduler serves the workers'
    handshakes, named in D's registrations)."""

    reqs_to_recv: list[RemoteRead] = field(default_factory=list)
    reqs_to_send: dict[str, float] = field(default_factory=dict)
    reqs_not_processed: list[str] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    send_blocks: dict[str, list[int]] = field(default_factory=dict)
    push_blocks: dict[str, list[int]] = field(default_factory=dict)
    side_channel: tuple[str, int] | None = None
