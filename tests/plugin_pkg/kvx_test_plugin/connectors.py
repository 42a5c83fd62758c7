"""Connector classes of the test plugin, written only against kvx's public API."""

from dataclasses import dataclass
from typing import Any

import kvx
from kvx import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA

IMPORTED = True


class EchoConnector(KVConnectorBase_V1):
    """Loads nothing, saves nothing; records the calls it gets."""

    def __init__(
        self, config: kvx.KVTransferConfig, role: kvx.KVConnectorRole, ctx: kvx.EngineContext
    ) -> None:
        super().__init__(config, role, ctx)
        self.calls: list[str] = []

    def start_load_kv(self, forward_context: kvx.ForwardContext, **kwargs: Any) -> None:
        self.calls.append("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append("wait_for_layer_load")

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.calls.append("save_kv_layer")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.calls.append("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class EchoHMAConnector(EchoConnector, SupportsHMA):
    def request_finished_all_groups(
        self, request: kvx.Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
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


class TestBackend(kvx.StorageBackend):
    """A third-party backend with the four plain calls only (no listing): a dict."""

    def __init__(self, url: str, options: kvx.StorageBackendOptions) -> None:
        super().__init__(url, options)
        self.values: dict[str, bytes] = {}

    def put_many(self, items: Any) -> None:
        self.values.update((key, bytes(value)) for key, value in items)

    def get_many(self, keys: Any, max_bytes: int) -> list[bytes | None]:
        return [self.values.get(key) for key in keys]

    def exists_many(self, keys: Any) -> list[bool]:
        return [key in self.values for key in keys]

    def close(self) -> None:
        self.values.clear()


CALLS: dict[str, list[tuple[str, object]]] = {}


@dataclass
class ScriptedMetadata(KVConnectorMetadata):
    """Plain fields: metadata crosses to each worker as msgpack bytes."""

    finished: list[str]


class ScriptedConnector(EchoConnector):
    """Answers and acts as its extra config says, and logs every call under its name."""

    def __init__(
        self, config: kvx.KVTransferConfig, role: kvx.KVConnectorRole, ctx: kvx.EngineContext
    ) -> None:
        super().__init__(config, role, ctx)
        from kvx_test_plugin.schemas import ScriptedConfig

        self.script = config.extra_config_as(ScriptedConfig)
        self.log = CALLS.setdefault(self.script.name, [])
        self._held: list[str] = []
        self._sent: set[str] = set()

    @classmethod
    def get_required_kvcache_layout(
        cls, config: kvx.KVTransferConfig, ctx: kvx.EngineContext | None = None
    ) -> str | None:
        return config.kv_connector_extra_config.get("layout")

    def get_num_new_matched_tokens(
        self, request: kvx.Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.log.append(("match", request.request_id))
        return self.script.tokens, self.script.load_async and self.script.tokens > 0

    def update_state_after_alloc(
        self, request: kvx.Request, blocks: kvx.KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.log.append(("alloc", num_external_tokens))

    def request_finished(
        self, request: kvx.Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.log.append(("finished", request.request_id))
        if self.script.hold:
            self._held.append(request.request_id)
        return self.script.hold, dict(self.script.params) or None

    def build_connector_meta(self, scheduler_output: kvx.SchedulerOutput) -> KVConnectorMetadata:
        meta, self._held = ScriptedMetadata(self._held), []
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, ScriptedMetadata)
        self._sent.update(connector_metadata.finished)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self._sent = self._sent, set()
        return sent or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.script.load_errors)

    def get_finished_count(self) -> int | None:
        return self.script.finished_count

    def get_kv_connector_stats(self) -> kvx.KVConnectorStats | None:
        return kvx.KVConnectorStats({"calls": len(self.log)})

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> kvx.KVConnectorStats | None:
        return kvx.KVConnectorStats(dict(data or {}))


def echo_args(prog: str, argv: list[str]) -> int:
    """The `kvx echo-args` subcommand: prints its name and words; exits 3 to be recognised."""
    print(prog, *argv)
    return 3
