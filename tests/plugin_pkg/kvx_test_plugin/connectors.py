"""Connector classes of the test plugin, written only against kvx's public API."""

from typing import Any

import kvx
from kvx import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA

IMPORTED = True


class EchoConnector(KVConnectorBase_V1):
    """Loads nothing, saves nothing; records the calls it gets."""

    def __init__(self, config: kvx.KVTransferConfig, role: kvx.KVConnectorRole,
                 ctx: kvx.EngineContext) -> None:
        super().__init__(config, role, ctx)
        self.calls: list[str] = []

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        self.calls.append("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append("wait_for_layer_load")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self.calls.append("save_kv_layer")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_num_new_matched_tokens(self, request: kvx.Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: kvx.Request, blocks: kvx.KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.calls.append("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class EchoHMAConnector(EchoConnector, SupportsHMA):
    def request_finished_all_groups(self, request: kvx.Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        return False, None


class CompositeConnector(EchoHMAConnector):
    """Stands in for MultiConnector in config-validation tests."""


class FutureContractConnector(EchoConnector):
    contract_version = (2, 0)


class NotAConnector:
    pass


class ExternalConnector(EchoConnector):
    """Loaded through kv_connector_module_path; declares its own schema on the class."""

    extra_config_schema = None


class TwoArgConnector(EchoConnector):
    """vLLM's deprecated two-argument constructor: must be refused."""

    def __init__(self, config: kvx.KVTransferConfig, role: kvx.KVConnectorRole) -> None:
        raise AssertionError("must not be constructed")


TEST_LAYOUT = "test-layout-object"


def identity(x: Any) -> Any:
    return x


class TestBackend:
    pass
