"""The scheduler half: P keeps a finished prompt's blocks until its file is written; D claims a
remote prompt's tokens and asks its workers to load them."""

from __future__ import annotations

from typing import Any

import kvx
from kvx import ConnectorScheduler
from kvx_example_connector.config import ExamplePDConfig
from kvx_example_connector.metadata import ExamplePDMetadata, LoadSpec, StoreSpec

FINISHED_NORMALLY = (kvx.RequestStatus.FINISHED_LENGTH_CAPPED, kvx.RequestStatus.FINISHED_STOPPED)


class ExamplePDScheduler(ConnectorScheduler):
    def __init__(
        self, options: ExamplePDConfig, config: kvx.KVTransferConfig, ctx: kvx.EngineContext
    ) -> None:
        self.engine_id = str(config.engine_id)
        self.block_size = ctx.cache.block_size
        self._meta = ExamplePDMetadata()

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """D: every prompt token not computed here comes from P's file, asynchronously."""
        wanted = bool((request.kv_transfer_params or {}).get("do_remote_prefill"))
        missing = request.num_prompt_tokens - num_computed_tokens if wanted else 0
        return max(missing, 0), missing > 0

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # load once, even if called again
        if num_external_tokens > 0:
            self._meta.loads.append(
                LoadSpec(
                    request.request_id,
                    blocks.get_unhashed_block_ids(),
                    params["remote_engine_id"],
                    params["remote_request_id"],
                    list(params["remote_block_ids"]),
                )
            )

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> ExamplePDMetadata:
        meta, self._meta = self._meta, ExamplePDMetadata()
        return meta

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: a prompt D will decode is kept until the workers wrote its blocks."""
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or request.status not in FINISHED_NORMALLY:
            return False, None
        prompt_blocks = block_ids[: -(-request.num_prompt_tokens // self.block_size)]
        # Entries outside a sliding window (kvx.NULL_BLOCK) have no block: not saved.
        saved = prompt_blocks[kvx.skipped_blocks(prompt_blocks) :]
        self._meta.stores.append(StoreSpec(request.request_id, saved))
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": prompt_blocks,
            "remote_num_tokens": request.num_prompt_tokens,
        }
