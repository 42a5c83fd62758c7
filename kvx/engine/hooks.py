"""Drive a worker-side connector around one forward pass exactly as vLLM's model runner does.

Order per step: `handle_preemptions` (if the step preempted requests) -> `bind_connector_metadata`
-> `start_load_kv` -> per layer `wait_for_layer_load` ... attention ... `save_kv_layer` ->
`wait_for_save` -> collect results (`get_transfer_results`, `get_block_ids_with_load_errors`,
stats, events, worker metadata) -> `clear_connector_metadata`. A step with no scheduled tokens
still runs the hooks while metadata exists (the "no-forward" path), so asynchronous transfers
make progress while the engine has nothing to compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvx.contract.auxiliary import KVConnectorMetadata, KVConnectorOutput
from kvx.contract.base import KVConnectorBase_V1
from kvx.contract.types import ForwardContext, SchedulerOutput


class LayerHooks:
    """What a layer calls inside the forward pass: wait for its KV, then save it."""

    def __init__(self, connector: KVConnectorBase_V1, attn_metadata: Any = None) -> None:
        self._connector = connector
        self._attn_metadata = attn_metadata

    def before_attention(self, layer_name: str) -> None:
        self._connector.wait_for_layer_load(layer_name)

    def after_kv_write(self, layer_name: str, kv_layer: Any) -> None:
        self._connector.save_kv_layer(layer_name, kv_layer, self._attn_metadata)


@contextmanager
def connector_forward(
    connector: KVConnectorBase_V1,
    scheduler_output: SchedulerOutput,
    forward_context: ForwardContext,
    output: KVConnectorOutput,
) -> Iterator[LayerHooks]:
    """Wrap one forward pass; fills `output` with the connector's results on exit.

    Results are collected even when the forward raises, and the metadata is always cleared.
    """
    metadata = scheduler_output.kv_connector_metadata
    if scheduler_output.preempted_req_ids:
        connector.handle_preemptions(set(scheduler_output.preempted_req_ids))
    if not isinstance(metadata, KVConnectorMetadata):
        raise TypeError(
            "scheduler_output.kv_connector_metadata must be the KVConnectorMetadata built by "
            f"the scheduler-side connector, got {type(metadata).__name__}"
        )
    connector.bind_connector_metadata(metadata)
    try:
        connector.start_load_kv(forward_context)
        try:
            yield LayerHooks(connector, forward_context.attn_metadata)
        finally:
            connector.wait_for_save()
            _collect(connector, scheduler_output.finished_req_ids, output)
    finally:
        connector.clear_connector_metadata()


def _collect(connector: KVConnectorBase_V1, finished: set[str], output: KVConnectorOutput) -> None:
    results = connector.get_transfer_results(set(finished))
    output.finished_sending = results.finished_sending or None
    output.finished_recving = set(results.finished_recving) or None
    output.failed_recving = set(results.failed_recving)
    output.invalid_block_ids = set(connector.get_block_ids_with_load_errors())
    output.kv_connector_stats = connector.get_kv_connector_stats()
    output.kv_cache_events = connector.get_kv_connector_kv_cache_events()
    output.kv_connector_worker_meta = connector.build_connector_worker_meta()


def run_connector_step(
    connector: KVConnectorBase_V1,
    scheduler_output: SchedulerOutput,
    forward_context: ForwardContext,
    forward: Callable[[LayerHooks], None] | None,
) -> KVConnectorOutput:
    """Run one step: `forward(hooks)` when tokens are scheduled, the no-forward path otherwise."""
    output = KVConnectorOutput()
    with connector_forward(connector, scheduler_output, forward_context, output) as hooks:
        if forward is not None and scheduler_output.total_num_scheduled_tokens > 0:
            forward(hooks)
    connector.finish_forward()
    return output
