"""vLLM's scheduler objects as kvx's engine-neutral types (`kvx.contract.types`).

Attribute access only (no vLLM import). Lists are shared, not copied, where kvx's contract says
the connector must not mutate them (scheduler output); a request's `kv_transfer_params` dict is
the very dict vLLM holds, so a connector's changes to it reach vLLM (matches vLLM, where
connectors mutate `request.kv_transfer_params` in place).
"""

from __future__ import annotations

from typing import Any

from kvx.contract.types import (
    NULL_BLOCK,
    BlockIds,
    CachedRequestData,
    KVCacheBlocks,
    NewRequestData,
    Request,
    RequestStatus,
    SchedulerOutput,
)

VLLM_NULL_BLOCK_ID = 0
"""vLLM's null block: its block pool's first block, never allocated, which stands in a request's
block table for blocks a sliding window no longer needs; kvx's tables say `NULL_BLOCK` there."""

# vLLM statuses kvx has no member for, by the kvx status with the same meaning to a connector.
_STATUS_ALIASES = {
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": RequestStatus.WAITING,
    "WAITING_FOR_STREAMING_REQ": RequestStatus.WAITING,
    "FINISHED_IGNORED": RequestStatus.FINISHED_LENGTH_CAPPED,  # vLLM reports "length" too
    "FINISHED_REPETITION": RequestStatus.FINISHED_STOPPED,
}


def request_status(status: Any) -> RequestStatus:
    """kvx's status for a vLLM `RequestStatus` member (by name)."""
    name = getattr(status, "name", str(status))
    if name in _STATUS_ALIASES:
        return _STATUS_ALIASES[name]
    try:
        return RequestStatus[name]
    except KeyError:
        raise ValueError(f"vLLM request status {name!r} has no kvx equivalent") from None


class RequestMirror:
    """One kvx `Request` per live vLLM request, refreshed before the connector sees it.

    A connector may keep the `Request` it was given (vLLM connectors keep vLLM's request); the
    mirror keeps handing out the same object and refreshes it from vLLM's request on every hook
    and once per step, so what it reads is current.
    """

    def __init__(self) -> None:
        self._live: dict[str, tuple[Any, Request]] = {}

    def get(self, vllm_request: Any) -> Request:
        req_id = vllm_request.request_id
        entry = self._live.get(req_id)
        if entry is None or entry[0] is not vllm_request:
            request = Request(request_id=req_id, prompt_token_ids=[])
            self._live[req_id] = (vllm_request, request)
        else:
            request = entry[1]
        _refresh(request, vllm_request)
        return request

    def refresh_all(self) -> None:
        for vllm_request, request in self._live.values():
            _refresh(request, vllm_request)

    def vllm_requests(self) -> list[Any]:
        """vLLM's live requests (those not yet finished)."""
        return [vllm_request for vllm_request, _ in self._live.values()]

    def params_of(self, req_id: str) -> dict[str, Any] | None:
        entry = self._live.get(req_id)
        return entry[1].kv_transfer_params if entry else None

    def write_back(self, vllm_request: Any) -> None:
        """A connector that replaced (not mutated) `kv_transfer_params` gets it into vLLM."""
        entry = self._live.get(vllm_request.request_id)
        if entry is not None and entry[1].kv_transfer_params is not vllm_request.kv_transfer_params:
            vllm_request.kv_transfer_params = entry[1].kv_transfer_params

    def forget(self, req_id: str) -> None:
        self._live.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._live)


def _refresh(request: Request, vllm_request: Any) -> None:
    prompt = vllm_request.prompt_token_ids
    request.prompt_token_ids = prompt if prompt is not None else []
    request.output_token_ids = list(vllm_request.output_token_ids)
    request.num_computed_tokens = vllm_request.num_computed_tokens
    request.max_tokens = vllm_request.max_tokens
    request.kv_transfer_params = vllm_request.kv_transfer_params
    request.status = request_status(vllm_request.status)
    request.block_hashes = list(vllm_request.block_hashes)
    request.mm_hashes = [f.identifier for f in vllm_request.mm_features or ()]


def table(block_ids: list[int]) -> list[int]:
    """A vLLM block table as kvx's: a new list, vLLM's null block as `NULL_BLOCK`."""
    return [NULL_BLOCK if b == VLLM_NULL_BLOCK_ID else b for b in block_ids]


def tables(block_ids: Any) -> BlockIds:
    """vLLM's per-group block tables as kvx's `BlockIds` (see `table`)."""
    return tuple(table(group) for group in block_ids)


def kv_cache_blocks(blocks: Any) -> KVCacheBlocks:
    """vLLM's `KVCacheBlocks` (per group, `KVCacheBlock`s) as block ids (vLLM's null block as
    `NULL_BLOCK`) plus the count of leading blocks needing no KV (`_leading_hits`) per group."""
    groups = tuple(blocks.blocks)
    ids = tuple([NULL_BLOCK if b.is_null else b.block_id for b in group] for group in groups)
    return KVCacheBlocks(ids, tuple(_leading_hits(group) for group in groups))


def _leading_hits(group: Any) -> int:
    """Leading blocks a request need not be given KV for: prefix-cache hits (with a hash) and
    null blocks outside its sliding window (always before the hits)."""
    count = 0
    for block in group:
        if not (block.is_null or block.block_hash is not None):
            break
        count += 1
    return count


def scheduler_output(out: Any, mirror: RequestMirror) -> SchedulerOutput:
    """vLLM's `SchedulerOutput` as kvx's (new requests get their live `kv_transfer_params`)."""
    new = [
        NewRequestData(
            req_id=r.req_id,
            prompt_token_ids=r.prompt_token_ids if r.prompt_token_ids is not None else [],
            block_ids=tables(r.block_ids),
            num_computed_tokens=r.num_computed_tokens,
            kv_transfer_params=mirror.params_of(r.req_id),
            mm_hashes=[f.identifier for f in r.mm_features or ()],
        )
        for r in out.scheduled_new_reqs
    ]
    c = out.scheduled_cached_reqs
    cached = CachedRequestData(
        req_ids=c.req_ids,
        resumed_req_ids=set(c.resumed_req_ids),
        new_token_ids=c.new_token_ids,
        all_token_ids=c.all_token_ids,
        new_block_ids=[None if b is None else tables(b) for b in c.new_block_ids],
        num_computed_tokens=c.num_computed_tokens,
    )
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=out.num_scheduled_tokens,
        finished_req_ids=set(out.finished_req_ids),
        preempted_req_ids=set(out.preempted_req_ids or ()),
    )
