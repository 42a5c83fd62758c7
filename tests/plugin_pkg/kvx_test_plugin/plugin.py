"""Hook implementations: what this plugin provides (names only, nothing imported)."""

import kvx
from kvx import CommandSpec, ConnectorSpec, LayoutSpec, StorageBackendSpec, TransformSpec


@kvx.hookimpl
def kvx_connectors() -> list[ConnectorSpec]:
    return [
        ConnectorSpec(
            name="EchoConnector",
            target="kvx_test_plugin.connectors:EchoConnector",
            summary="does nothing, answers every hook",
            aliases=("TestEcho",),
            config_schema="kvx_test_plugin.schemas:EchoConfig",
        ),
        ConnectorSpec(
            name="EchoHMAConnector",
            target="kvx_test_plugin.connectors:EchoHMAConnector",
            summary="EchoConnector that supports HMA",
        ),
        ConnectorSpec(
            name="CompositeConnector",
            target="kvx_test_plugin.connectors:CompositeConnector",
            summary="holds child connector configs, like MultiConnector",
            config_schema="kvx_test_plugin.schemas:CompositeConfig",
            child_configs_key="connectors",
        ),
        ConnectorSpec(
            name="ScriptedConnector",
            target="kvx_test_plugin.connectors:ScriptedConnector",
            summary="answers and acts as its extra config says (for composition tests)",
            config_schema="kvx_test_plugin.schemas:ScriptedConfig",
        ),
        ConnectorSpec(
            name="NeedsMissingDependency",
            target="kvx_test_plugin.connectors:EchoConnector",
            summary="declares a dependency that is never installed",
            requires=("kvx_test_never_installed_dependency",),
            extra="fake-extra",
        ),
        ConnectorSpec(
            name="ImportsMissingDependency",
            target="kvx_test_plugin.imports_missing:Connector",
            summary="its module imports a package that is not installed",
            extra="fake-extra",
        ),
        ConnectorSpec(
            name="FutureContractConnector",
            target="kvx_test_plugin.connectors:FutureContractConnector",
            summary="built for contract 2.0",
        ),
        ConnectorSpec(
            name="BrokenTarget",
            target="kvx_test_plugin.connectors:NoSuchClass",
            summary="its target names a class its module does not have",
        ),
        ConnectorSpec(
            name="NotAConnector",
            target="kvx_test_plugin.connectors:NotAConnector",
            summary="a class that is not a KVConnectorBase_V1",
        ),
    ]


@kvx.hookimpl
def kvx_layouts() -> list[LayoutSpec]:
    return [LayoutSpec(name="TEST_LAYOUT", target="kvx_test_plugin.connectors:TEST_LAYOUT")]


@kvx.hookimpl
def kvx_transforms() -> list[TransformSpec]:
    return [TransformSpec(name="test_identity", target="kvx_test_plugin.connectors:identity")]


@kvx.hookimpl
def kvx_storage_backends() -> list[StorageBackendSpec]:
    return [
        StorageBackendSpec(
            name="testmem",
            target="kvx_test_plugin.connectors:TestBackend",
            schemes=("testmem",),
        )
    ]


@kvx.hookimpl
def kvx_cli_commands() -> list[CommandSpec]:
    return [CommandSpec("echo-args", "kvx_test_plugin.connectors:echo_args", summary="prints argv")]
