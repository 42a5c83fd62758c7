"""A kvx connector implementing `kvx.SupportsHMA` that moves no KV: it keeps what the adapter
hands it with vLLM's hybrid allocator on (the context's layer groups, each finished request's
per-group tables), for test_hybrid_in_vllm.py. Loaded as `"hma_tables:RecordsGroups"`."""

from __future__ import annotations

from typing import Any

import kvx


class RecordsGroups(kvx.KVConnectorBase_V1, kvx.SupportsHMA):
    """Claims nothing, loads nothing; records the per-group block tables it is given."""

    def __init__(
        self, config: kvx.KVTransferConfig, role: kvx.KVConnectorRole, ctx: kvx.EngineContext
    ) -> None:
        super().__init__(config, role, ctx)
        self.finished: dict[str, tuple[list[int], ...]] = {}
        self.single_group_calls = 0

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any
    ) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> Any:
        return kvx.KVConnectorMetadata()

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.single_group_calls += 1
        return False, None

    def request_finished_all_groups(
        self, request: kvx.Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished[request.request_id] = tuple(list(t) for t in block_ids)
        return False, None
