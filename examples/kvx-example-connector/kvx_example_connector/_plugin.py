"""Registers the connector with kvx: names only, nothing heavy is imported here."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec(
        name="ExamplePDConnector",
        target="kvx_example_connector.connector:ExamplePDConnector",
        summary="example: prefill/decode hand-off through a shared directory",
        aliases=("ExamplePDConnectorV1",),
        config_schema="kvx_example_connector.config:ExamplePDConfig",
    )
)
