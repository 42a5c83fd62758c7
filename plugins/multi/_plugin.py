"""Registers MultiConnector (names only; nothing is imported until it is used)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec(
        name="MultiConnector",
        target="kvx.plugins.multi:MultiConnector",
        summary="composes connectors: load from the first with a hit, save to all",
        config_schema="kvx.plugins.multi.config:MultiConnectorConfig",
        child_configs_key="connectors",
    )
)
