"""Registers the connector with kvx: names only, nothing heavy is imported here."""

import kvx
from kvx import ConnectorSpec


@kvx.hookimpl
def kvx_connectors() -> list[ConnectorSpec]:
    return [
        ConnectorSpec(
            name="ExamplePDConnector",
            target="kvx_example_connector.connector:ExamplePDConnector",
            summary="example: prefill/decode hand-off through a shared directory",
            aliases=("ExamplePDConnectorV1",),
            config_schema="kvx_example_connector.config:ExamplePDConfig",
        )
    ]
